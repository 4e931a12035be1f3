"""``scripts/make_gguf_model.py``: random-weight GGUF files with llama.cpp's Q4_K_M type mix,
valid block bytes (finite, ~N(0, 0.02) weights once dequantised), and metadata Quire loads.

The 1B and 8B presets are only planned here (their tensor counts per type are those
llama.cpp's loader prints for the real Q4_K_M files); the tiny preset is written, read
back with ``gguf``'s own reader and dequantiser, and run by ``quire generate``.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_gguf_model.py"


@pytest.fixture(scope="module")
def mk():
    spec = importlib.util.spec_from_file_location("make_gguf_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory) -> tuple[Path, str]:
    """The tiny preset written by the command line; (path, what it printed)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4km.gguf"
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--output",
                           str(path), "--seed", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return path, done.stdout


def _more_bits(n: int) -> set[int]:
    """llama.cpp's use_more_bits layers, written out independently of the script."""
    return {i for i in range(n) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}


def _expected_q4_k_m(name: str, n_layers: int, tied: bool) -> str:
    if name.endswith("norm.weight") or name == "rope_freqs.weight":
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "Q6_K"
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        return "Q6_K" if int(name.split(".")[1]) in _more_bits(n_layers) else "Q4_K"
    return "Q4_K"


def _data_bytes(plans) -> int:
    return sum(math.prod(p.shape) // GGML_QUANT_SIZES[p.qtype][0] * GGML_QUANT_SIZES[p.qtype][1]
               for p in plans)


# -- the type rule, on the real shapes (planned, not written) -----------------------------

@pytest.mark.parametrize("preset,counts,data_bytes", [
    # llama.cpp's loader on Llama-3.2-1B Q4_K_M: f32 34, q4_K 96, q6_K 17 (808 MB file).
    ("llama-3.2-1b", {"F32": 34, "Q4_K": 96, "Q6_K": 17}, (0.79e9, 0.81e9)),
    # ... on Llama-3.1-8B Q4_K_M: f32 66, q4_K 193, q6_K 33 (4.92 GB file).
    ("llama-3.1-8b", {"F32": 66, "Q4_K": 193, "Q6_K": 33}, (4.88e9, 4.93e9)),
])
def test_q4_k_m_plan_of_the_real_shapes(mk, preset, counts, data_bytes):
    shape = mk.PRESETS[preset]
    plans = mk.plan_tensors(shape, "q4_k_m")
    assert Counter(p.qtype.name for p in plans) == counts
    for p in plans:
        assert p.qtype.name == _expected_q4_k_m(p.name, shape.num_layers, shape.tie_embeddings), p
    names = [p.name for p in plans]
    assert ("output.weight" in names) is (not shape.tie_embeddings)
    assert data_bytes[0] < _data_bytes(plans) < data_bytes[1]
    attn_k = next(p for p in plans if p.name == "blk.0.attn_k.weight")
    assert attn_k.shape == (shape.num_kv_heads * shape.head_size, shape.hidden_size)


def test_rows_not_divisible_by_256_fall_back_as_llama_cpp_does(mk):
    shape = mk.ModelShape(hidden_size=288, num_layers=8, num_heads=4, num_kv_heads=4,
                          ffn_size=512, vocab_size=300, tie_embeddings=False,
                          context_length=64)
    types = {p.name: p.qtype.name for p in mk.plan_tensors(shape, "q4_k_m")}
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K, rows of 288
    assert types["blk.0.attn_v.weight"] == "Q8_0"  # Q6_K (first eighth), rows of 288
    assert types["blk.0.ffn_down.weight"] == "Q6_K"  # rows of 512
    assert types["blk.1.ffn_down.weight"] == "Q4_K"


def test_bad_shapes_and_types_are_named(mk):
    with pytest.raises(ValueError, match="num_kv_heads"):
        mk.ModelShape(hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=3, ffn_size=512,
                      vocab_size=300, tie_embeddings=True, context_length=64)
    with pytest.raises(ValueError, match="ffn_size"):
        mk.ModelShape(hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, ffn_size=500,
                      vocab_size=300, tie_embeddings=True, context_length=64)
    with pytest.raises(ValueError, match="q5_k_m"):
        mk.plan_tensors(mk.PRESETS["tiny"], "q5_k_m")


