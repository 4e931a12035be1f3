"""quire.heap: memory the C heap holds freed goes back to the OS; a private map's pages
become the process's own in one call.

release_freed_heap: in a fresh process, 128 MiB of 64 KiB blocks (below glibc's mmap
threshold, so on the heap) are written and freed but for the last, which keeps the
heap's top in use so that free() itself returns nothing; the call must then drop the
resident set by most of the 128 MiB."""

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


_POPULATE = """
import sys
import numpy as np
from quire.heap import populate_write
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) // 1024
data = np.memmap(sys.argv[1], mode="c")
view = data[4096 + 100:]  # not on a page boundary: the first page is taken whole
before = anon()
done = populate_write(view.ctypes.data, view.size)
after = anon()
same = bool((view[:4096] == 7).all() and (view[-4096:] == 7).all())
view[:] = 9  # writable, and the file stays as it was
print(int(done), after - before, int(same))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on Linux")
def test_a_private_map_s_pages_become_the_process_s_own_in_one_call(tmp_path) -> None:
    """64 MiB of a file mapped copy-on-write: the call makes them anonymous memory (the
    resident set's own pages) with the same bytes, and the file is never written."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x07" * (64 << 20))
    out = subprocess.run([sys.executable, "-c", _POPULATE, str(path)], capture_output=True,
                         text=True, timeout=120, check=True)
    done, grown, same = (int(v) for v in out.stdout.split())
    if not done:
        pytest.skip("madvise(MADV_POPULATE_WRITE) refused: a kernel before 5.14")
    assert grown >= 60, grown  # MiB: the range's pages are the process's copies now
    assert same == 1
    assert path.read_bytes() == b"\x07" * (64 << 20)
