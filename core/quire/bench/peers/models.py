"""The files each peer loads, made once from the model Quire runs and cached.

Everyone runs the same weights. Quire loads a GGUF file dequantized to float32. For the
hf and vllm peers, the same GGUF is converted once into a float32 safetensors checkpoint
(transformers ``from_pretrained(dir, gguf_file=...)`` + ``save_pretrained``, in the hf
venv). llama.cpp runs an F32 copy of the GGUF (``llama_model_quantize``, in the llamacpp
venv) and, separately, the original file in its native quantized format, reported as
such. A checkpoint directory given as the model is used by hf and vllm as it is.

Files live under ``<cache>/peers/models/``, named after the source file and its size.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from quire.bench.peers.runner import PeerError, run_worker
from quire.bench.peers.spec import PEERS, PeerSpec
from quire.model_store import cache_dir

# Converting a 135M-parameter GGUF takes well under a minute; allow slow disks.
_CONVERT_TIMEOUT_S = 1800.0


def models_dir() -> Path:
    return cache_dir() / "peers" / "models"


def _cached_name(source: Path, suffix: str) -> Path:
    stem = source.name.removesuffix(".gguf")
    return models_dir() / f"{stem}-{source.stat().st_size}{suffix}"


def model_variants(spec: PeerSpec, model_path: str,
                   variant: str = "both") -> list[tuple[str, str]]:
    """(column name, file) for each way ``spec`` runs ``model_path``, making files as needed.

    :param variant: for a GGUF peer: ``native`` (the file), ``f32`` (an F32 copy of it)
        or ``both``.

    :raises PeerError: when the peer cannot load this kind of model, or a conversion fails.
    """
    if spec.model_format == "hf":
        return [(spec.name, str(hf_checkpoint(model_path)))]
    if not model_path.endswith(".gguf"):
        raise PeerError(f"peer {spec.name!r} needs a .gguf model, got {model_path!r}")
    columns = []
    if variant in ("both", "f32"):
        columns.append((f"{spec.name}-f32", str(f32_gguf(spec, Path(model_path)))))
    if variant in ("both", "native"):
        columns.append((f"{spec.name}-native", model_path))
    return columns


def hf_checkpoint(model_path: str) -> Path:
    """A safetensors checkpoint of ``model_path`` (itself when it is a directory)."""
    source = Path(model_path)
    if source.is_dir():
        return source
    target = _cached_name(source, "-hf")
    if not (target / "config.json").exists():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        models_dir().mkdir(parents=True, exist_ok=True)
        run_worker(PEERS["hf"], {"action": "convert_gguf", "model": str(source),
                                 "output_dir": str(partial)}, _CONVERT_TIMEOUT_S)
        os.replace(partial, target)
    return target


def f32_gguf(spec: PeerSpec, source: Path) -> Path:
    """An F32 copy of the GGUF file ``source``, written by the llama.cpp worker."""
    target = _cached_name(source, ".F32.gguf")
    if not target.exists():
        models_dir().mkdir(parents=True, exist_ok=True)
        run_worker(spec, {"action": "quantize_f32", "model": str(source),
                          "output": str(target)}, _CONVERT_TIMEOUT_S)
    return target
