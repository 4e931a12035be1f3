"""Random PEFT LoRA adapters for tests, and PEFT's own greedy output as the oracle."""

from __future__ import annotations

from pathlib import Path

from quire.lora.random import save_random_adapter
from tiny_models import hf_greedy, hf_model


def make_adapter(base: Path, directory: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    """A PEFT adapter of ``base`` with random, non-zero A and B."""
    return save_random_adapter(hf_model(base), directory, rank=rank, alpha=alpha,
                               targets=targets, scale=0.3, seed=seed, rslora=rslora)


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int],
                max_tokens: int) -> list[int]:
    """Greedy tokens of ``base`` with ``adapter`` applied by PEFT (None: the base)."""
    import peft

    model = hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return hf_greedy(model, prompt, max_tokens)
