"""llama's q and k rows in rotary order: written once to a file of their own under the
cache directory, and mapped at every load after.

llama.cpp's converter interleaves each head's q and k rows for its own rotary embedding
(:func:`~quire.models.gguf_file.unpermute_rows` undoes it). Reordering them inside the
GGUF file's copy-on-write map copies those pages into the process at every load, one
copy per process. From the rows file they come in from the page cache as every other
weight does: loading copies nothing, and processes on one host share the pages.

The file holds the tensors' blocks one after another, in the order given, keyed by the
GGUF file's path, size and modification time. It is written under a temporary name and
renamed into place, so a load never maps half of one; a file of another size is written
again. Where the cache cannot be written, :func:`rotary_rows` says so and the caller
reorders in the map.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from quire.model_store import cache_dir
from quire.quantization.tensor import QuantizedTensor

logger = logging.getLogger(__name__)

#: Bumped whenever the file's layout changes, so an old file is never read as this one.
_LAYOUT = "1"


class RowsSource(NamedTuple):
    """One tensor whose rows the file holds reordered."""

    #: its GGUF name
    name: str
    #: its blocks as they lie in the GGUF file (``[rows, row bytes]``, contiguous)
    blocks: QuantizedTensor
    #: where they start in the file
    offset: int
    #: int64 ``[rows]``: the file's row for each row of the rotary order
    order: torch.Tensor


def rotary_rows(path: str, tensors: list[RowsSource],
                root: Path | None = None) -> dict[str, QuantizedTensor] | None:
    """Each tensor with its rows in its ``order``, as views of a map of the rows file
    (written first where it is missing), by GGUF name; None where the file cannot be
    written."""
    if not tensors:
        return {}
    target = rows_file(path, root)
    sizes = [t.blocks.data.numel() for t in tensors]
    written = target.is_file() and target.stat().st_size == sum(sizes)
    if not (written or _write(path, target, tensors)):
        return None
    data = np.memmap(target, mode="c")  # copy-on-write, as the GGUF file's own map
    if data.size != sum(sizes):  # replaced by another layout under us
        return None
    views, offset = {}, 0
    for t, size in zip(tensors, sizes):
        rows = torch.from_numpy(data[offset:offset + size]).view(t.blocks.data.shape)
        views[t.name] = QuantizedTensor(t.blocks.format, rows, t.blocks.cols, t.blocks.scale)
        offset += size
    return views


def rows_file(path: str, root: Path | None = None) -> Path:
    """Where the rows of the GGUF file at ``path`` are kept (under the cache directory,
    or ``root``)."""
    source = Path(path).resolve()
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_LAYOUT}".encode()).hexdigest()[:16]
    return (root or cache_dir() / "gguf-rows") / f"{source.stem}-{key}.bin"


def _write(path: str, target: Path, tensors: list[RowsSource]) -> bool:
    """Write the rows file. It reads the GGUF file's bytes with ``pread``, not through
    its map, so the process does not keep the interleaved rows' pages too."""
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=target.parent, prefix=".rows-")
        with os.fdopen(fd, "wb") as out, open(path, "rb") as source:
            for t in tensors:
                size = t.blocks.data.numel()
                raw = os.pread(source.fileno(), size, t.offset)
                if len(raw) != size:
                    raise OSError(f"{path}: tensor {t.name!r} runs past the end")
                rows = np.frombuffer(raw, dtype=np.uint8).reshape(t.blocks.data.shape)
                rows[t.order.numpy()].tofile(out)
        os.replace(staging, target)
        return True
    except OSError as exc:
        logger.warning("cannot write llama's q/k rows in rotary order to %s (%s); "
                       "reordering them in the GGUF file's map", target, exc)
        if staging is not None:
            Path(staging).unlink(missing_ok=True)
        return False
