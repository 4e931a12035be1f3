"""The quantization option: which method a checkpoint gets, what is refused at start, and
that a quantised model holds its weights quantised (no float copy) with the right parts."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quire.config import EngineConfig
from quire.distributed import TorchDistributedCommunicator
from quire.models.gguf_file import hf_tensor_name, iter_gguf_weights
from quire.models.gguf_reader import read_gguf_index
from quire.models.loader import load_model
from quire.ops.quantized import QuantizedLinearKernel
from quire.quantization.formats import FORMATS
from quire.quantization.methods import Quantization, resolve_method
from quire.quantization.random import random_quantized
from quire.quantization.tensor import QuantizedTensor

ALL = ("none", "gguf", "int8", "w8a8", "fp8")


def _resolve(requested, gguf=False, ckpt=None, methods=ALL):
    return resolve_method(requested, gguf_file=gguf, checkpoint_quantization=ckpt,
                          platform_name="p", platform_methods=methods)


def test_defaults_gguf_for_a_gguf_file_and_none_otherwise():
    assert _resolve(None, gguf=True).method == "gguf"
    assert _resolve(None).method == "none"
    assert _resolve("none", gguf=True).method == "none"  # the blocks expanded to float
    assert _resolve("w8a8").int8_activations and _resolve("fp8").on_load_format == "fp8_e4m3"


@pytest.mark.parametrize("requested, gguf, ckpt, methods, words", [
    ("int8", True, None, ALL, "quantization: int8 quantises a float checkpoint on load, "
                              "but this is a GGUF file"),
    ("gguf", False, None, ALL, "quantization: gguf keeps a GGUF file's blocks, but this "
                               "checkpoint is not a .gguf file"),
    ("w8a8", False, None, ("none", "gguf", "int8", "fp8"),
     "quantization: w8a8 is not run by the 'p' platform; it runs none, gguf, int8, fp8"),
    ("fp8", False, None, ("none",), "quantization: fp8 is not run by the 'p' platform"),
    (None, False, "gptq", ALL, "quantization: the checkpoint is already quantised (gptq"),
])
def test_contradictions_are_refused_naming_the_option(requested, gguf, ckpt, methods, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        _resolve(requested, gguf, ckpt, methods)


def test_an_unknown_method_is_refused_by_the_config():
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, int8, "
                                         "w8a8, fp8"):
        EngineConfig(model="m", quantization="int4")


@pytest.fixture(scope="module")
def tiny_gguf(random_gguf) -> Path:
    """The script's tiny Llama in llama.cpp's Q4_K_M mix (Q4_K and Q6_K tensors)."""
    return random_gguf("--preset", "tiny", "--seed", "3")


def _load(path: Path, method: str, group_size: int = 32):
    comm = TorchDistributedCommunicator("gloo", 0, 1)
    model, _ = load_model(str(path), comm, "cpu", torch.float32,
                          quantization=Quantization(method, group_size))
    return model


def test_a_gguf_model_keeps_every_weight_as_its_blocks(tiny_gguf):
    model = _load(tiny_gguf, "gguf")
    linears = [m for m in model.modules() if getattr(m, "op_site", None) == "linear"]
    assert linears and all(isinstance(m.kernel, QuantizedLinearKernel) for m in linears)
    assert all(m.weight.is_meta for m in linears)
    formats = {f for m in linears for f in m.kernel.formats}
    assert {"q4_k", "q6_k"} <= formats
    # no float weight anywhere: what the model holds is about the file's size
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    held += sum(part.nbytes for m in linears for part in m.kernel.parts)
    held += model.model.embed_tokens.quant.ordered_parts()[0].nbytes
    assert held <= 1.05 * tiny_gguf.stat().st_size


def test_gguf_blocks_give_the_dequantised_model_s_outputs(tiny_gguf):
    blocks, floats = _load(tiny_gguf, "gguf"), _load(tiny_gguf, "none")
    g = torch.Generator().manual_seed(0)
    for name, module in blocks.named_modules():
        if isinstance(getattr(module, "kernel", None), QuantizedLinearKernel):
            other = floats.get_submodule(name)
            x = torch.randn(3, module.kernel.parts[0].cols, generator=g)
            want = other(x) if other.kernel is None else other.kernel(x, other.bias)
            torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([1, 7, 300])
    assert torch.equal(blocks.model.embed_tokens(ids), floats.model.embed_tokens(ids))


def _blocks_and_places(path: Path):
    """The GGUF weights as their blocks, the dequantised ones, and where each tensor
    lies in a map of the file (by Hugging Face name)."""
    weights = dict(iter_gguf_weights(str(path), keep_blocks=True))
    floats = dict(iter_gguf_weights(str(path)))
    index = read_gguf_index(str(path))  # a map of its own: where each tensor lies
    arch = index.metadata["general.architecture"]
    in_file = {hf_tensor_name(t.name, arch): t.data.ctypes.data for t in index.tensors
               if t.name != "rope_freqs.weight"}
    blocks = {n: w for n, w in weights.items() if isinstance(w, QuantizedTensor)}
    return blocks, floats, in_file


def _in_place(blocks, in_file, names) -> bool:
    first = names[0]
    return all(blocks[n].data.data_ptr() - blocks[first].data.data_ptr()
               == in_file[n] - in_file[first] for n in names)


def test_llama_q_and_k_rows_come_in_rotary_order_from_a_file_of_their_own(tiny_gguf):
    """The first load writes llama's q/k rows reordered to the rows file; every load
    maps them from there, one after another, and every other weight from the GGUF
    file's map, where it lies. Nothing is copied into the process."""
    from quire.models.gguf_rotary_rows import rows_file

    blocks, floats, in_file = _blocks_and_places(tiny_gguf)
    reordered = [n for n in blocks if ".q_proj." in n or ".k_proj." in n]
    others = [n for n in blocks if n not in reordered]
    assert reordered and others
    assert _in_place(blocks, in_file, others)
    saved = rows_file(str(tiny_gguf))
    assert saved.stat().st_size == sum(blocks[n].data.numel() for n in reordered)
    starts = [blocks[n].data.data_ptr() for n in reordered]
    assert [b - a for a, b in itertools.pairwise(starts)] == [
        blocks[n].data.numel() for n in reordered[:-1]]  # back to back, in file order
    for name in reordered:
        assert torch.equal(blocks[name].dequantize(), floats[name])

    written = saved.stat().st_mtime_ns
    again, _, _ = _blocks_and_places(tiny_gguf)  # the next load maps the same file
    assert saved.stat().st_mtime_ns == written
    assert all(torch.equal(again[n].data, blocks[n].data) for n in reordered)


