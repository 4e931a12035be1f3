"""A GGUF file's Hugging Face config and tokenizer, converted once and cached.

transformers builds both by parsing the whole metadata block of the file (a 49k-entry
vocabulary takes seconds, and config and tokenizer each parse it again). The converted
files are saved once as an ordinary Hugging Face directory under the cache directory,
keyed by the GGUF file's path, size and modification time, so a later start reads two
small JSON files instead. Weights are never cached: they stay in the GGUF file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from quire.model_store import cache_dir
from quire.models.gguf_file import load_gguf_config

logger = logging.getLogger(__name__)

#: Bumped whenever what is saved changes, so old entries are not reused.
_FORMAT = "1"


def hf_dir_for_gguf(path: str, root: Path | None = None) -> Path:
    """A directory holding ``config.json`` and the tokenizer files of GGUF ``path``.

    Converts and saves them on first use; writes are atomic (a temporary directory is
    renamed into place), so concurrent starts never see half an entry. When the cache
    cannot be written, the files go to a temporary directory instead.
    """
    source = Path(path).resolve()
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_FORMAT}".encode()
    ).hexdigest()[:16]
    root = root or cache_dir() / "gguf-hf"
    target = root / f"{source.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    except OSError as exc:
        logger.warning("cannot write the GGUF cache under %s (%s); converting in a "
                       "temporary directory", root, exc)
        staging = Path(tempfile.mkdtemp(prefix="quire-gguf-"))
        _convert(source, staging)
        return staging
    _convert(source, staging)
    try:
        os.replace(staging, target)
    except OSError:  # another process got there first: use its entry
        shutil.rmtree(staging, ignore_errors=True)
    return target


#: Written instead of tokenizer files when the GGUF file's vocabulary cannot be converted.
NO_TOKENIZER = "no_tokenizer.txt"


def _convert(source: Path, out: Path) -> None:
    load_gguf_config(str(source)).save_pretrained(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except (ValueError, OSError, KeyError) as exc:
        # The weights are still usable with a tokenizer from elsewhere (tokenizer=...).
        (out / NO_TOKENIZER).write_text(f"{type(exc).__name__}: {exc}\n")
        return
    tokenizer.save_pretrained(out)
