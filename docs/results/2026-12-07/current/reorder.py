"""The q/k rows of a GGUF file reordered in its copy-on-write map, timed.

``python reorder.py FILE plain``: each tensor's rows copied into place, every page
faulting on its first write (the load before quire.heap.populate_write was called);
``populate``: the pages made the process's own in one madvise call first
(QuantizedTensor.reorder_rows_; since the tokenizer-tables stop, the load's fallback
where the q/k rows file cannot be written).
"""
import sys
import time

import torch

from quire.heap import populate_write
from quire.models.gguf_file import unpermute_rows
from quire.models.gguf_reader import quantized, read_gguf_index

path, mode = sys.argv[1], sys.argv[2]
index = read_gguf_index(path)
arch = index.metadata["general.architecture"]
start, moved, populating = time.perf_counter(), 0, 0.0
for tensor in index.tensors:
    if ".attn_q." not in tensor.name and ".attn_k." not in tensor.name:
        continue
    key = "head_count" if ".attn_q." in tensor.name else "head_count_kv"
    weight = quantized(tensor)
    data, order = weight.data, unpermute_rows(torch.arange(weight.rows),
                                              int(index.metadata[f"{arch}.attention.{key}"]))
    if mode == "populate":
        begin = time.perf_counter()
        populate_write(data.data_ptr(), data.numel())
        populating += time.perf_counter() - begin
    data.copy_(data.index_select(0, order))
    moved += data.numel()
print(f"{mode}: {moved / 2**20:.0f} MiB in {time.perf_counter() - start:.2f} s "
      f"(populating {populating:.2f} s)")
