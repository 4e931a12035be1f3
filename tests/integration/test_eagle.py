"""Speculative decoding with an EAGLE head (``method: "eagle"``): tiny random heads
written in the EAGLE project's checkpoint layout load; every proposal the engine
verifies is the one the head gives when run by hand over the target's hidden states
(transformers computes both, the head's layer with Hugging Face's own Llama layer);
greedy output equals the target's through chunked prefill, preemption and prefix hits;
bad heads are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quire import LLM, SamplingParams
from safetensors.torch import save_file
from tiny_models import hf_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8, 5, 17, 42, 9], [12, 7, 7, 12, 7, 7, 12, 7],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)) * 2]
K = 3


def write_head(target: Path, directory: Path, *, bias: bool, safetensors: bool,
               seed: int = 0) -> Path:
    """A one-layer EAGLE head for ``target`` as the EAGLE project publishes them: its
    config (the target's with one layer), ``fc`` over [embedding, hidden state], the
    layer's tensors in Hugging Face's names without an input norm, and a copy of the
    embedding (which the engine ignores). ``safetensors`` writes the ``speculators``
    name of ``fc`` (``fusion_fc``) with a ``model.`` prefix, else ``pytorch_model.bin``
    with EAGLE's names."""
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(hidden, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, hidden),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
        "embed_tokens.weight": rand(config["vocab_size"], hidden),
    }
    if bias:
        tensors["fc.bias"] = rand(hidden)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if safetensors:
        renamed = {"model." + k.replace("fc.", "fusion_fc.") if k.startswith("fc.")
                   else "model." + k: v.contiguous() for k, v in tensors.items()}
        save_file(renamed, directory / "model.safetensors")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


class _HandHead:
    """The head run by hand: transformers' Llama layer (input norm off) after ``fc``,
    the target's LM head after it, over a whole sequence at once."""

    def __init__(self, head_dir: Path, target: torch.nn.Module) -> None:
        config = LlamaConfig.from_pretrained(head_dir)
        config._attn_implementation = "eager"
        tensors = torch.load(head_dir / "pytorch_model.bin", weights_only=True)
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size,
                                  bias="fc.bias" in tensors)
        self.fc.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("fc.")})
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.load_state_dict({k[9:]: v for k, v in tensors.items()
                                    if k.startswith("layers.0.")}, strict=False)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rope = LlamaRotaryEmbedding(config)
        self.target = target

    @torch.inference_mode()
    def hidden(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The head's output at every position: token ``i + 1`` is ``tokens[i]``."""
        ids = torch.tensor([tokens])
        x = self.fc(torch.cat((self.target.model.embed_tokens(ids), features[None]), -1))
        n = len(tokens)
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rope(x, positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.inference_mode()
    def proposals(self, context: list[int], k: int) -> list[int]:
        """What the head proposes after ``context`` (its last token not yet computed
        by the target)."""
        states = self.target(torch.tensor([context]), output_hidden_states=True)
        features = states.hidden_states[-1][0, :-1]  # after the final norm, at 0..p-1
        tokens = list(context[1:])
        drafts: list[int] = []
        for _ in range(k):
            out = self.hidden(tokens, features)
            token = int(self.target.lm_head(out[-1]).argmax())
            drafts.append(token)
            tokens.append(token)
            features = torch.cat((features, out[-1:]))
        return drafts


@pytest.fixture(scope="module")
def heads(tiny_checkpoint, tmp_path_factory):
    target = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("eagle")
    return (target, write_head(target, root / "bin", bias=True, safetensors=False),
            write_head(target, root / "st", bias=False, safetensors=True, seed=1))


def _greedy(path, spec, max_tokens=16, **options):
    with LLM(str(path), device="cpu", block_size=4, speculative_config=spec,
             **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True))
        core = llm.engine.core
        assert core.block_manager.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs], core.stats()


def test_every_proposal_is_the_head_s_own_over_the_target_s_hidden_states(heads,
                                                                          monkeypatch):
    """Through chunked prefill (a 8-token budget cuts the prompts) and decoding: the
    drafts each verification received are those the head gives by hand."""
    from quire.engine.core import EngineCore

    target, head, _ = heads
    seen: list[tuple[list[int], list[int]]] = []
    verify = EngineCore._verify

    def recording(self, seqs, logits, drafts, outputs):
        for seq, draft in zip(seqs, drafts):
            seen.append((list(seq.prompt_token_ids) + list(seq.output_token_ids), draft))
        return verify(self, seqs, logits, drafts, outputs)

    monkeypatch.setattr(EngineCore, "_verify", recording)
    plain, _ = _greedy(target, None)
    got, stats = _greedy(target, {"method": "eagle", "model": str(head),
                                  "num_speculative_tokens": K,
                                  "disable_by_batch_size": None},
                         max_num_batched_tokens=8)
    assert got == plain
    assert stats.spec_num_draft_tokens > 0 and len(seen) > 20
    hand = _HandHead(head, hf_model(target))
    for context, drafts in seen:
        assert drafts == hand.proposals(context, len(drafts)), context


@pytest.mark.parametrize("scenario", ["preemption", "prefix-hits", "safetensors"])
def test_greedy_outputs_equal_the_target_s(scenario, heads):
    target, head, st_head = heads
    spec = {"method": "eagle", "model": str(st_head if scenario == "safetensors" else head),
            "num_speculative_tokens": K, "disable_by_batch_size": None}
    options: dict = {}
    if scenario == "preemption":
        with LLM(str(target), device="cpu", block_size=4, speculative_config=spec) as probe:
            page = probe.engine.core.executor.bytes_per_block()
        options = {"kv_cache_memory": 20 * page}
    plain, _ = _greedy(target, None, max_tokens=24)
    got, stats = _greedy(target, spec, max_tokens=24, **options)
    assert got == plain
    assert stats.spec_num_draft_tokens > 0
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix-hits":
        again, stats = _greedy(target, spec, max_tokens=24)
        assert again == plain


def test_bad_heads_are_refused_naming_the_field(heads, tmp_path):
    target, head, _ = heads
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((head / "config.json").read_text())
    config["hidden_size"] = 128
    (wide / "config.json").write_text(json.dumps(config))
    torch.save({}, wide / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"speculative_config\.model .* hidden size 128"):
        LLM(str(target), device="cpu", speculative_config={
            "method": "eagle", "model": str(wide), "num_speculative_tokens": 2})
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((head / "config.json").read_text())
    tensors = torch.load(head / "pytorch_model.bin", weights_only=True)
    del tensors["layers.0.mlp.down_proj.weight"]
    torch.save(tensors, partial / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"speculative_config\.model .* does not provide "
                                         r"layers\.0\.mlp\.down_proj\.weight"):
        LLM(str(target), device="cpu", speculative_config={
            "method": "eagle", "model": str(partial), "num_speculative_tokens": 2})


@pytest.mark.slow  # about 15 s: two worker processes
def test_tensor_parallel_ranks_share_the_head_and_keep_greedy_output(heads):
    target, head, _ = heads
    plain, _ = _greedy(target, None)
    got, stats = _greedy(target, {"method": "eagle", "model": str(head),
                                  "num_speculative_tokens": K,
                                  "disable_by_batch_size": None},
                         tensor_parallel_size=2, distributed_executor_backend="mp")
    assert got == plain
    assert stats.spec_num_draft_tokens > 0
