"""A model's pb tensors in and out (``pb`` is the stub's ``triton_python_backend_utils``, passed
in by the model that imports it), the host-GPU copies they cost, and failures carried as data.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import Refused
from .datatypes import NUMPY_2, Spec
from .dlpack import bf16_from_dlpack, bf16_to_dlpack, host_capsule


def tensor_reader(spec: Spec, *, gpu: bool) -> Callable[[Any], Any]:
    """How a pb tensor becomes an array: numpy (CPU), CuPy (``gpu``), or BF16 by DLPack."""
    if spec.dtype == "BF16":  # as_numpy() refuses BF16; its DLPack capsule carries it (docs/triton.md)
        return lambda tensor: bf16_from_dlpack(tensor.to_dlpack())
    if spec.dtype == "BYTES":  # DLPack has no strings; the stub's as_numpy() reads them
        return _bytes_array
    return _device_array if gpu else host_array


def host_array(tensor: Any) -> np.ndarray:
    """A host pb tensor (numbers) as numpy: ``as_numpy()`` under numpy 1, DLPack under numpy 2.

    Under numpy 2 the 2.51 stub's ``as_numpy()`` returns wrong data without an error
    (docs/gpu.md); ``np.from_dlpack`` reads the same memory right, under either.
    """
    return np.from_dlpack(tensor) if NUMPY_2 else tensor.as_numpy()


def _bytes_array(tensor: Any) -> np.ndarray:
    return tensor.as_numpy()


def _device_array(tensor: Any) -> Any:
    import cupy  # only GPU steps are handed GPU tensors (FORCE_CPU_ONLY_INPUT_TENSORS "no")

    if tensor.is_cpu():
        array = host_array(tensor)
        HOPS.host_to_device(array.nbytes)
        return cupy.asarray(array)
    return cupy.from_dlpack(tensor.to_dlpack())


class HostHops:
    """The copies this process made between host and GPU for a GPU step: how many, how many bytes.

    A GPU step handed a tensor that Triton put in host memory pays one here; none between GPU
    steps is the goal. With ``PIPELINES_HOPS_DIR`` set when the server starts, each model keeps
    its tally there, rewritten in place at every copy (``<model>-<pid>.json``), so a benchmark
    reads it between requests (benchmarks/gpu_server.py); without it, counting costs nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.model = ""
        self.to_device = self.to_host = self.bytes = 0

    def attach(self, model: str) -> None:
        """Name the model this process serves, and open its tally file if one is asked for."""
        import os

        folder = os.environ.get("PIPELINES_HOPS_DIR")
        self.model = model
        if folder and self._fd is None:
            self._fd = os.open(os.path.join(folder, f"{model}-{os.getpid()}.json"), os.O_WRONLY | os.O_CREAT, 0o644)
            self._write()

    def host_to_device(self, nbytes: int) -> None:
        with self._lock:
            self.to_device += 1
            self.bytes += int(nbytes)
            self._write()

    def device_to_host(self, nbytes: int) -> None:
        with self._lock:
            self.to_host += 1
            self.bytes += int(nbytes)
            self._write()

    def _write(self) -> None:
        if self._fd is not None:
            import os

            text = json.dumps({"model": self.model, "to_device": self.to_device, "to_host": self.to_host,
                               "bytes": self.bytes})
            os.pwrite(self._fd, text.ljust(256).encode(), 0)  # one fixed-size write: a reader never sees half


HOPS = HostHops()


def failure_tensor(text: str, rows: int | None) -> np.ndarray:
    """How an ensemble's step carries a failure as data: UINT8, a flag byte (1 failed, 0 not), then the text.

    One row per request row (``rows``), or one flat row when the model does not batch. Numbers,
    not BYTES, so that a stub under numpy 2 can carry it through DLPack (docs/gpu.md).
    """
    row = np.frombuffer(b"\x01" + text.encode("utf-8") if text else b"\x00", dtype=np.uint8)
    return row.copy() if rows is None else np.tile(row, (rows, 1))


