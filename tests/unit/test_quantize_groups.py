"""Group-wise int8 (``int8`` and ``w8a8``'s default, ``quantization_config.group_size``
32): float weights quantised on load into GGUF's Q8_0 blocks, and ``w8a8``'s Q8
activations on them.

Oracles: the float weight itself (every weight within half a step of its group's float16
scale), ``dequantize`` then ``F.linear`` (weight-only products), and an integer
computation written here (int64 sums per 32-value block, each scaled by both blocks'
scales in float64) for ``w8a8``. The cpu platform's op is held to them at every ISA
level this host runs (the ``kernels`` fixture), with the float32 summation bound of
``tests/unit/test_cpu_quant_q8.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from quire.config import EngineConfig
from quire.ops.quantized import quantize_activation_blocks, quantized_linear
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.quant_linear import make_quantized_linear
from quire.quantization.methods import Quantization, QuantizationConfig, resolve_method
from quire.quantization.quantize import quantize_groups

EPS = torch.finfo(torch.float32).eps


def float_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows whose 32-groups span very different ranges (one group in eight 50x larger),
    a zero group and a zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w.view(rows, -1, 32)[:, ::8] *= 50
    w[0, :32] = 0.0
    w[-1] = 0.0
    return w


def group_scales(weight) -> torch.Tensor:
    """The float16 scale of every 32-group, float32 ``[rows, cols / 32]``."""
    blocks = weight.data.reshape(weight.rows, -1, 34)
    return blocks[:, :, :2].contiguous().view(torch.float16).float().squeeze(-1)


def test_each_weight_is_within_half_a_step_of_its_group_scale():
    w = float_weight(48, 320, seed=1)
    q = quantize_groups(w)
    assert q.format.name == "q8_0" and q.shape == (48, 320)
    d = group_scales(q)
    # the scale is max |w| / 127 in float16, and the codes use the whole int8 range
    amax = w.view(48, 10, 32).abs().amax(-1)
    assert torch.equal(d, (amax / 127).half().float())
    err = (q.dequantize() - w).abs().view(48, 10, 32)
    assert torch.all(err <= d.unsqueeze(-1) / 2)
    assert torch.all(q.dequantize()[0, :32] == 0) and torch.all(q.dequantize()[-1] == 0)
    # bfloat16 weights arrive as they are (the float32 copy is the quantiser's)
    assert torch.equal(quantize_groups(w.bfloat16()).data,
                       quantize_groups(w.bfloat16().float()).data)


def test_groups_lose_less_than_a_scale_per_row_on_uneven_rows():
    from quire.quantization.quantize import quantize_rows

    w = float_weight(48, 320, seed=2)
    grouped = (quantize_groups(w).dequantize() - w).abs().mean()
    per_row = (quantize_rows(w, "int8").dequantize() - w).abs().mean()
    assert grouped < per_row / 4


def test_widths_of_no_whole_groups_and_huge_weights_are_refused():
    with pytest.raises(ValueError, match=r"q8_0 needs a 2-D weight of whole 32-weight "
                                         r"groups, got \(4, 48\)"):
        quantize_groups(torch.ones(4, 48))
    with pytest.raises(ValueError, match="does not fit a float16 scale"):
        quantize_groups(torch.full((1, 32), 1e8))


def test_weight_only_products_are_dequantise_then_linear(kernels: NativeKernels):
    w = quantize_groups(float_weight(40, 256, seed=3))
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(40, generator=g)
    linear = make_quantized_linear(kernels)
    for m in (1, 5, 33):
        x = torch.randn(m, 256, generator=g)
        want = F.linear(x, w.dequantize(), bias)
        torch.testing.assert_close(quantized_linear(x, w, bias), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, w, bias), want, rtol=1e-5, atol=1e-5)


def integer_w8a8(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Q8 activations times Q8_0 codes: exact int64 sums per 32-block, each times both
    blocks' scales, summed in float64."""
    qx, dx = quantize_activation_blocks(x)
    qw = weight.data.reshape(weight.rows, -1, 34)[:, :, 2:].contiguous().view(torch.int8)
    m, blocks = dx.shape
    isum = torch.einsum("mbc,nbc->mnb", qx.view(m, blocks, 32).long(), qw.long())
    y = (isum.double() * dx.double()[:, None, :] * group_scales(weight).double()[None])
    y = y.sum(-1)
    return (y if bias is None else y + bias.double()).float()


