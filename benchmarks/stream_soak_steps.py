"""The streaming pipeline of the soak (benchmarks/stream_soak.py): textgen's shape (tokenize ->
decode, a generator of one token per response -> detokenize each token), with a decoder that
fails, or makes the step after it fail, part-way through when the prompt asks, and that leaves
one line per stream saying how its generator ended. Only numpy and the standard library: this
file travels to the server as its source.

A prompt is ``<tag>|<text>``. The text alone is what the decoder generates from (the same text,
the same tokens, whatever the tag). The tag's last character says what the stream does:
``c`` completes, ``x`` is cancelled by the client (a stream :data:`LONG` times as long, which
completes unless it is stopped),
``f`` raises in the decoder after :data:`FAIL_AT` tokens, ``d`` yields an invalid token there,
which the detokenizer refuses.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pipelines import Pipeline, TensorSpec, step

FAIL_AT = 4  # the responses a failing stream gives before its failure
LONG = 4  # a stream to be cancelled generates this many times max_new_tokens
BAD_TOKEN = 1  # never generated (printable ASCII only): the detokenizer refuses it
SEP = ord("|")
PROMPT = TensorSpec("BYTES", [1])
TOKEN = TensorSpec("INT32", [1])


@step(inputs={"prompt": PROMPT}, outputs={"tokens": TensorSpec("INT32", [-1])})
def tokenize(prompt):
    """Byte-level: each byte of the prompt (its tag too) is one token."""
    return {"tokens": np.frombuffer(bytes(prompt[0]), dtype=np.uint8).astype(np.int32)}


@step(
    inputs={"tokens": TensorSpec("INT32", [-1])},
    outputs={"token": TOKEN},
    parameters={"max_new_tokens": 24, "marks": "", "token_ms": 0.0},
)
class Decoder:
    """textgen's decoder in small: one attention layer over bytes with random weights (seed 0),
    sampling with a generator seeded by the text, so each token costs more than the one before.
    Appends ``<tag> <how> <tokens> <time.time()>`` to ``<marks>/ends`` when its generator ends; how: ``ended``
    (it ran to its end), ``closed`` (stopped from outside: GeneratorExit) or ``failed``."""

    def initialize(self, config):
        params = config["parameters"]
        self.max_new_tokens = int(params.get("max_new_tokens", 24))
        self.marks = params.get("marks") or ""
        self.pause = float(params.get("token_ms", 0.0)) / 1e3  # a real decoder's time per token, slept
        rng = np.random.default_rng(0)
        width = 64
        self.embed = rng.normal(0, 1, (256, width)).astype(np.float32)
        self.position = rng.normal(0, 0.1, (512, width)).astype(np.float32)
        self.wq, self.wk, self.wv = (rng.normal(0, width**-0.5, (width, width)).astype(np.float32) for _ in range(3))
        self.unembed = rng.normal(0, width**-0.5, (width, 256)).astype(np.float32)
        self.allowed = np.full(256, -np.inf, dtype=np.float32)
        self.allowed[32:127] = 0.0  # printable ASCII only: no end token, every stream is max_new_tokens long

    def execute(self, tokens):
        cut = int(np.argmax(tokens == SEP)) if (tokens == SEP).any() else -1
        tag = bytes(tokens[:cut].astype(np.uint8)).decode() if cut >= 0 else ""
        text = tokens[cut + 1 :][-(512 - self.max_new_tokens * LONG) :]
        kind = tag[-1:] or "c"
        # A stream its client gives up on is a long one: stopped, it ends well before its limit.
        limit = self.max_new_tokens * LONG if kind == "x" else self.max_new_tokens
        sent, how = 0, "ended"
        try:
            for token in self._generate(text, limit):
                if sent == FAIL_AT and kind == "f":
                    raise ValueError(f"the decoder fails on purpose after {sent} tokens")
                if sent == FAIL_AT and kind == "d":
                    token = BAD_TOKEN
                yield {"token": np.array([token], dtype=np.int32)}
                sent += 1
        except GeneratorExit:
            how = "closed"
            raise
        except Exception:
            how = "failed"
            raise
        finally:
            self._mark(f"{tag or '-'} {how} {sent} {time.time():.6f}\n")

    def _generate(self, text, limit):
        hidden = self.embed[text] + self.position[: len(text)]
        keys, values = hidden @ self.wk, hidden @ self.wv
        rng = np.random.default_rng(int(text.sum()))
        last = hidden[-1]
        for _ in range(limit):
            if self.pause:
                time.sleep(self.pause)
            scores = keys @ (last @ self.wq) / np.sqrt(keys.shape[1])
            weights = np.exp(scores - scores.max())
            logits = ((weights / weights.sum()) @ values + last) @ self.unembed + self.allowed
            probs = np.exp(logits - logits.max())
            token = int(rng.choice(256, p=probs / probs.sum()))
            yield token
            last = self.embed[token] + self.position[len(keys)]
            keys = np.vstack([keys, last @ self.wk])
            values = np.vstack([values, last @ self.wv])

    def _mark(self, line):
        if not self.marks:
            return
        # One write of a short line with O_APPEND: lines from several processes do not interleave.
        fd = os.open(os.path.join(self.marks, "ends"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


@step(inputs={"token": TOKEN}, outputs={"text": PROMPT})
def detokenize(token):
    """One token's text (one printable byte); the invalid token of a ``d`` stream is refused."""
    if int(token[0]) == BAD_TOKEN:
        raise ValueError(f"token {BAD_TOKEN} is not text")
    return {"text": np.array([bytes([int(token[0])])], dtype=object)}


def make_soak(marks: str, *, name: str = "soak", max_new_tokens: int = 24, token_ms: float = 1.0) -> Pipeline:
    """tokenize -> decode -> detokenize; the decoder leaves its marks in the folder ``marks`` and
    sleeps ``token_ms`` per token (so that a client's cancel reaches it mid-stream)."""
    p = Pipeline(name, inputs={"prompt": PROMPT})
    tokens = p.add(tokenize, prompt=p.input("prompt"))
    decoder = Decoder.with_options(parameters={"max_new_tokens": max_new_tokens, "marks": marks,
                                                   "token_ms": token_ms})
    generated = p.add(decoder, name="decode", tokens=tokens["tokens"])
    p.output("text", p.add(detokenize, token=generated["token"])["text"])
    return p
