"""The requests a benchmark sends: :mod:`pipelines.commands.sample_inputs`, which the prediction
shares, under the name the benchmark has always given them; and the user's prompts, one
request per line of a text file (``--input prompts.txt``), for a pipeline that takes text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..commands.sample_inputs import random_request, sample_requests
from ..core.graph import Graph
from ..errors import PipelinesError

__all__ = [
    "PROMPT_SUFFIXES", "given_requests", "is_prompt_file", "prompt_requests", "random_request", "sample_requests",
]

#: Files ``--input`` reads as prompts, one per line (anything else is a ``NAME=FILE.npy``).
PROMPT_SUFFIXES = (".txt",)


def is_prompt_file(argument: str) -> bool:
    """Whether an ``--input`` argument (``FILE.txt`` or ``NAME=FILE.txt``) names a prompt file."""
    return argument.partition("=")[2 if "=" in argument else 0].lower().endswith(PROMPT_SUFFIXES)


def prompt_requests(pipeline: Graph, argument: str, others: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One request per non-empty line of the prompt file ``argument`` names (``FILE.txt``, for the
    pipeline's one BYTES input, or ``NAME=FILE.txt``): the line, UTF-8, as that input's one string,
    with ``others`` (the pipeline's other inputs, from ``.npy`` files) in every request."""
    name, sep, file = argument.partition("=")
    if not sep:
        name, file = _text_input(pipeline, argument), argument
    spec = pipeline.inputs.get(name)
    if spec is None:
        raise PipelinesError(f"--input {argument}: pipeline {pipeline.name!r} has no input {name!r}; its inputs are "
                             f"{sorted(pipeline.inputs)}", pipeline=pipeline.name, tensor=name)
    if spec.dtype != "BYTES" or any(d not in (1, -1) for d in spec.dims):
        raise PipelinesError(
            f"--input {argument}: a prompt file gives one string per request, and input {name!r} of pipeline "
            f"{pipeline.name!r} is {spec.dtype} {list(spec.dims)}: give it as {name}=FILE.npy",
            pipeline=pipeline.name, tensor=name,
        )
    try:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PipelinesError(f"--input {argument}: cannot read {file!r} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise PipelinesError(f"--input {argument}: {file!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise PipelinesError(f"--input {argument}: {file!r} holds no prompt; write one prompt per line")
    shape = ((1,) if pipeline.batched else ()) + (1,) * len(spec.dims)
    return [{**(others or {}), name: np.array([p.encode()], dtype=object).reshape(shape)} for p in prompts]


def _text_input(pipeline: Graph, file: str) -> str:
    texts = [n for n, spec in pipeline.inputs.items() if spec.dtype == "BYTES"]
    if len(texts) != 1:
        said = f"inputs {texts}" if texts else "no BYTES input"
        raise PipelinesError(
            f"--input {file}: a prompt file feeds a pipeline's one text (BYTES) input, and pipeline "
            f"{pipeline.name!r} has {said}" + (": name one, --input NAME=" + file if texts else ""),
            pipeline=pipeline.name,
        )
    return texts[0]


def given_requests(pipeline: Graph, arguments: Sequence[str], parse_npy: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """The request(s) ``--input`` arguments make: ``NAME=FILE.npy`` tensors (``parse_npy`` reads
    them), and at most one prompt file, which makes one request per prompt."""
    prompts = [a for a in arguments if is_prompt_file(a)]
    if len(prompts) > 1:
        raise PipelinesError(f"--input: one prompt file at a time; got {prompts}")
    tensors = parse_npy([a for a in arguments if not is_prompt_file(a)], pipeline)
    return prompt_requests(pipeline, prompts[0], tensors) if prompts else tensors
