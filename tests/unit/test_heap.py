"""quire.heap.release_freed_heap: memory the C heap holds freed goes back to the OS.

In a fresh process, 128 MiB of 64 KiB blocks (below glibc's mmap threshold, so on the
heap) are written and freed but for the last, which keeps the heap's top in use so
that free() itself returns nothing; the call must then drop the resident set by most of
the 128 MiB."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, ctypes.util
from quire.heap import release_freed_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
blocks = [libc.malloc(64 << 10) for _ in range(2048)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
done = release_freed_heap()
print(int(done), before, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc's malloc_trim")
def test_freed_heap_memory_goes_back() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, check=True)
    done, before, after = (int(v) for v in out.stdout.split())
    assert done == 1
    assert before - after > 100, (before, after)