def test_overrides_follow_the_preset(mk):
    shape = mk.shape_from_args(mk.parse_args(
        ["--preset", "llama-3.2-1b", "--output", "x", "--num-layers", "2", "--hidden-size",
         "1024", "--no-tie-embeddings"]))
    assert (shape.num_layers, shape.hidden_size, shape.head_size) == (2, 1024, 32)
    assert not shape.tie_embeddings and shape.vocab_size == 128256


# -- the tiny file, written and read back ------------------------------------------------

def _check_values(tensor) -> np.ndarray:
    values = dequantize(tensor.data, tensor.tensor_type)
    assert np.isfinite(values).all(), tensor.name
    return values


def test_tiny_file_has_the_q4_k_m_types_and_sane_values(mk, tiny_q4_k_m):
    path, printed = tiny_q4_k_m
    shape = mk.PRESETS["tiny"]
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types == {p.name: p.qtype.name for p in mk.plan_tensors(shape, "q4_k_m")}
    assert types == {n: _expected_q4_k_m(n, shape.num_layers, False) for n in types}
    assert set(types.values()) == {"F32", "Q4_K", "Q6_K"}
    for qtype, count in Counter(types.values()).items():
        assert f"{qtype:5} {count:4} tensors" in printed
    assert f"{path.stat().st_size:,} bytes" in printed

    for tensor in reader.tensors:
        values = _check_values(tensor)
        if tensor.name.endswith("norm.weight"):
            assert (values == 1).all()
        elif tensor.name == "rope_freqs.weight":  # 1 (short waves) .. factor (long waves)
            assert values.shape == (shape.head_size // 2,)
            assert values[0] == 1 and values[-1] == shape.rope_scaling.factor
        else:
            assert tuple(reversed([int(d) for d in tensor.shape])) == values.shape
            assert np.abs(values).max() < 0.1, tensor.name
            assert 0.015 < values.std() < 0.025, tensor.name
            assert abs(values.mean()) < 2e-3, tensor.name


def test_tiny_file_metadata_and_tokenizer(mk, tiny_q4_k_m):
    reader = GGUFReader(tiny_q4_k_m[0])
    shape = mk.PRESETS["tiny"]

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama"
    assert field("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for key, value in {"context_length": shape.context_length,
                       "embedding_length": shape.hidden_size,
                       "block_count": shape.num_layers,
                       "feed_forward_length": shape.ffn_size,
                       "attention.head_count": shape.num_heads,
                       "attention.head_count_kv": shape.num_kv_heads,
                       "rope.dimension_count": shape.head_size,
                       "vocab_size": shape.vocab_size}.items():
        assert field(f"llama.{key}") == value, key
    assert field("llama.rope.freq_base") == shape.rope_theta
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    tokens = field("tokenizer.ggml.tokens")
    assert field("tokenizer.ggml.model") == "llama"
    assert len(tokens) == len(set(tokens)) == shape.vocab_size
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[258] == "<0xFF>"
    assert len(field("tokenizer.ggml.scores")) == len(field("tokenizer.ggml.token_type"))
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")) == (1, 2)


@pytest.mark.parametrize("file_type,qtype", [("q4_0", "Q4_0"), ("q8_0", "Q8_0"),
                                             ("f16", "F16")])
def test_uniform_types(mk, tmp_path, file_type, qtype):
    path = tmp_path / f"tiny-{file_type}.gguf"
    shape = mk.PRESETS["tiny"]
    counts = mk.write_model(str(path), shape, file_type, seed=2)
    assert counts == {"F32": 2 * shape.num_layers + 2, qtype: 7 * shape.num_layers + 2}
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) == 2:
            assert tensor.tensor_type.name == qtype
            values = _check_values(tensor)
            assert np.abs(values).max() < 0.15 and 0.015 < values.std() < 0.025, tensor.name


def test_quire_generates_from_the_tiny_file(tiny_q4_k_m):
    argv = [sys.executable, "-m", "quire.entrypoints.cli", "generate",
            "--model", str(tiny_q4_k_m[0]), "--max-tokens", "4", "-p", "hello", "--device", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "'hello' -> " in done.stdout and "[length]" in done.stdout, done.stdout
