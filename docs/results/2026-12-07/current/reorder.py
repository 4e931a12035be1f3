"""The q/k rows of a GGUF file reordered in its copy-on-write map, timed: python reorder.py FILE plain|populate."""
import sys, time, ctypes, torch
from quire.models.gguf_reader import read_gguf_index, quantized
from quire.models.gguf_file import unpermute_rows
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
mode = sys.argv[2]
index = read_gguf_index(sys.argv[1])
t0 = time.perf_counter(); n = 0; tpop = 0
for t in index.tensors:
    if ".attn_q." in t.name or ".attn_k." in t.name:
        q = quantized(t)
        heads = int(index.metadata["llama.attention.head_count"] if ".attn_q." in t.name else index.metadata["llama.attention.head_count_kv"])
        d = q.data
        if mode == "populate":
            a = d.data_ptr(); nbytes = d.numel() * d.element_size()
            lo = a & ~4095; hi = (a + nbytes + 4095) & ~4095
            t1 = time.perf_counter()
            r = libc.madvise(lo, hi - lo, 23)  # MADV_POPULATE_WRITE
            tpop += time.perf_counter() - t1
            if r: print("madvise", ctypes.get_errno())
        q.reorder_rows_(unpermute_rows(torch.arange(q.rows), heads))
        n += d.numel()
print(mode, f"{n/2**20:.0f} MiB in {time.perf_counter()-t0:.2f} s (populate {tpop:.2f} s)")
