"""A small text-generation pipeline that streams, on CPU in seconds: tokenize -> decode (a
generator, one token per response) -> detokenize (reads the stream whole), with a safety check
on the prompt beside the tokenizer that skips generation for a prompt it refuses.

``make_textgen(gate=False)`` is the same generation without the safety check, detokenized token
by token (``detokenize_token``): no ``when`` block and no step that reads the stream whole, so
the ensemble form can run it too, and all four forms can be compared on it.

The decoder is a one-layer attention decoder over bytes with random weights (a fixed seed): its
text means nothing, but it works as a real one does, one token at a time, each attending over
every token so far through a key/value cache, so a token costs more the longer the text.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator

import numpy as np

from ..core.step import step
from ..core.tensor import TensorSpec
from ..pipeline import Pipeline

__all__ = [
    "BLOCKED",
    "Decoder",
    "decode",
    "detokenize",
    "detokenize_token",
    "make_textgen",
    "pipeline",
    "safety",
    "sample_inputs",
    "tokenize",
]

#: Prompts that contain one of these words are refused: no token is generated.
BLOCKED = (b"forbidden", b"secret")
#: What a refused prompt is answered with: one response.
REFUSED = b"[refused]"
VOCAB = 256  # one token per byte
EOS = 0  # the byte that ends a text


@step(inputs={"prompt": TensorSpec("BYTES", [1])}, outputs={"tokens": TensorSpec("INT32", [-1])})
def tokenize(prompt):
    """Byte-level: each byte of the UTF-8 prompt is one token."""
    return {"tokens": np.frombuffer(bytes(prompt[0]), dtype=np.uint8).astype(np.int32)}


@step(inputs={"prompt": TensorSpec("BYTES", [1])}, outputs={"safe": TensorSpec("BOOL", [1])})
def safety(prompt):
    text = bytes(prompt[0]).lower()
    return {"safe": np.array([not any(word in text for word in BLOCKED)])}


class Decoder:
    """One attention layer over bytes with random weights, sampling each token with a generator
    seeded by the prompt (the same prompt, the same text): ``initialize`` builds the weights once per instance (seed 0), ``execute`` yields
    one token per response until ``EOS`` or ``max_new_tokens``."""

    def initialize(self, config):
        rng = np.random.default_rng(0)
        width = int(config["parameters"].get("width", 128))
        self.max_new_tokens = int(config["parameters"].get("max_new_tokens", 48))
        self.context = 512
        self.embed = rng.normal(0, 1, (VOCAB, width)).astype(np.float32)
        self.position = rng.normal(0, 0.1, (self.context, width)).astype(np.float32)
        self.wq, self.wk, self.wv = (rng.normal(0, width**-0.5, (width, width)).astype(np.float32) for _ in range(3))
        self.unembed = rng.normal(0, width**-0.5, (width, VOCAB)).astype(np.float32)
        # Printable ASCII and EOS only, so that the text prints.
        self.allowed = np.full(VOCAB, -np.inf, dtype=np.float32)
        self.allowed[32:127] = 0.0
        self.allowed[EOS] = 0.0

    def execute(self, tokens) -> Iterator[dict[str, np.ndarray]]:
        tokens = tokens[-(self.context - self.max_new_tokens) :]
        hidden = self.embed[tokens] + self.position[: len(tokens)]
        keys, values = hidden @ self.wk, hidden @ self.wv  # the cache every new token attends over
        rng = np.random.default_rng(int(tokens.sum()))
        last = hidden[-1]
        for _ in range(self.max_new_tokens):
            scores = keys @ (last @ self.wq) / np.sqrt(keys.shape[1])
            weights = np.exp(scores - scores.max())
            attended = (weights / weights.sum()) @ values
            logits = (attended + last) @ self.unembed + self.allowed
            probs = np.exp(logits - logits.max())
            token = int(rng.choice(VOCAB, p=probs / probs.sum()))
            if token == EOS:
                return
            yield {"token": np.array([token], dtype=np.int32)}
            last = self.embed[token] + self.position[len(keys)]
            keys = np.vstack([keys, last @ self.wk])
            values = np.vstack([values, last @ self.wv])


decode = step(
    Decoder,
    name="decode",
    inputs={"tokens": TensorSpec("INT32", [-1])},
    outputs={"token": TensorSpec("INT32", [1])},
    parameters={"max_new_tokens": 48},
)


@step(
    inputs={"token": TensorSpec("INT32", [1])},
    outputs={"text": TensorSpec("BYTES", [1])},
    whole_stream=True,
)
def detokenize(token):
    """Reads the tokens of one request as they come and yields the text each completes: a
    character of several bytes spans several tokens, so the decoder's state is the request's."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in token:
        yield {"text": np.array([utf8.decode(bytes([int(t[0])])).encode()], dtype=object)}


@step(inputs={"token": TensorSpec("INT32", [1])}, outputs={"text": TensorSpec("BYTES", [1])})
def detokenize_token(token):
    """One token's text on its own: the decoder samples printable ASCII only, one byte a
    character, so no character spans two tokens and no state is needed."""
    return {"text": np.array([bytes([int(token[0])])], dtype=object)}


def make_textgen(*, name: str = "textgen", max_new_tokens: int = 48, gate: bool = True) -> Pipeline:
    """The pipeline; ``gate=False``: no safety check and a token-by-token detokenizer (every form)."""
    p = Pipeline(name, inputs={"prompt": TensorSpec("BYTES", [1])})
    tokens = p.add(tokenize, prompt=p.input("prompt"))
    decoder = decode.with_options(parameters={"max_new_tokens": max_new_tokens})
    if not gate:
        generated = p.add(decoder, tokens=tokens["tokens"])
        p.output("text", p.add(detokenize_token, token=generated["token"])["text"])
        return p
    check = p.add(safety, prompt=p.input("prompt"))
    with p.when(check["safe"]):
        generated = p.add(decoder, tokens=tokens["tokens"])
        text = p.add(detokenize, token=generated["token"])
    p.output("text", text["text"], otherwise=REFUSED)
    return p


def sample_inputs(batch: int = 1, *, prompt: str = "Streaming pipelines answer") -> dict[str, np.ndarray]:
    """One prompt (the pipeline takes one request at a time: ``batch`` is the samples' convention)."""
    return {"prompt": np.array([prompt.encode()], dtype=object)}


pipeline = make_textgen()