def failure_text(tensor: Any) -> str | None:
    """The failure a :func:`failure_tensor` carries (read from a pb tensor), or ``None`` when it carries none."""
    array = pb_array(tensor)
    if not isinstance(array, np.ndarray):
        array = array.get()  # a GPU step's model wrote it from the host; Triton may have moved it
    row = array.reshape(-1) if array.ndim < 2 else (array[0] if len(array) else array.reshape(-1))
    if row.size == 0 or row[0] == 0:
        return None
    return row[1:].tobytes().decode("utf-8", errors="replace")


def refuse_strings_under_numpy_2(model: str, strings: list[str]) -> None:
    """At load, refuse the BYTES tensors that Triton 2.51's stub cannot carry under numpy 2.

    DLPack has no strings, and under numpy 2 the stub's ``as_numpy()`` and ``Tensor(name,
    ndarray)`` misread a BYTES buffer's lengths and abort the stub (docs/gpu.md): a clear
    refusal when the model loads is better than a stub that dies on the first request.
    """
    if NUMPY_2 and strings:
        raise Refused(
            f"model {model!r} carries BYTES tensors {sorted(set(strings))}, which Triton 2.51's Python backend "
            f"cannot read or write under numpy {np.__version__} (its stub misreads them and aborts); serve it from "
            "a Python environment with numpy<2, or carry the strings as UINT8 codes",
            sorted(set(strings))[0],
        )


def pb_array(tensor: Any) -> Any:
    """A pb tensor of any dtype as an array where it lies: numpy on the host, CuPy on a GPU."""
    if not tensor.is_cpu():
        import cupy

        return cupy.from_dlpack(tensor.to_dlpack())
    if NUMPY_2:
        try:
            return np.from_dlpack(tensor)
        except Exception:  # noqa: BLE001 - the stub's own exception type: a BYTES tensor, which DLPack cannot carry
            pass
    return tensor.as_numpy()


def tensor_writer(spec: Spec, pb: Any) -> Callable[[str, Any], Any]:
    """How an array becomes a pb tensor named ``name``: ``writer(name, array)``."""
    if spec.dtype == "BYTES":
        return lambda name, value: pb.Tensor(name, bytes_tensor(value))
    if spec.dtype == "BF16":
        return lambda name, value: pb.Tensor.from_dlpack(name, bf16_to_dlpack(np.asarray(value)))

    def tensor(name: str, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            if NUMPY_2:  # Tensor(name, ndarray) writes wrong sizes under numpy 2 (docs/gpu.md)
                return pb.Tensor.from_dlpack(name, host_capsule(value))
            return pb.Tensor(name, value if value.flags.c_contiguous else np.ascontiguousarray(value))
        # A GPU array stays on the GPU, passed as the array object (docs/gpu.md).
        return pb.Tensor.from_dlpack(name, value)

    return tensor


def bytes_tensor(value: Any) -> np.ndarray:
    """A BYTES tensor as a model on the server receives it: an object array of ``bytes``.

    What Triton's serialisation does to it on the way (the Python backend's, and
    tritonclient's, alike): ``str`` items and ``U`` arrays are encoded as UTF-8,
    ``S`` items kept, anything else written as ``str(item)``. An array that is
    already all ``bytes`` comes back as it is, without a copy.
    """
    value = np.asarray(value)
    if value.dtype.kind == "U":
        value = np.char.encode(value, "utf-8")
    if value.dtype.kind == "O" and not all(type(item) is bytes for item in value.flat):
        encoded = np.empty(value.shape, dtype=np.object_)
        encoded.flat = [
            bytes(item) if isinstance(item, bytes) else str(item).encode("utf-8") for item in value.flat
        ]
        value = encoded
    return np.ascontiguousarray(value.astype(np.object_, copy=False))