def test_a_rows_file_of_another_size_is_written_again(tiny_gguf):
    from quire.models.gguf_rotary_rows import rows_file

    blocks, _, _ = _blocks_and_places(tiny_gguf)
    reordered = [n for n in blocks if ".q_proj." in n or ".k_proj." in n]
    expected = {n: blocks[n].data.clone() for n in reordered}
    size = sum(blocks[n].data.numel() for n in reordered)
    del blocks  # its map of the file, which the next line changes in place
    saved = rows_file(str(tiny_gguf))
    saved.write_bytes(saved.read_bytes()[:-1])  # a file of another layout, say

    again, floats, _ = _blocks_and_places(tiny_gguf)

    assert saved.stat().st_size == size
    for name in reordered:
        assert torch.equal(again[name].data, expected[name]), name
        assert torch.equal(again[name].dequantize(), floats[name]), name


def test_without_a_writable_cache_the_rows_are_reordered_in_the_file_map(
        tiny_gguf, tmp_path, monkeypatch):
    """Where the rows file cannot be written, the rows are reordered inside the GGUF
    file's copy-on-write map, where they lie: held once, the same bytes."""
    in_cache, _, _ = _blocks_and_places(tiny_gguf)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(blocker))

    blocks, floats, in_file = _blocks_and_places(tiny_gguf)

    assert _in_place(blocks, in_file, list(blocks))
    for name, w in blocks.items():
        assert torch.equal(w.data, in_cache[name].data), name
        if ".q_proj." in name or ".k_proj." in name:
            assert torch.equal(w.dequantize(), floats[name])


