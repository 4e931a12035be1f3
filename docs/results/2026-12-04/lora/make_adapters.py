"""Four random rank-16 LoRA adapters (alpha 32, every product, A and B of scale 0.01)
for SmolLM2-135M-Instruct, in PEFT's format, for the LoRA benchmarks.

    python make_adapters.py OUT_DIR
"""

import sys

import peft
import torch
from transformers import AutoModelForCausalLM

from quire.model_store import BUILTIN_MODELS, fetch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

gguf = fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"])
out = sys.argv[1]
for i in range(4):
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                             init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(i)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=g))
    wrapped.save_pretrained(f"{out}/a{i}")
