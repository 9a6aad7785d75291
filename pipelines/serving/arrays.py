"""Arrays as a step returns them and as it asks to be handed them (``@step(array=...)``):
numpy on the host, CuPy on a GPU, anything that speaks DLPack read without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import Refused
from .dlpack import HostView, bf16_from_dlpack, host_capsule


def read_only(value: Any) -> Any:
    """``value`` as a step may take it: a numpy array becomes a read-only view of the same memory.

    Where arrays pass from step to step without a copy (the local runtime, the fused model), a
    step that wrote into its input would change what a sibling or a later step reads (on the
    server each step model gets its own copy); a read-only view makes that write an error that
    names the step, in every form that shares memory. The owner of the memory keeps writing it.
    """
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    return value


def as_arrays(outputs: dict[str, Any]) -> dict[str, Any]:
    """A step's outputs as numpy (host) or CuPy (GPU) arrays, in place.

    What every form does before checking a step's outputs. Anything that speaks
    DLPack (PyTorch, JAX, CuPy, numpy, a producer of one's own) is taken without a
    copy, and its dtype and shape are then DLPack's; lists and scalars are read with
    ``np.asarray``, so a list is taken (or refused, by its dtype) alike everywhere.
    """
    for name, value in outputs.items():
        if type(value) is not np.ndarray:
            outputs[name] = as_array(value, name)
    return outputs


def as_array(value: Any, name: str = "value") -> Any:
    """``value`` as numpy or CuPy over the same memory; ``Refused`` says why it cannot be read."""
    if isinstance(value, np.ndarray) or _is_cupy(value):
        return value
    if not hasattr(value, "__dlpack__"):
        return np.asarray(value)
    try:
        if _dlpack_on_host(value):
            return _host_from_dlpack(value)
        import cupy

        return cupy.from_dlpack(value)
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - every producer fails in its own words (a torch tensor that needs grad...)
        raise Refused(
            f"{name!r} is a {type(value).__module__}.{type(value).__name__} whose DLPack export failed "
            f"({type(exc).__name__}: {exc}); return a DLPack-capable array on the host or on a CUDA device "
            "(a PyTorch tensor may need .detach())",
            name,
        ) from None


def _is_cupy(value: Any) -> bool:
    return type(value).__module__.partition(".")[0] == "cupy" and hasattr(value, "__cuda_array_interface__")


# DLPack device types (dlpack.h) that numpy can read: kDLCPU, kDLCUDAHost (pinned host memory).
DL_HOST = frozenset({1, 3})


def _dlpack_on_host(value: Any) -> bool:
    probe = getattr(value, "__dlpack_device__", None)
    return probe is None or int(probe()[0]) in DL_HOST


def _host_from_dlpack(value: Any) -> np.ndarray:
    try:
        return np.from_dlpack(value)
    except (BufferError, TypeError, RuntimeError) as exc:
        # numpy has no BF16 and refuses it: a BF16 producer is read from its capsule instead
        try:
            return bf16_from_dlpack(value.__dlpack__())
        except Exception:  # noqa: BLE001 - not BF16 either: numpy's own reason is the one to tell
            raise exc from None


#: What ``@step(array=...)`` may ask for; ``None`` is numpy on the CPU and CuPy on a GPU.
ARRAY_KINDS = ("numpy", "cupy", "torch", "dlpack")


def handing(kind: str | None) -> Callable[[Any], Any] | None:
    """The function that turns an input array into what a step of ``array=kind`` takes, or ``None`` for as-is.

    ``"dlpack"`` hands host memory as a :class:`HostView`, which exports even a read-only input.

    Every hand-over is DLPack on the same device, with no copy, except ``"numpy"`` given a GPU
    array (or ``"cupy"`` a host one), which copies, as asked.
    """
    if kind is None:
        return None
    if kind == "dlpack":
        return _to_dlpack
    if kind == "numpy":
        return _to_numpy
    if kind == "cupy":
        return _to_cupy
    if kind == "torch":
        return _to_torch
    raise Refused(f"array={kind!r} is not a kind of array; expected one of {', '.join(ARRAY_KINDS)} or None", None)


def _to_dlpack(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU":
        return HostView(value)
    return value


def _to_numpy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value
    if _dlpack_on_host(value):
        return read_only(_host_from_dlpack(value))
    import cupy

    return cupy.asnumpy(cupy.from_dlpack(value))


def _to_cupy(value: Any) -> Any:
    import cupy

    if _is_cupy(value) or (isinstance(value, np.ndarray) and value.dtype.kind in "OSU"):
        return value
    if isinstance(value, np.ndarray) or _dlpack_on_host(value):
        return cupy.asarray(np.asarray(value) if isinstance(value, np.ndarray) else _host_from_dlpack(value))
    return cupy.from_dlpack(value)


def _to_torch(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype.kind in "OSU"):
        return value  # BYTES stay numpy: no other array library holds strings
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU":
        # numpy refuses to export a read-only array (every input is one); our own capsule shares it anyway
        return torch.utils.dlpack.from_dlpack(host_capsule(value))
    return torch.from_dlpack(value)