def test_int8_quantises_the_linears_on_load_and_keeps_the_vocabulary_float(
        tiny_checkpoint):
    model = _load(tiny_checkpoint("llama"), "int8")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert getattr(model.lm_head, "quant", None) is None
    proj = model.model.layers[0].self_attn.qkv_proj
    assert proj.kernel.formats == ("q8_0", "q8_0", "q8_0")  # q, k, v as loaded
    per_row = _load(tiny_checkpoint("llama"), "int8", group_size=-1)
    proj = per_row.model.layers[0].self_attn.qkv_proj
    assert proj.kernel.formats == ("int8", "int8", "int8")  # quantization_config -1


@pytest.mark.parametrize("group_size", [32, -1])
def test_int8_layers_multiply_their_float_weights_quantised(tiny_checkpoint, group_size):
    """Each loaded layer's product is that of its own float weight quantised here and
    dequantised (the checkpoint's tensors, this quantiser, F.linear)."""
    from quire.quantization.quantize import quantize_groups, quantize_rows
    from safetensors.torch import load_file

    path = tiny_checkpoint("llama")
    model = _load(path, "int8", group_size)
    tensors = load_file(str(path / "model.safetensors"))
    weight = tensors["model.layers.0.mlp.down_proj.weight"].float()
    quantized = quantize_groups(weight) if group_size == 32 else quantize_rows(weight, "int8")
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    down = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(down(x), F.linear(x, quantized.dequantize()),
                               rtol=1e-5, atol=1e-5)


def _iq_file(tiny_gguf: Path, tmp_path: Path) -> Path:
    """The tiny file with one Q4_K tensor's type set to IQ4_XS (also 256-blocks, but 136
    bytes): the header is patched only, so the type is wrong but the file parses."""
    data = bytearray(tiny_gguf.read_bytes())
    name = b"blk.0.ffn_gate.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 12  # Q4_K
    data[type_at:type_at + 4] = (23).to_bytes(4, "little")  # IQ4_XS, smaller: fits
    path = tmp_path / "iq.gguf"
    path.write_bytes(bytes(data))
    return path


def test_a_tensor_type_quire_does_not_run_is_refused_before_any_tensor_is_read(
        tiny_gguf, tmp_path):
    weights = iter_gguf_weights(str(_iq_file(tiny_gguf, tmp_path)), keep_blocks=True)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_gate\.weight' is of "
                                         r"type IQ4_XS, which quire does not run"):
        next(weights)


def test_a_row_parallel_shard_must_split_on_whole_blocks():
    weight = random_quantized("q4_k", 4, 768, torch.Generator().manual_seed(0))
    assert weight.narrow_cols(256, 512).cols == 512
    with pytest.raises(ValueError, match="q4_k weights split on 256-weight blocks: columns "
                                         "0:384 of 768 do not"):
        weight.narrow_cols(0, 384)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_views_of_rows_and_columns_dequantise_to_the_same_numbers(name):
    weight = random_quantized(name, 6, 512, torch.Generator().manual_seed(1))
    whole = weight.dequantize()
    block = weight.format.block if weight.format.block > 1 else 32
    cols = max(block, 256 if block == 256 else 64)
    part = weight.narrow_rows(1, 4).narrow_cols(cols, cols)
    assert not part.data.is_contiguous() or part.rows == 1
    assert torch.equal(part.dequantize(), whole[1:5, cols:2 * cols])


