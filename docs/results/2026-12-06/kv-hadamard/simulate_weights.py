"""The same rotation on weights, simulated: SmolLM2's float32 checkpoint with every
decoder linear fake-quantised per 32 input values (Q8_0's grid: a float16 scale each,
absmax / 127), in the plain basis or with each group of 32 times the orthonormal 32 x 32
Hadamard matrix H (weights W H, activations H x: W x unchanged in exact arithmetic);
``w8a8`` also fake-quantises the activations per 32 values. Against the unquantised
model on the accuracy tool's text (``simulate.TOKENS`` of it).

    python simulate_weights.py DIR    # DIR: SmolLM2's float32 checkpoint

The figures are in README.md.
"""

from __future__ import annotations

import sys

import torch
from simulate import TEXT, TOKENS, hadamard  # this folder's KV simulation
from transformers import AutoModelForCausalLM, AutoTokenizer

H = hadamard(32)


def q8(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // 32, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(1e-12)
    return ((g / scale).round().clamp(-127, 127) * scale).reshape(shape)


def rotate(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // 32, 32) @ H).reshape(shape)


def main() -> None:
    directory = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(TEXT.read_text())[:TOKENS]])
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    weights = {n: m.weight.data.clone() for n, m in linears}

    def log_probs() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0].float(), -1)

    ref = log_probs()
    hooks: list = []
    for method in ("int8", "int8, rotated", "w8a8", "w8a8, rotated"):
        for hook in hooks:
            hook.remove()
        hooks = []
        rotated, w8a8 = method.endswith("rotated"), method.startswith("w8a8")
        for name, module in linears:
            w = weights[name]
            module.weight.data = q8(rotate(w)) if rotated else q8(w)

            def pre(_module, args, rotated=rotated, w8a8=w8a8):
                x = rotate(args[0]) if rotated else args[0]
                return (q8(x) if w8a8 else x,)

            hooks.append(module.register_forward_pre_hook(pre))
        lp = log_probs()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean()
        top1 = (ref.argmax(-1) == lp.argmax(-1)).float().mean()
        print(f"{method}: mean KL {kl:.3e}, top-1 {top1:.2%}", flush=True)


if __name__ == "__main__":
    main()
