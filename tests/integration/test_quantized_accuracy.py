"""Quantised weights and KV pages against the float32 model, on the accuracy tool's text
(``quire bench accuracy``; per-token KL and top-1 agreement).

The bounds are what these methods measured here (``docs/quantization.md``) with room for
the host: they are not the issue's 99% top-1. bfloat16 weights and activations, vLLM's
default, agree with float32 at only 97.2% of SmolLM2's positions and 95-98% on the tiny
random models, whose next-token distributions are nearly flat; an 8-bit scheme cannot do
better than the precision it has. Top-1 disagreement comes from near-ties: across every
method measured on SmolLM2 it is 0.5-0.7 x sqrt(mean KL), so 99% needs a mean KL near
2-4e-4 (docs/quantization.md, "Accuracy"). What the tests hold is that each method stays as
close as it measured, so a kernel or a scale that drifts fails.

Bounds, (top-1 at least, mean KL at most):

- ``gguf``: the dequantised model exactly: 100%, 1e-6 (float32 products in another order).
- int8 weights in 32-weight groups (Q8_0, the default): SmolLM2 (0.97, 2e-3), tiny models
  (0.90, 4e-3); measured 98.1% / 1.1e-3 and 94.1-98.4% / 2.1e-4 to 2.1e-3.
- int8 with a scale per output row (``group_size: -1``): SmolLM2 (0.95, 6e-3); measured
  96.9% / 2.8e-3.
- w8a8, Q8 activations on the groups (the default), weights and rows turned by Hadamard
  groups of 32: (0.97, 2e-3), (0.87, 1.5e-2); measured 97.5% / 1.35e-3 (96.7% / 3.0e-3
  in the plain basis, which the KL bound refuses) and 90.2-96.1% / 5.2e-4 to 7.2e-3.
  The tiny MoE models' mean KL is a few expert flips, either way in either basis
  (mixtral, seeds 0-3: 2.8e-3 to 8.0e-3 plain, 1.2e-3 to 9.3e-3 turned;
  docs/quantization.md, "Accuracy"), hence their room.
- w8a8 per row and per token (``group_size: -1``), turned the same way: SmolLM2
  (0.95, 6e-3); measured 96.1% / 4.2e-3 (89.4% / 2.7e-2 in the plain basis).
- fp8 weights (3 mantissa bits): (0.88, 3e-2), (0.70, 0.1); measured 93.0% / 1.5e-2 and
  77.2-87.8% / 5.6e-3 to 5.0e-2.
- int8 KV pages, a float16 scale per 16 values, groups in the Hadamard basis: SmolLM2
  (0.99, 1.5e-4), tiny models (0.93, 4e-3); measured 99.25% / 1.07e-4 (98.99% / 1.75e-4
  in the plain basis, which the KL bound refuses; 98.6% / 6.4e-4 with one scale per row)
  and 94.1-98.8% / 2.8e-5 to 2.4e-3 on the tiny models. Those have no outlier channels
  for the basis to spread, and a two-layer random MoE's mean KL is a few positions where
  an expert choice flips: mixtral went from 96.9% / 6.3e-4 (plain) to 94.1% / 2.4e-3 and
  qwen3_moe from 2.4e-4 to 5.4e-5, their median KL unchanged (1.2e-4 and 1.2e-4 on
  mixtral), the standard error of mixtral's mean 40% of it (docs/quantization.md).
- fp8 KV pages, the same scales: (0.95, 5e-3), (0.85, 4e-2); measured 96.5% / 3.1e-3
  (4.7e-3 with one scale per row) and, with one scale per row, 88.2-94.9%.
- ``gguf`` with bfloat16 activations for batched products (``activations=bfloat16``,
  the default on AMX hosts), the rest of the model float32: SmolLM2 (0.99, 3e-4);
  measured 99.35% / 1.3e-4.

Each method's row runs with float32 products (``activations=dtype``), so that it measures
that method's error alone on every host, whatever ``activations=auto`` picks there.
"""

from __future__ import annotations

import pytest
import torch
from quire.bench.accuracy import Comparison, compare, load_text, text_token_ids
from tiny_models import ARCHS

