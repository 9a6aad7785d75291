"""What the command lines read from their arguments: input tensors from ``.npy`` files, as
``--input NAME=FILE.npy`` gives them to ``pipelines run``, ``predict`` and ``advise`` (numeric
arrays, or str/bytes arrays for BYTES inputs, never a pickle that could run code), and
concurrency levels (``--concurrency 1,4,16``) and forms (``--forms ensemble,fused``)."""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Sequence
from typing import Any

from ..errors import PipelinesError
from ..forms import FORMS

__all__ = ["parse_forms", "parse_inputs", "parse_levels"]


def parse_inputs(pairs: Sequence[str], pipeline: Any) -> dict[str, Any]:
    inputs = {}
    for pair in pairs:
        name, sep, file = pair.partition("=")
        if not sep or not name or not file:
            raise PipelinesError(f"--input {pair!r} is not NAME=FILE.npy")
        inputs[name] = _as_declared(_load_npy(name, file), pipeline.inputs.get(name))
    return inputs


# What unpickling an object array of str/bytes saved by np.save needs, and nothing more:
# a .npy that names any other global is refused instead of running its code.
_NPY_OBJECT_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # bytes, as protocol 2 pickles them
}


class _StringArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _NPY_OBJECT_GLOBALS:
            raise pickle.UnpicklingError(f"it holds a pickled {module}.{name}, not strings")
        return super().find_class(module, name)


def _load_npy(name: str, file: str) -> Any:
    """``np.load`` without pickles, except object arrays of str/bytes (BYTES tensors), read safely."""
    import numpy as np

    from ..serving import bytes_tensor

    try:
        with open(file, "rb") as f:
            magic = f.read(len(np.lib.format.MAGIC_PREFIX))
    except OSError as exc:
        raise PipelinesError(f"--input {name}: cannot read {file!r} ({exc.strerror or exc})") from None
    if magic != np.lib.format.MAGIC_PREFIX:
        # np.load would take any other file for a pickle, and say so
        raise PipelinesError(
            f"--input {name}: {file!r} is not a .npy file (it does not start with numpy's magic "
            f"{np.lib.format.MAGIC_PREFIX!r}); save the array with np.save(path, array)"
        )
    try:
        return np.load(file, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" not in str(exc):
            raise PipelinesError(f"--input {name}: cannot load {file!r} as a .npy array ({exc})") from None
    except (OSError, EOFError) as exc:
        raise PipelinesError(f"--input {name}: cannot load {file!r} as a .npy array ({exc})") from None
    try:
        with open(file, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            read_header(f)
            array = _StringArrayUnpickler(f).load()
    except (OSError, EOFError, ValueError, pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise PipelinesError(
            f"--input {name}: {file!r} is an object array that is not str or bytes ({exc}); "
            "--input takes numeric arrays, or arrays of str/bytes for BYTES inputs"
        ) from None
    kinds = {type(v).__name__ for v in np.asarray(array, dtype=object).flat if not isinstance(v, (str, bytes))}
    if not isinstance(array, np.ndarray) or kinds:
        raise PipelinesError(
            f"--input {name}: {file!r} holds {sorted(kinds) or type(array).__name__} objects; "
            "--input takes numeric arrays, or arrays of str/bytes for BYTES inputs"
        )
    # BYTES tensors are object arrays of bytes, as tritonclient sends them; str is sent as UTF-8.
    return bytes_tensor(array)


def _as_declared(array: Any, spec: Any) -> Any:
    """A BF16 array comes back from np.save as raw 2-byte records (``|V2``): view it as BF16 again."""
    if spec is not None and spec.dtype == "BF16" and array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return array.view(spec.numpy_dtype)
    return array


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; also ``"1:16"`` for powers of two from 1 to 16, like perf_analyzer's range."""
    text = text.strip()
    try:
        if ":" in text:
            low, high = (int(x) for x in text.split(":", 1))
            levels = []
            c = max(low, 1)
            while c <= high:
                levels.append(c)
                c *= 2
        else:
            levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of concurrency levels such as 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: concurrency levels must be integers >= 1, such as 1,2,4,8")
    return tuple(levels)


def parse_forms(text: str) -> tuple[str, ...]:
    """``"ensemble,fused"`` -> ``("ensemble", "fused")``: some of the forms, by name."""
    forms = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(f"{text!r}: forms are some of {','.join(FORMS)}")
    return forms
