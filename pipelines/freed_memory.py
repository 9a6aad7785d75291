"""Keeping the memory that freed arrays give back, in the server's stubs and in this process.

glibc's ``malloc`` serves a large block (128 KiB and up, at first) with a fresh
``mmap`` and hands it back to the kernel when it is freed, and it gives the top
of its heap back once more than 128 KiB of it is free. A step that makes a fresh
4 MiB array per call then page-faults all of it in again on every call: 3.7 ms
in a stub instead of 1.2 ms, measured on the bundled server
(docs/calibration_internals.md, "The memory a stub frees"). glibc raises its threshold by itself after the
first such block is freed, so whether a process pays depends on what it
allocated before: the same local run takes 10 ms in one process and 13 to
18 ms in others unless this process keeps its freed memory too.

Two thresholds fix it, and the same two serve the server and this process:

- ``M_MMAP_THRESHOLD`` 32 MiB: arrays under it come from the heap;
- ``M_TRIM_THRESHOLD`` 64 MiB: each process keeps up to that much freed heap.

The server's stubs inherit them as the environment variables
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
(:class:`pipelines.triton.PythonBackendSettings`); this process sets them with
``mallopt``, which is what those variables set at start. Either way, a
variable the user set wins, and a C library other than glibc is left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "VARIABLES", "glibc_function", "keep_freed_memory_here", "one_heap_here"]

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
#: The environment variables glibc reads at start, and their values.
VARIABLES = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

# mallopt's parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_lock = threading.Lock()
_done: bool | None = None


def keep_freed_memory_here() -> bool:
    """Give this process the thresholds the bundled server gives its stubs; returns whether
    they are in force (set now or before).

    Done once per process. Nothing is set where the user set either variable, or where the
    C library is not glibc (``mallopt`` exists only there with these meanings).
    """
    global _done
    with _lock:
        if _done is None:
            _done = _set_thresholds()
        return _done


def one_heap_here() -> bool:
    """Have every thread of this process allocate from glibc's one main heap; returns whether
    it is in force. Call it before the threads start: arenas made before stay.

    A process that reads large messages on many threads (grpcio's) otherwise gets a heap
    per thread, up to 8 per core; what a 100 MiB message leaves scattered over them stays
    with the process, ``malloc_trim`` or not. Measured on ``pipelines serve --local``, three
    100 MiB gRPC requests: RSS settled 91 to 164 MB over its baseline with the default
    arenas, 0 MB over it with one, and the peak fell from 6.8x to 5.0x the request
    (``benchmarks/endpoint_memory.py``, docs/endpoint.md). Left alone where the user set
    ``MALLOC_ARENA_MAX``.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, 1))


def glibc_function(name: str, argtypes: tuple, restype: type) -> Any:
    """glibc's function ``name`` through ctypes, or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


def _mallopt():
    return glibc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)


def _set_thresholds() -> bool:
    if any(name in os.environ for name in VARIABLES):
        return False  # the user chose; glibc already read their values at start
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success; the trim threshold first, so that the heap is not
    # trimmed under the new mmap threshold in between
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