pytestmark = pytest.mark.slow

PER_ROW = {"quantization_config": {"group_size": -1}}
#: float32 activations for every product, whatever the host's ``activations=auto`` is
FLOAT_PRODUCTS = {"platform_options": {"activations": "dtype"}}
#: (label, options, (SmolLM2 top-1, KL), (tiny models' top-1, KL) or None: not run there)
BOUNDS = (
    ("int8", {"quantization": "int8"}, (0.97, 2e-3), (0.90, 4e-3)),
    ("int8 per row", {"quantization": "int8", **PER_ROW}, (0.95, 6e-3), None),
    ("w8a8", {"quantization": "w8a8"}, (0.97, 2e-3), (0.87, 1.5e-2)),
    ("w8a8 per row", {"quantization": "w8a8", **PER_ROW}, (0.95, 6e-3), None),
    ("fp8", {"quantization": "fp8"}, (0.88, 3e-2), (0.70, 0.1)),
    ("kv int8", {"kv_cache_dtype": "int8"}, (0.99, 1.5e-4), (0.93, 4e-3)),
    ("kv fp8", {"kv_cache_dtype": "fp8"}, (0.95, 5e-3), (0.85, 4e-2)),
)


@pytest.fixture(scope="module")
def smollm2_float(smollm2_gguf, tmp_path_factory):
    """SmolLM2's Q4_1 file dequantised into a float32 safetensors checkpoint (what
    int8, w8a8 and fp8 quantise on load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-f32")
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent,
                                                 gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    model.hf_quantizer = None  # plain float32 tensors now; only the marker says gguf
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_gguf.parent,
                                  gguf_file=smollm2_gguf.name).save_pretrained(out)
    return out


def _check(result, bound, what):
    top1, kl = bound
    assert result.top1_agreement >= top1 and result.kl_mean <= kl, (
        f"{what}: top-1 {result.top1_agreement:.3%}, mean KL {result.kl_mean:.2e}; "
        f"bound {top1:.0%}, {kl:g}")


def test_gguf_blocks_are_the_dequantised_model(smollm2_gguf):
    result = compare(str(smollm2_gguf), {"device": "cpu", **FLOAT_PRODUCTS}, max_tokens=512)
    assert result.top1_agreement == 1.0 and result.kl_mean <= 1e-6


def test_gguf_blocks_with_bfloat16_activations_stay_near_float32(smollm2_gguf):
    from quire.platforms.cpu.native import load_native_kernels

    native = load_native_kernels()
    if native is None or not native.has_quant_bf16:
        pytest.skip("no bfloat16 products (AVX512_BF16) on this host: the option would "
                    "keep float32 products")
    result = compare(str(smollm2_gguf), {
        "device": "cpu", "dtype": "float32",
        "platform_options": {"activations": "bfloat16"}})
    _check(result, (0.99, 3e-4), "gguf, bfloat16 activations")


def test_smollm2_each_method_within_its_bounds(smollm2_float, smollm2_gguf):
    from quire.tokenizer import load_tokenizer

    ids = text_token_ids(load_tokenizer(str(smollm2_float)), load_text())
    with Comparison(str(smollm2_float), ids, {"device": "cpu", "dtype": "float32"}) as cmp:
        for label, options, bound, _ in BOUNDS:
            if "kv_cache_dtype" not in options:
                _check(cmp.score({"device": "cpu", **FLOAT_PRODUCTS, **options}), bound,
                       label)
    for label, options, bound, _ in BOUNDS:
        if "kv_cache_dtype" in options:  # on the GGUF file: its blocks, KV pages quantised
            _check(compare(str(smollm2_gguf), {"device": "cpu", **FLOAT_PRODUCTS, **options}),
                   bound, label)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_each_method_within_its_bounds(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    for label, options, _, bound in BOUNDS:
        if bound is None:
            continue
        result = compare(path, {"device": "cpu", "kv_cache_memory": 16 << 20,
                                **FLOAT_PRODUCTS, **options}, max_tokens=256)
        _check(result, bound, f"{arch} {label}")
