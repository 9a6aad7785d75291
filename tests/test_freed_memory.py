"""This process keeps the memory its arrays free, as the bundled server's stubs do."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)

# A fresh interpreter allocates an 8 MiB array and says how many more bytes malloc serves
# from mmap for it (glibc's mallinfo2: hblkhd).
_PROBE = """
import ctypes, sys
import numpy as np
{before}
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
a = np.ones(8 << 20, np.uint8)
print(libc.mallinfo2().hblkhd - before, kept)
"""


def _mmapped_bytes(before: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    code = _PROBE.format(before=before)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | (env or {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True)
    mmapped, kept = out.stdout.split()
    return int(mmapped), kept


def test_an_8_mib_array_comes_from_the_heap_once_this_process_keeps_freed_memory():
    plain, _ = _mmapped_bytes("kept = None")
    assert plain >= 8 << 20  # glibc's default: a fresh mmap, handed back (and faulted in again) each time
    kept, said = _mmapped_bytes("from pipelines.freed_memory import keep_freed_memory_here\nkept = keep_freed_memory_here()")
    assert said == "True" and kept == 0


def test_a_threshold_the_user_set_wins():
    mmapped, said = _mmapped_bytes(
        "from pipelines.freed_memory import keep_freed_memory_here\nkept = keep_freed_memory_here()",
        env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    assert said == "False" and mmapped >= 8 << 20  # their 1 MiB threshold, not ours


def test_a_local_runtime_opening_keeps_freed_memory_unless_told_not_to():
    run = """
from pipelines.examples.basic import chain
from pipelines.runtime.local import LocalRuntime
import anyio, pipelines.freed_memory as fm
async def main():
    async with LocalRuntime(chain, keep_freed_memory={flag}):
        pass
anyio.run(main)
kept = fm._done
"""
    for flag, expected in ((True, "True"), (False, "None")):
        mmapped, said = _mmapped_bytes(run.format(flag=flag))
        assert said == expected, flag
        assert (mmapped == 0) if flag else (mmapped >= 8 << 20), flag
