"""The cpu platform's packed linears: same products as ``F.linear``, installed on a model.

Inputs are seeded N(0, 1), never zeros. Tolerance against ``F.linear`` (MKL) in float32:
``rtol = atol = 1e-5`` per product (oneDNN and MKL's transposed-weight product sum in
other orders: a few ulps of the sum, ~3e-7 relative seen); 1e-4 on a two-layer model's
logits, where those differences pass through norms and softmax. One row takes the
transposed-weight path (cut in a block per thread), several rows the oneDNN one: both
are covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire.distributed import TorchDistributedCommunicator
from quire.engine.scheduler import ScheduledSeq
from quire.engine.sequence import Sequence
from quire.engine.step_items import step_item
from quire.executor.model_runner import ModelRunner
from quire.models.llama import LlamaForCausalLM
from quire.platforms.cpu.packed_linear import (
    PackedLinear,
    onednn_available,
    pack_linear_weights,
)
from quire.platforms.cpu.options import ENV_DEFAULTS
from quire.platforms.cpu.platform import CpuPlatform
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.sampling_params import SamplingParams
from transformers import LlamaConfig

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows: int, with_bias: bool) -> None:
    weight, x = _randn(96, 40, seed=1), _randn(rows, 40, seed=2)
    bias = _randn(96, seed=3) if with_bias else None
    got = PackedLinear(weight)(x, bias)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads,out_features,parts", [(3, 200, 3), (2, 131, 2), (4, 100, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_split_over_threads_matches_f_linear(
    threads: int, out_features: int, parts: int, with_bias: bool
) -> None:
    """The one-row weight is cut into a block per thread (padded when the thread count
    does not divide the outputs; not cut below 64 outputs a block); the product is the
    same whatever the thread count when it runs."""
    weight, x = _randn(out_features, 40, seed=8), _randn(1, 40, seed=9)
    bias = _randn(out_features, seed=10) if with_bias else None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        linear = PackedLinear(weight)
        assert linear.split.shape[0] == parts
        for running in (threads, 1):
            torch.set_num_threads(running)
            got = linear(x, bias)
            assert got.shape == (1, out_features)
            torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_keeps_leading_dimensions() -> None:
    weight = _randn(24, 16, seed=4)
    for x in (_randn(2, 5, 16, seed=5), _randn(1, 1, 16, seed=6), _randn(16, seed=7)):
        got = PackedLinear(weight)(x, None)
        assert got.shape == (*x.shape[:-1], 24)
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedLinear(_randn(8, 8).half())
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(_randn(8))


def test_bfloat16_weights_run_on_onednn_at_every_row_count() -> None:
    """bfloat16 products in bfloat16 with float32 accumulation: against F.linear in
    float32 on the same bfloat16 values, within the output's bfloat16 rounding
    (2^-8 relative) plus a summation-order term."""
    weight = _randn(40, 48, seed=8).bfloat16()
    bias = _randn(40, seed=9).bfloat16()
    kernel = PackedLinear(weight)
    assert kernel.impl == "onednn" and kernel.panels is None and kernel.compact is None
    for rows in (1, 3, 64):
        x = _randn(rows, 48, seed=10 + rows).bfloat16()
        got = kernel(x, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
        want = F.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)


def _tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tied,
                         attention_bias=True)
    model = LlamaForCausalLM(config, TorchDistributedCommunicator("gloo", 0, 1))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def _logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    backend = CpuSdpaAttentionBackend()
    caches = [backend.allocate_kv_cache(4, 16, model.num_kv_heads, model.head_dim,
                                        torch.float32, torch.device("cpu"))
              for _ in range(model.num_layers)]
    seq = Sequence(seq_id=0, request_id="r", prompt_token_ids=prompt,
                   params=SamplingParams(max_tokens=1))
    seq.block_table = [2, 0, 3]
    runner = ModelRunner(model, backend, caches, 16, torch.device("cpu"))
    return runner.execute([step_item(ScheduledSeq(seq, 0, len(prompt)))]).logits


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_gives_the_same_logits(tied: bool) -> None:
    model = _tiny_llama(tied)
    prompt = [5, 17, 99, 3, 64, 120, 7, 7, 42, 11, 0, 127, 31, 8, 2, 9, 77, 13]
    expected = _logits(model, prompt)
    linears = 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert pack_linear_weights(model) == linears
    torch.testing.assert_close(_logits(model, prompt), expected, rtol=1e-4, atol=1e-4)
    # plain weights are released (meta, same shape) unless the embedding shares them
    mlp = model.model.layers[0].mlp.down_proj
    assert mlp.weight.device.type == "meta" and mlp.weight.shape == (64, 96)
    head_weight = model.lm_head.weight
    assert (head_weight.device.type == "cpu") == tied
    assert model.model.embed_tokens.weight.device.type == "cpu"


LINEAR_ENV = ENV_DEFAULTS["linear"]


def test_the_platform_packs_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = CpuPlatform()
    model = _tiny_llama(tied=False)
    platform.prepare_model(model, compiled=True)  # Inductor cannot lower packed weights
    assert model.lm_head.kernel is None
    monkeypatch.delenv(LINEAR_ENV, raising=False)
    platform.configure({"linear": "torch"})
    platform.prepare_model(model)
    assert model.lm_head.kernel is None
    with pytest.raises(ValueError, match="linear=.onednn."):
        platform.configure({"linear": "onednn"})
    with pytest.raises(ValueError, match="unknown cpu option"):
        platform.configure({"linaer": "torch"})
    monkeypatch.setenv(LINEAR_ENV, "onednn")
    with pytest.raises(ValueError, match=LINEAR_ENV):
        platform.configure({})
    monkeypatch.delenv(LINEAR_ENV)
    platform.configure({})
    platform.prepare_model(model)
    assert isinstance(model.lm_head.kernel, PackedLinear)
