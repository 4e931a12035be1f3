"""A GGUF file's first-load conversion (config and tokenizer into a Hugging Face directory), timed into a fresh cache root: python conversion_time.py NAME (a file in ~/.cache/quire/models)."""
import os, sys, time, tempfile
from pathlib import Path
from quire.models.gguf_hf_cache import hf_dir_for_gguf
import quire
path = os.path.expanduser(f"~/.cache/quire/models/{sys.argv[1]}")
t = time.perf_counter()
hf_dir_for_gguf(path, root=Path(tempfile.mkdtemp()))
print(sys.argv[1], quire.__file__.split("/core/")[0], f"{time.perf_counter() - t:.1f} s")