def test_activation_blocks_are_quantised_per_32_values():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    x[1, 32:64] = 0.0
    x[2, :32] *= 1000  # an outlier block does not coarsen its neighbours
    qx, dx = quantize_activation_blocks(x)
    assert dx.shape == (3, 3) and qx.dtype == torch.int8
    assert dx[1, 1] == 0 and torch.all(qx[1, 32:64] == 0)
    back = (qx.float().view(3, 3, 32) * dx.unsqueeze(-1)).view(3, 96)
    assert torch.all((back - x).abs().view(3, 3, 32) <= dx.unsqueeze(-1) / 2 * (1 + 1e-6))
    assert (back - x)[2, 32:].abs().max() < 0.05


def test_w8a8_on_groups_is_the_blockwise_integer_product(kernels: NativeKernels):
    w = quantize_groups(float_weight(37, 320, seed=6))
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(37, generator=g)
    linear = make_quantized_linear(kernels)
    for m in (1, 4, 5, 33):
        x = torch.randn(m, 320, generator=g)
        x[0, :32] = 0.0
        want = integer_w8a8(x, w, bias)
        ref = quantized_linear(x, w, bias, int8_activations=True)
        torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
        # the C kernel: float32 scale products and sums, the bound of test_cpu_quant_q8
        qx, dx = quantize_activation_blocks(x)
        xq = (qx.float().view(m, -1, 32) * dx.unsqueeze(-1)).view(m, 320)
        gmax = w.dequantize().abs().view(37, -1, 32).amax(-1).repeat_interleave(32, 1)
        bound = (320 / 32 + 8) * EPS * (xq.abs().double() @ gmax.double().T + bias.abs())
        got = linear(x, w, bias, int8_activations=True)
        assert torch.all((got.double() - want.double()).abs() <= bound + 1e-30), m
        # and bfloat16 rows come back bfloat16
        y16 = linear(x.bfloat16(), w, bias, int8_activations=True)
        assert y16.dtype == torch.bfloat16 and y16.shape == (m, 37)


def test_group_size_sets_the_on_load_format():
    def settle(method, config=None):
        return resolve_method(method, gguf_file=False, checkpoint_quantization=None,
                              platform_name="p", platform_methods=("int8", "w8a8", "fp8"),
                              config=config)

    assert settle("int8").on_load_format == "q8_0"
    assert settle("w8a8").on_load_format == "q8_0" and settle("w8a8").int8_activations
    per_row = QuantizationConfig(group_size=-1)
    assert settle("int8", per_row).on_load_format == "int8"
    assert settle("w8a8", per_row).on_load_format == "int8"
    assert settle("fp8").on_load_format == "fp8_e4m3"
    assert Quantization("int8", -1).on_load_format == "int8"


@pytest.mark.parametrize("value, words", [
    ({"group_size": 64}, ("quantization_config.group_size must be 32 (a scale per 32 "
                          "weights) or -1 (one per output row), got 64")),
    ({"group_size": True}, "quantization_config.group_size must be 32"),
    ({"group_size": "32"}, "quantization_config.group_size must be 32"),
    ({"groups": 32}, "quantization_config: unknown key(s) groups; known: group_size"),
    ("{group_size: 32", "quantization_config must be a JSON object: "),
    ("[32]", "quantization_config must be a JSON object, got [32]"),
])
def test_bad_quantization_config_values_are_refused_in_one_line(value, words):
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        EngineConfig(model="m", quantization="int8", quantization_config=value)
    assert "\n" not in str(info.value)


def test_quantization_config_is_refused_with_a_method_it_does_not_apply_to():
    with pytest.raises(ValueError, match=re.escape(
            "quantization_config applies to quantization int8 or w8a8, got "
            "quantization='fp8'")):
        EngineConfig(model="m", quantization="fp8", quantization_config={"group_size": 32})
    config = EngineConfig(model="m", quantization="w8a8",
                          quantization_config='{"group_size": -1}')
    assert config.quantization_config == QuantizationConfig(-1)


def test_a_rank_s_columns_keep_the_single_rank_s_groups_or_fall_back_to_rows():
    """A row-parallel shard is cut from the whole rows' groups (what one rank holds) when
    it falls on whole groups; otherwise that layer takes a scale per row."""
    from quire.models.layers.quantized import LayerQuant

    w = float_weight(8, 192, seed=8)
    shard = LayerQuant(Quantization("int8"), torch.device("cpu"), (8, 96))
    shard.store_cols(w, 96, 96)
    part = shard.ordered_parts()[0]
    assert part.format.name == "q8_0"
    assert torch.equal(part.dequantize(), quantize_groups(w).dequantize()[:, 96:])
    odd = LayerQuant(Quantization("w8a8"), torch.device("cpu"), (8, 48))
    odd.store_cols(w[:, :96], 48, 48)
    assert odd.ordered_parts()[0].format.name == "int8"


