"""``python conversion_time.py NAME``: a GGUF file's first-load conversion (its config and
tokenizer into a Hugging Face directory) timed into a fresh cache root. NAME is a file
in ~/.cache/quire/models; the line names the checkout it ran (for runs alternated with a
worktree of another commit on PYTHONPATH)."""
import os
import sys
import tempfile
import time
from pathlib import Path

import quire
from quire.models.gguf_hf_cache import hf_dir_for_gguf

path = os.path.expanduser(f"~/.cache/quire/models/{sys.argv[1]}")
started = time.perf_counter()
hf_dir_for_gguf(path, root=Path(tempfile.mkdtemp()))
print(sys.argv[1], Path(quire.__file__).parents[2], f"{time.perf_counter() - started:.1f} s")
