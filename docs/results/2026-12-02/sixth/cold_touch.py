"""Cold first touch on this VM: 1 GiB of fresh anonymous memory (never freed by this
process, so not memory the guest just had) written one byte a page from one thread,
populated with madvise(MADV_POPULATE_WRITE) from one thread, and from two; twice.

Run: ``python docs/results/2026-12-02/sixth/cold_touch.py``
"""
import ctypes
import mmap
import threading
import time

import numpy as np

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes=[ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
n = 1 << 30
def region():
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8); return m, a, a.ctypes.data
def pop(addr, length, chunk=256<<10):
    for o in range(0, length, chunk):
        assert libc.madvise(addr+o, chunk, 23) == 0
keep=[]
for rep in range(2):
    m, a, addr = region(); keep.append((m,a)); t=time.perf_counter(); a[::4096]=1; print("cold touch 1 thread", round(time.perf_counter()-t,2), flush=True)
    m, a, addr = region(); keep.append((m,a)); t=time.perf_counter(); pop(addr, n); print("cold populate 1 thread", round(time.perf_counter()-t,2), flush=True)
    m, a, addr = region(); keep.append((m,a)); t=time.perf_counter()
    th=[threading.Thread(target=pop, args=(addr+i*(n//2), n//2)) for i in range(2)]
    [x.start() for x in th]; [x.join() for x in th]; print("cold populate 2 threads", round(time.perf_counter()-t,2), flush=True)
