"""Keeping the memory that freed arrays give back, in the server's stubs and in this process.

glibc's ``malloc`` serves a large block (128 KiB and up, at first) with a fresh
``mmap`` and hands it back to the kernel when it is freed, and it gives the top
of its heap back once more than 128 KiB of it is free. A step that makes a fresh
4 MiB array per call then page-faults all of it in again on every call: 3.7 ms
in a stub instead of 1.2 ms, measured on the bundled server
(``docs/server_profiles.md``). glibc raises its threshold by itself after the
first such block is freed, so whether a process pays depends on what it
allocated before: the same local run measured 10 ms in one process and 13 to
18 ms in others, until this process kept its freed memory too.

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

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "VARIABLES", "keep_freed_memory_here"]

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
#: The environment variables glibc reads at start, and their values.
VARIABLES = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

# mallopt's parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

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


def _set_thresholds() -> bool:
    if any(name in os.environ for name in VARIABLES):
        return False  # the user chose; glibc already read their values at start
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the trim threshold first, so that the heap is not
    # trimmed under the new mmap threshold in between
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
