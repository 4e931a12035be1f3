"""The torch dequantisers (:mod:`quire.quantization.dequant`, through
:mod:`quire.models.gguf_reader`) equal ``gguf.quants``, bit for bit.

Random bytes make every field take every value (sub-block scales and minima, high bits,
signs); only the f16 scales are drawn as finite numbers, since a random NaN's payload
says nothing about the arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from quire.models.gguf_reader import GGUFTensor, dequantize
from quire.quantization.dequant import BLOCK_DEQUANT

#: Byte offsets of each type's f16 fields within a block.
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def _random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype.name]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return data


@pytest.mark.parametrize("name", sorted(F16_FIELDS))
def test_torch_dequantize_equals_gguf_quants(name):
    qtype = GGMLQuantizationType[name]
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 3
    data = _random_blocks(qtype, rows * blocks_per_row, seed=len(name) + qtype.value)
    tensor = GGUFTensor("t", (block * blocks_per_row, rows), qtype.value, data.reshape(-1))

    got = dequantize(tensor)
    want = torch.from_numpy(gguf_dequantize(data.reshape(rows, -1), qtype))
    assert got.shape == (rows, block * blocks_per_row) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_every_type_of_the_table_is_checked():
    floats = {"F32", "F16", "BF16"}
    assert {name.upper() for name in BLOCK_DEQUANT} - floats == set(F16_FIELDS)


def test_f16_and_f32_pass_through():
    values = np.random.default_rng(0).standard_normal(12).astype(np.float32)
    for qtype, stored in ((GGMLQuantizationType.F32, values),
                          (GGMLQuantizationType.F16, values.astype(np.float16))):
        tensor = GGUFTensor("t", (4, 3), qtype.value, stored.view(np.uint8).copy())
        got = dequantize(tensor)
        assert got.shape == (3, 4)
        assert torch.equal(got.reshape(-1), torch.from_numpy(stored.astype(np.float32)))
