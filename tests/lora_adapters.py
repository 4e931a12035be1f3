"""Random PEFT LoRA adapters for tests, and PEFT's own greedy output as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import hf_greedy, hf_model


def make_adapter(base: Path, directory: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    """A PEFT adapter of ``base`` with random, non-zero A and B."""
    import peft

    model = hf_model(base)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=g))
    wrapped.save_pretrained(directory)
    return directory


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int],
                max_tokens: int) -> list[int]:
    """Greedy tokens of ``base`` with ``adapter`` applied by PEFT (None: the base)."""
    import peft

    model = hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return hf_greedy(model, prompt, max_tokens)