def test_a_gguf_rope_freqs_tensor_gives_llama3_scaling_without_warnings(tiny_gguf):
    # the script writes rope_freqs as llama.cpp's converter computes it from Llama 3.1's
    # scaling (factor 32, low 1, high 4, original 8192): the divisors must give back
    # transformers' llama3 frequencies, and carrying them must not trip its key checks,
    # which run when a config is built from its dict (as the cached conversion is read)
    import logging

    from quire.models.gguf_file import load_gguf_config
    from quire.models.layers.rotary import get_rope
    from transformers import LlamaConfig

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore
    logger = logging.getLogger("transformers")  # it does not propagate to the root
    logger.addHandler(handler)
    try:
        loaded = load_gguf_config(str(tiny_gguf))
        config = type(loaded).from_dict(loaded.to_dict())
    finally:
        logger.removeHandler(handler)
    assert not [w for w in warnings if "rope" in w], warnings
    assert "freq_factors" not in (config.rope_parameters or {})
    head = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    llama3 = LlamaConfig(hidden_size=config.hidden_size,
                         num_attention_heads=config.num_attention_heads,
                         max_position_embeddings=config.max_position_embeddings,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    from_file, expected = get_rope(config, head), get_rope(llama3, head)
    assert not torch.equal(from_file._inv_freq, get_rope(LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        rope_parameters={"rope_type": "default", "rope_theta": theta}), head)._inv_freq)
    torch.testing.assert_close(from_file._inv_freq, expected._inv_freq, rtol=1e-6, atol=0)


def test_rows_reordered_in_place_equal_the_selected_rows(tmp_path):
    """reorder_rows_ gives select_rows' bytes where they lie: llama's per-head q/k
    permutation, any permutation, a narrowed view (its neighbours' bytes untouched), and
    rows in a copy-on-write map of a file (their pages made the process's own first; the
    file unchanged)."""
    import numpy as np

    from quire.models.gguf_file import unpermute_rows

    g = torch.Generator().manual_seed(0)
    fmt = FORMATS["q4_k"]
    cases = [(unpermute_rows(torch.arange(8192), 32), 8192, fmt.block_bytes * 2),
             (torch.randperm(1000, generator=g), 1000, fmt.block_bytes)]
    for index, rows, width in cases:
        data = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g)
        weight = QuantizedTensor(fmt, data.clone(), width // fmt.block_bytes * fmt.block)
        expected = weight.select_rows(index).data
        assert weight.reorder_rows_(index) is weight
        assert torch.equal(weight.data, expected)
    wide = torch.randint(0, 256, (256, 3 * fmt.block_bytes), dtype=torch.uint8, generator=g)
    before = wide.clone()
    narrow = QuantizedTensor(fmt, wide[:, fmt.block_bytes:2 * fmt.block_bytes], fmt.block)
    index = unpermute_rows(torch.arange(256), 4)
    expected = narrow.select_rows(index).data
    narrow.reorder_rows_(index)
    assert torch.equal(narrow.data, expected)
    assert torch.equal(wide[:, :fmt.block_bytes], before[:, :fmt.block_bytes])
    assert torch.equal(wide[:, 2 * fmt.block_bytes:], before[:, 2 * fmt.block_bytes:])
    path = tmp_path / "rows.bin"
    path.write_bytes(before.numpy().tobytes())
    mapped = torch.from_numpy(np.memmap(path, mode="c").reshape(256, -1))
    weight = QuantizedTensor(fmt, mapped, 3 * fmt.block)
    weight.reorder_rows_(index)
    assert torch.equal(weight.data, before.index_select(0, index))
    assert path.read_bytes() == before.numpy().tobytes()


def test_a_conversion_parses_the_file_s_metadata_once(tiny_gguf, tmp_path, monkeypatch):
    """The config and the tokenizer's config each ask transformers for the whole
    metadata parse; within one conversion the second gets a copy of the first's, and
    transformers' function is its own again afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from quire.models.gguf_hf_cache import cached_config, hf_dir_for_gguf

    parse, calls = gguf_utils.load_gguf_checkpoint, []

    def counted(path, *args, **kwargs):
        calls.append(str(path))
        return parse(path, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    entry = hf_dir_for_gguf(str(tiny_gguf), root=tmp_path / "cache")
    assert calls == [str(tiny_gguf)]
    assert gguf_utils.load_gguf_checkpoint is counted
    assert cached_config(entry).num_hidden_layers == parse(
        str(tiny_gguf), return_tensors=False)["config"]["num_hidden_layers"]