def _w8a8_layer(w: torch.Tensor, cols: tuple[int, int] | None = None, group_size: int = 32):
    """A w8a8 layer's LayerQuant holding ``w`` (or this rank's columns of it) and its
    kernel on the reference op."""
    from quire.models.layers.quantized import LayerQuant
    from quire.ops.quantized import QuantizedLinearKernel

    shape = (w.shape[0], cols[1] if cols else w.shape[1])
    quant = LayerQuant(Quantization("w8a8", group_size), torch.device("cpu"), shape)
    if cols:
        quant.store_cols(w, *cols)
    else:
        quant.store_rows(0, w, 0, w.shape[0])
    kernel = QuantizedLinearKernel(quant.ordered_parts(), quantized_linear, shape[0],
                                   int8_activations=True, rotated=bool(quant.rotated))
    return quant, kernel


def test_w8a8_turns_weights_and_rows_by_hadamard_groups_of_32():
    """w8a8 from float weights stores W H and multiplies H x (H the orthonormal 32 x 32
    Hadamard matrix, its own inverse): the product is still W x, and an activation
    outlier channel, spread over its group, no longer sets the int8 step of the other 31
    values: the activations' share of the error falls about 9x here, the whole error
    (the weights' share is the same in both bases) more than 2x."""
    from quire.quantization.hadamard import hadamard_matrix, rotate_groups

    h = hadamard_matrix(32)
    assert torch.allclose(h @ h, torch.eye(32), atol=1e-6) and torch.equal(h, h.T)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(16, 256, generator=g)
    x[:, 7] = 30.0  # an outlier channel, as activations carry
    quant, kernel = _w8a8_layer(w)
    assert quant.rotated and kernel.rotated
    part = quant.ordered_parts()[0]
    assert part.format.name == "q8_0"
    want = x @ w.T
    torch.testing.assert_close(part.dequantize(), rotate_groups(w, 32), atol=2e-3, rtol=0)
    rotated_err = (kernel(x, None) - want).square().mean()
    plain_err = (quantized_linear(x, quantize_groups(w), None, int8_activations=True)
                 - want).square().mean()
    assert rotated_err < plain_err / 2
    # a scale per row and per token (group_size -1) turns the same way
    per_row, kernel = _w8a8_layer(w, group_size=-1)
    assert per_row.rotated and per_row.ordered_parts()[0].format.name == "int8"
    assert (kernel(x, None) - want).square().mean() < plain_err
    # int8 weights alone keep the plain basis
    from quire.models.layers.quantized import LayerQuant

    plain = LayerQuant(Quantization("int8"), torch.device("cpu"), (64, 256))
    plain.store_rows(0, w, 0, 64)
    assert plain.rotated is False


def test_w8a8_row_parallel_shards_turn_only_on_whole_groups():
    """Two ranks' input shards of 128 each turn their own groups: their partial products
    add up to the one-rank product. A shard that cuts a group cannot (the group's other
    values are on the other rank): it keeps the plain basis, with a scale per row."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(32, 256, generator=g) * 0.05
    x = torch.randn(4, 256, generator=g)
    _, whole = _w8a8_layer(w)
    parts = [_w8a8_layer(w, cols=(start, 128)) for start in (0, 128)]
    assert all(q.rotated for q, _ in parts)
    total = parts[0][1](x[:, :128], None) + parts[1][1](x[:, 128:], None)
    torch.testing.assert_close(total, whole(x, None), atol=1e-4, rtol=1e-4)
    odd, kernel = _w8a8_layer(w[:, :96], cols=(48, 48))
    assert odd.rotated is False and not kernel.rotated


def test_hadamard_can_be_turned_off_for_w8a8_only():
    """``quantization_config.hadamard`` false keeps w8a8's plain basis (faster decode rows);
    a non-boolean, or the key with another method, is refused naming the field."""
    from quire.models.layers.quantized import LayerQuant

    off = QuantizationConfig.parse('{"hadamard": false}')
    method = resolve_method("w8a8", gguf_file=False, checkpoint_quantization=None,
                            platform_name="p", platform_methods=("w8a8",), config=off)
    assert not method.rotates and Quantization("w8a8").rotates
    quant = LayerQuant(method, torch.device("cpu"), (8, 64))
    quant.store_rows(0, float_weight(8, 64, seed=13), 0, 8)
    assert quant.rotated is False
    with pytest.raises(ValueError, match=r"quantization_config.hadamard must be true or false"):
        QuantizationConfig.parse('{"hadamard": 1}')
    with pytest.raises(ValueError, match=r"quantization_config.hadamard applies to quantization "
                                         r"w8a8, got quantization='int8'"):
        EngineConfig(model="m", quantization="int8", quantization_config={"hadamard": False})
