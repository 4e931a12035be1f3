"""``python tokenizer_time.py FILE json|tables``: a GGUF file's converted tokenizer loaded
as a start loads it (``cached_tokenizer``), timed in a process of its own after the
imports; ``json`` ignores the BPE tables (``tokenizers`` parses ``tokenizer.json``)."""
import os
import sys
import time

import transformers  # noqa: F401  (imported before the clock, as at a start)
from quire.models import gguf_hf_cache
from quire.models.gguf_hf_cache import cached_tokenizer, hf_dir_for_gguf

directory = hf_dir_for_gguf(os.path.expanduser(sys.argv[1]))
if sys.argv[2] == "json":
    gguf_hf_cache.load_backend = lambda directory: None
started = time.perf_counter()
cached_tokenizer(directory)
print(f"{sys.argv[2]} {os.path.basename(sys.argv[1])} {time.perf_counter() - started:.3f} s")
