"""Random LoRA adapters in PEFT's format, for tests and benchmarks: every A and B drawn
non-zero (PEFT's own initialisation leaves B zero, an update that changes nothing).
Needs ``peft`` (a test extra), imported on call."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save_random_adapter(model: nn.Module, directory: str | Path, *, rank: int, alpha: int,
                        targets: list[str], scale: float, seed: int,
                        rslora: bool = False) -> Path:
    """Wrap ``model`` (a transformers model, changed in place) in a LoRA adapter of
    ``rank`` and ``alpha`` on ``targets``, fill every A and B with ``scale`` times
    standard normal draws from ``seed``, and save it to ``directory``."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=g))
    wrapped.save_pretrained(str(directory))
    return Path(directory)
