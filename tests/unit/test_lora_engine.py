"""LoRA's engine side: requests checked on creation, the scheduler's max_loras rule (an
adapter beyond it waits in its place while later requests go), prefix-cache chains
rooted per adapter, the products' segmentation against a plain per-token loop."""

from __future__ import annotations

import itertools

import pytest
import torch
from quire import LoRARequest, SamplingParams
from quire.config import EngineConfig
from quire.engine.block_manager import BlockManager
from quire.engine.scheduler import Scheduler
from quire.engine.sequence import Sequence
from quire.lora.adapter import LoRAAdapter, LoRAWeights
from quire.lora.layers import LoRAManager
from torch import nn
from transformers import LlamaConfig

_ids = itertools.count()


def _seq(lora_id: int = 0, prompt: list[int] | None = None) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt or [1, 2, 3, 4, 5],
                    params=SamplingParams(max_tokens=4), lora_id=lora_id)


@pytest.mark.parametrize("fields, message", [
    (("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id"),
    (("a", True, "/p"), "lora_int_id"), (("a", 1, ""), "lora_path")])
def test_a_bad_request_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


@pytest.mark.parametrize("options, message", [
    ({"enable_lora": True, "pipeline_parallel_size": 2}, "without pipeline stages"),
    ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": -1}, "max_lora_rank"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
    ({"enable_lora": True, "compile": True}, "compile")])
def test_bad_lora_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_an_adapter_beyond_max_loras_waits_in_its_place():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_loras=1)
    a, b, c, d = _seq(1), _seq(2), _seq(1), _seq(0)
    for seq in (a, b, c, d):
        sched.add(seq, 9)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, c, d]
    assert list(sched.waiting) == [b]
    sched.complete_step(out)
    for seq in (a, c):
        sched.finish(seq, "stop")
    d.output_token_ids.append(9)  # what its step sampled: its next token to compute
    assert [s.seq for s in sched.schedule().scheduled] == [d, b]


def test_each_adapter_roots_its_own_prefix_chain():
    bm = BlockManager(16, 2)
    base, lora1, lora2 = _seq(0, [1, 2, 3]), _seq(1, [1, 2, 3]), _seq(2, [1, 2, 3])
    for seq in (base, lora1, lora2):
        bm.find_cached_prefix(seq)
    hashes = [seq.block_hashes[0] for seq in (base, lora1, lora2)]
    assert len(set(hashes)) == 3
    again = _seq(1, [1, 2, 7])
    bm.find_cached_prefix(again)
    assert again.block_hashes[0] == hashes[1]  # the same adapter and tokens: one chain


class _Tiny(nn.Module):
    """Two linears named as a Llama layer's q_proj and fused gate_up_proj are."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        layer = nn.Module()
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        layer.self_attn.q_proj = nn.Linear(8, 8, bias=False)
        layer.mlp.gate_up_proj = nn.Linear(8, 12, bias=False)
        self.model.layers = nn.ModuleList([layer])


def test_segmented_products_equal_a_per_token_loop(monkeypatch):
    """Tokens of two adapters and of the base model, interleaved by item: each row gets
    its own adapter's update, over every slice of a fused product."""
    config = LlamaConfig(hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    model = _Tiny()
    g = torch.Generator().manual_seed(0)

    def weights(out: int, inp: int, r: int) -> LoRAWeights:
        return LoRAWeights(torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g),
                           0.5)

    adapters = {
        1: LoRAAdapter("a", 2, {"model.layers.0.self_attn.q_proj": weights(8, 8, 2),
                                "model.layers.0.mlp.up_proj": weights(6, 8, 2)}),
        2: LoRAAdapter("b", 4, {"model.layers.0.mlp.gate_proj": weights(6, 8, 4)})}
    manager = LoRAManager(model, config, max_loras=2, max_rank=4, max_cpu_loras=2,
                          device=torch.device("cpu"), dtype=torch.float32)
    monkeypatch.setattr(manager, "_adapter", lambda lora_id: adapters[lora_id])
    ids, lengths = [2, 0, 1, 2], [3, 1, 2, 1]
    manager.prepare(ids, lengths, {}, torch.device("cpu"))
    x = torch.randn(sum(lengths), 8, generator=g)
    layer = model.model.layers[0]
    got_q, got_gu = layer.self_attn.q_proj(x), layer.mlp.gate_up_proj(x)
    owner = [i for i, n in zip(ids, lengths) for _ in range(n)]
    for row, lora_id in enumerate(owner):
        want_q = layer.self_attn.q_proj.weight @ x[row]
        want_gu = layer.mlp.gate_up_proj.weight @ x[row]
        mods = adapters[lora_id].modules if lora_id else {}
        for name, w in mods.items():
            delta = w.scaling * (w.b @ (w.a @ x[row]))
            if name.endswith("q_proj"):
                want_q = want_q + delta
            elif name.endswith("gate_proj"):
                want_gu = want_gu + torch.cat((delta, torch.zeros(6)))
            else:
                want_gu = want_gu + torch.cat((torch.zeros(6), delta))
        torch.testing.assert_close(got_q[row], want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_gu[row], want_gu, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="more than max_loras=2"):
        manager.prepare([1, 2, 3], [1, 1, 1], {}, torch.device("cpu"))


def _head_adapter(path, vocab_rows: int):
    """A rank-2 LM head adapter of a 16-token, 8-wide model, with the base head copy
    PEFT saves beside it (``vocab_rows`` rows)."""
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["lm_head"]}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 8),
               "base_model.model.lm_head.lora_B.weight": torch.ones(16, 2),
               "base_model.model.lm_head.base_layer.weight": torch.zeros(vocab_rows, 8)},
              str(path / "adapter_model.safetensors"))
    return str(path)


def test_the_base_head_saved_beside_an_adapter_is_skipped_unless_it_grew(tmp_path):
    from quire.lora.adapter import expected_modules, load_adapter

    config = LlamaConfig(hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    expected = expected_modules(config)
    adapter = load_adapter(_head_adapter(tmp_path / "same", 16), expected, max_rank=4)
    assert list(adapter.modules) == ["lm_head"] and adapter.modules["lm_head"].scaling == 2
    with pytest.raises(ValueError, match="adapters that add tokens are not supported"):
        load_adapter(_head_adapter(tmp_path / "grown", 20), expected, max_rank=4)
