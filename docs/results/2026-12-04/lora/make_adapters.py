"""Four random rank-16 LoRA adapters (alpha 32, every product, A and B of scale 0.01)
for SmolLM2-135M-Instruct, in PEFT's format, for the LoRA benchmarks.

    python make_adapters.py OUT_DIR
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from quire.lora.random import save_random_adapter
from quire.model_store import BUILTIN_MODELS, fetch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

gguf = fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"])
out = sys.argv[1]
for i in range(4):
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    save_random_adapter(model, f"{out}/a{i}", rank=16, alpha=32, targets=TARGETS,
                        scale=0.01, seed=i)
