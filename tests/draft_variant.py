"""A draft for speculative-decoding tests: a copy of a checkpoint with noise added to
its weights, so that its greedy proposals agree with the original's often but not
always (drafts are both accepted and rejected)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def perturbed_copy(path: str | Path, directory: Path, scale: float, seed: int = 0) -> str:
    """``path``'s checkpoint (config, tokenizer) with ``scale`` x a standard normal added
    to every weight, saved under ``directory``; returns its path."""
    target = directory / f"perturbed-{scale}-{seed}"
    shutil.copytree(path, target)
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(target.glob("*.safetensors")):
        tensors = load_file(file)
        noisy = {name: t + scale * torch.randn(t.shape, generator=generator, dtype=t.dtype)
                 for name, t in tensors.items()}
        save_file(noisy, file, metadata={"format": "pt"})
    return str(target)
