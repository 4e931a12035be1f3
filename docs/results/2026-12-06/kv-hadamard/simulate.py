"""Fake-quantised KV in transformers' float32 models: int8 / fp8 groups of 16 (a float16
scale each), in the plain basis or rotated by a Hadamard matrix, against the same model
unquantised, on the accuracy tool's text (its first TOKENS, one forward: every query reads
quantised keys and values, where the engine's first chunk reads its own unquantised).

    python simulate.py smollm2 DIR     # DIR: SmolLM2's float32 checkpoint
    python simulate.py gemma3 DIR      # DIR: holding gemma-3-270m-q4_k_m.gguf

The figures are in README.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXT = Path(__file__).parents[4] / "core/quire/bench/data/accuracy_text.txt"
#: Tokens of the text each forward reads.
TOKENS = 2000


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def fake_quant(x: torch.Tensor, fmt: str, group: int = 16) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(*shape[:-1], shape[-1] // group, group)
    qmax = 127.0 if fmt == "int8" else 448.0
    scale = (x.abs().amax(-1, keepdim=True) / qmax).half().float().clamp_min(1e-12)
    if fmt == "int8":
        y = (x / scale).round().clamp(-qmax, qmax) * scale
    else:
        y = (x / scale).to(torch.float8_e4m3fn).float() * scale
    return y.reshape(shape)


def main() -> None:
    family, directory = sys.argv[1], sys.argv[2]
    if family == "smollm2":
        import transformers.models.llama.modeling_llama as modeling
        kw = {}
    else:
        import transformers.models.gemma3.modeling_gemma3 as modeling
        kw = {"gguf_file": "gemma-3-270m-q4_k_m.gguf"}
    tok = AutoTokenizer.from_pretrained(directory, **kw)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kw).eval()
    model.config._attn_implementation = "eager"
    ids = torch.tensor([tok.encode(TEXT.read_text())[:TOKENS]])
    d = model.config.head_dim
    bases = {"plain": None, "groups of 16": torch.block_diag(*[hadamard(16)] * (d // 16)),
             f"whole head ({d})": hadamard(d)}
    mode: dict = {"on": False}
    original = modeling.eager_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        if mode["on"]:
            h, fmt = mode["basis"], mode["fmt"]
            if h is None:
                key, value = fake_quant(key, fmt), fake_quant(value, fmt)
            else:  # h is orthonormal and symmetric
                key = fake_quant(key @ h, fmt) @ h
                value = fake_quant(value @ h, fmt) @ h
        return original(module, query, key, value, *args, **kwargs)

    modeling.eager_attention_forward = attention

    def log_probs() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0].float(), -1)

    ref = log_probs()
    mode["on"] = True
    for fmt in ("int8", "fp8"):
        for name, h in bases.items():
            mode.update(basis=h, fmt=fmt)
            lp = log_probs()
            kl = (ref.exp() * (ref - lp)).sum(-1).mean()
            top1 = (ref.argmax(-1) == lp.argmax(-1)).float().mean()
            print(f"{family} {fmt} {name}: mean KL {kl:.3e}, top-1 {top1:.2%}", flush=True)


if __name__ == "__main__":
    main()
