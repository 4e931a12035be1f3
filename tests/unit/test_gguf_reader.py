"""quire's GGUF header reader and torch dequantisation against gguf-py's own.

A small file is written with gguf-py's writer: metadata of every kind (scalars, a
string, arrays of strings and numbers, which the reader skips) and one tensor per
storage type, from random N(0, 1) data (never zeros), rows of 64. Metadata must read
back equal; tensors must dequantise bit for bit as ``gguf.quants.dequantize`` does
(the reference loader, and the one transformers uses). Q5_0/Q5_1 have no torch path
here and go through gguf-py: still equal, by construction.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize, quantize  # noqa: E402

from quire.models.gguf_reader import dequantize, read_gguf_index  # noqa: E402

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1]


def _write(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_string("general.name", "tiny test")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    floats = {}
    for i, qtype in enumerate(TYPES):
        data = rng.standard_normal((3 + i, 64)).astype(np.float32) * 0.5 + 0.25
        floats[qtype.name] = data
        if qtype in (Q.F32, Q.F16):  # plain numpy dtypes: the writer infers the type
            writer.add_tensor(f"t.{qtype.name}", quantize(data, qtype))
        else:  # packed bytes, [rows, bytes per row]
            writer.add_tensor(f"t.{qtype.name}", quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return floats


def test_metadata_and_tensor_index_match_gguf_py(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    _write(path)
    index = read_gguf_index(str(path))
    reader = gguf.GGUFReader(str(path))
    assert index.metadata["general.architecture"] == "llama"
    assert index.metadata["llama.attention.head_count"] == 9
    assert index.metadata["llama.attention.head_count_kv"] == 3
    assert index.metadata["general.name"] == "tiny test"
    assert index.metadata["tokenizer.ggml.add_bos_token"] is True
    assert index.metadata["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "tokenizer.ggml.tokens" not in index.metadata  # arrays are skipped
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.qtype == int(theirs.tensor_type)
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert np.array_equal(ours.data, np.asarray(theirs.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_bit_identical_to_gguf_py(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / "t.gguf"
    floats = _write(path)
    reader = gguf.GGUFReader(str(path))
    theirs = next(t for t in reader.tensors if t.name == f"t.{qtype.name}")
    ours = next(t for t in read_gguf_index(str(path)).tensors if t.name == theirs.name)
    got = dequantize(ours)
    expected = np.ascontiguousarray(gguf_dequantize(theirs.data, theirs.tensor_type),
                                    dtype=np.float32).reshape(floats[qtype.name].shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    assert np.abs(expected - floats[qtype.name]).max() < 0.2  # and it is the data written


def test_dequantized_weights_never_write_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    _write(path)
    before = path.read_bytes()
    f32 = next(t for t in read_gguf_index(str(path)).tensors if t.name == "t.F32")
    dequantize(f32).mul_(2.0)  # a view of a copy-on-write page
    assert path.read_bytes() == before


def test_not_gguf_and_truncated_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(str(bad))
    good = tmp_path / "t.gguf"
    _write(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated|past the end"):
        read_gguf_index(str(cut))
