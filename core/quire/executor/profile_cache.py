"""Activation peaks measured at earlier starts, reused when nothing that sets them changed.

A worker sizes its KV pool after one profiling forward of the largest step
(``Worker.num_kv_blocks``); on a few CPU cores that forward is the longest part of a start,
to learn one figure. The figure depends on the code that runs (quire's and the platform
plugin's files), torch, the host, the model files, the engine options and the rank, so it
is kept under ``<quire cache>/profile/`` keyed by all of them (:func:`profile_key`). A
missing or unreadable entry means measuring again; deleting the folder forces it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from quire.config import ResolvedConfig
from quire.model_store import cache_dir

logger = logging.getLogger(__name__)

#: Engine options that do not shape a forward: left out of the key so that changing them
#: does not measure again.
_UNKEYED = frozenset({"seed", "kv_cache_memory", "gpu_memory_utilization", "max_logprobs",
                      "data_parallel_size", "distributed_executor_backend",
                      "allowed_local_media_path", "allowed_media_domains", "revision"})

#: Bumped when what an entry holds, or what the key covers, changes.
_FORMAT = "1"


@cache
def code_fingerprint(package: str) -> str:
    """The source and library files of importable ``package``: each one's path, size and
    modification time, hashed (a walk of the tree, cheap next to a forward). Empty when
    the package has no files on disk."""
    module = sys.modules.get(package)
    paths = getattr(module, "__path__", None) if module is not None else None
    if not paths:
        return ""
    digest = hashlib.sha256()
    for root_dir in paths:
        for root, dirs, files in os.walk(root_dir):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".c", ".h", ".so")):
                    stat = os.stat(os.path.join(root, name))
                    digest.update(f"{root}/{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n"
                                  .encode())
    return digest.hexdigest()


def _files_fingerprint(path: str) -> str:
    """Size and modification time of a model file, or of a checkpoint directory's files."""
    entries = ([path] if os.path.isfile(path) else
               sorted(os.path.join(path, n) for n in os.listdir(path)) if os.path.isdir(path)
               else [])
    parts = []
    for entry in entries:
        stat = os.stat(entry)
        parts.append(f"{entry}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return "\n".join(parts)


def profile_key(config: ResolvedConfig, *, model_paths: list[str], platform: object,
                rank: int, world_size: int, ranks_on_host: int, tokens: int) -> str:
    """The key of the activation peak a profiling forward of ``tokens`` would measure."""
    engine = {name: value for name, value in dataclasses.asdict(config.engine).items()
              if name not in _UNKEYED}
    platform_package = type(platform).__module__.partition(".")[0]
    facts = {
        "format": _FORMAT,
        "quire": code_fingerprint("quire"),
        "platform": [getattr(platform, "name", ""), type(platform).__module__,
                     type(platform).__qualname__, code_fingerprint(platform_package)],
        "torch": torch.__version__,
        "host": [socket.gethostname(), os.uname().machine],
        "models": [_files_fingerprint(p) for p in model_paths],
        "engine": repr(sorted(engine.items())),
        "resolved": repr((config.dtype, config.block_size, config.max_model_len,
                          config.max_num_batched_tokens, config.task, config.quantization)),
        "rank": [rank, world_size, ranks_on_host],
        "tokens": tokens,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()
                          ).hexdigest()[:24]


class ProfileCache:
    """Activation peaks (bytes) by :func:`profile_key`, one small JSON file each."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_dir() / "profile"

    def get(self, key: str) -> int | None:
        """The peak stored under ``key``, or None."""
        try:
            with open(self.root / f"{key}.json", encoding="utf-8") as f:
                peak = json.load(f)["activation_peak"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return peak if isinstance(peak, int) and peak >= 0 else None

    def put(self, key: str, peak: int) -> None:
        """Store ``peak`` under ``key``, atomically; a cache that cannot be written is
        logged and skipped."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, staging = tempfile.mkstemp(dir=self.root, prefix=".staging-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"activation_peak": int(peak)}, f)
            os.replace(staging, self.root / f"{key}.json")
        except OSError as exc:
            logger.info("activation peak not cached under %s (%s)", self.root, exc)
