"""LoRA adapters over one base model: requests name them, steps mix them."""
