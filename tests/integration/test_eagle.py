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
from spec_probes import count_async_steps, record_drafts
from tiny_models import hf_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8, 5, 17, 42, 9], [12, 7, 7, 12, 7, 7, 12, 7],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)) * 2]
K = 3


def _head_shapes(target: Path, seed: int):
    """A one-layer head's config from ``target``'s, its (hidden, intermediate, q and
    kv widths), and a seeded ``rand(*shape, scale=0.15)`` (with its generator)."""
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    if "layer_types" in config:  # Qwen configs name each layer's attention
        config["layer_types"] = config["layer_types"][:1]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = (config[k] * head_dim for k in ("num_attention_heads", "num_key_value_heads"))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    return config, (hidden, inter, q, kv), rand, g


def write_head(target: Path, directory: Path, *, bias: bool, safetensors: bool,
               seed: int = 0) -> Path:
    """A one-layer EAGLE head for ``target`` as the EAGLE project publishes them: its
    config (the target's with one layer), ``fc`` over [embedding, hidden state], the
    layer's tensors in Hugging Face's names without an input norm, and a copy of the
    embedding (which the engine ignores). ``safetensors`` writes the ``speculators``
    name of ``fc`` (``fusion_fc``) with a ``model.`` prefix, else ``pytorch_model.bin``
    with EAGLE's names."""
    config, (hidden, inter, q, kv), rand, _ = _head_shapes(target, seed)
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(q, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, q),
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
    target, head, _ = heads
    seen = record_drafts(monkeypatch)
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


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_every_llama_shaped_family_takes_both_heads(arch, tiny_checkpoint, tmp_path):
    """(The llama is above.) Gemma 3 is refused: it scales its embedding inside."""
    target = tiny_checkpoint(arch)
    plain, _ = _greedy(target, None)
    config = json.loads((target / "config.json").read_text())
    aux = [0, 1, config["num_hidden_layers"] - 1]
    for method, head in (("eagle", write_head(target, tmp_path / "e", bias=True,
                                              safetensors=False)),
                         ("eagle3", write_head3(target, tmp_path / "e3", aux=aux))):
        got, stats = _greedy(target, {"method": method, "model": str(head),
                                      "num_speculative_tokens": K,
                                      "disable_by_batch_size": None})
        assert got == plain, method
        assert stats.spec_num_draft_tokens > 0


def test_bad_heads_are_refused_naming_the_field(heads, tmp_path, tiny_checkpoint):
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
    with pytest.raises(ValueError, match=r"'eagle' reads a Llama-family target's hidden "
                                         r"states; Gemma3ForCausalLM is not one"):
        LLM(str(tiny_checkpoint("gemma3")), device="cpu", speculative_config={
            "method": "eagle", "model": str(head), "num_speculative_tokens": 2})


@pytest.mark.slow  # about 10 s each: two worker processes
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tensor_parallel_ranks_share_the_head_and_keep_greedy_output(method, heads,
                                                                     tmp_path):
    target, head, _ = heads
    if method == "eagle3":
        head = write_head3(target, tmp_path / "eagle3")
    plain, _ = _greedy(target, None)
    got, stats = _greedy(target, {"method": method, "model": str(head),
                                  "num_speculative_tokens": K,
                                  "disable_by_batch_size": None},
                         tensor_parallel_size=2, distributed_executor_backend="mp")
    assert got == plain
    assert stats.spec_num_draft_tokens > 0


@pytest.mark.slow  # about 15 s each: two worker processes
@pytest.mark.parametrize("arch, method", [
    ("llama", "eagle"),
    ("qwen2", "eagle"),  # qwen2 ties its LM head to the embedding
    ("llama", "eagle3"),  # it reads layers 0 and 1: one on each stage
])
def test_pipeline_stages_run_the_head_on_the_last_and_keep_its_proposals(
        arch, method, heads, tiny_checkpoint, tmp_path, monkeypatch):
    """The head runs on the last stage, with a copy of the embedding (an EAGLE-3 head
    with the inputs of its layers that the first stage kept), and sends its proposals
    to the first stage before that one's forward: every context gets the drafts it gets
    without stages, and greedy output is the target's."""
    target = tiny_checkpoint(arch)
    if method == "eagle3":
        head = write_head3(target, tmp_path / "e3")
    else:
        head = heads[1] if arch == "llama" else write_head(target, tmp_path / "e",
                                                           bias=True, safetensors=False)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": K,
            "disable_by_batch_size": None}
    plain, _ = _greedy(target, None)
    seen = record_drafts(monkeypatch)
    alone, _ = _greedy(target, spec)
    drafts_alone = {tuple(context): drafts for context, drafts in seen}
    seen.clear()
    got, stats = _greedy(target, spec, pipeline_parallel_size=2,
                         distributed_executor_backend="mp")
    assert got == alone == plain
    assert stats.spec_num_draft_tokens > 0 and len(drafts_alone) > 10
    assert {tuple(context): drafts for context, drafts in seen} == drafts_alone


# -- EAGLE-3 ---------------------------------------------------------------------------------
AUX = [0, 1, 1]  # the tiny target has two layers: its inputs to layers 0, 1 and 1
DRAFT_VOCAB = 200


def write_head3(target: Path, directory: Path, seed: int = 2,
                aux: list[int] | None = None) -> Path:
    """A tiny random EAGLE-3 head in the EAGLE project's layout: ``midlayer.*`` (q, k, v
    over [2H]), ``hidden_norm``, ``fc`` over [3H], its own ``norm`` and ``lm_head`` over a
    draft vocabulary of 200 of the target's 384 tokens, ``d2t`` and ``t2d``."""
    config, (hidden, inter, q, kv), rand, g = _head_shapes(target, seed)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": aux or AUX})
    kept = torch.randperm(config["vocab_size"], generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
        "midlayer.hidden_norm.weight": 1.0 + rand(hidden, scale=0.2),
        "midlayer.post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
        "norm.weight": 1.0 + rand(hidden, scale=0.2),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden, scale=0.5),
        "d2t": kept - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


class _HandHead3:
    """An EAGLE-3 head run by hand in plain torch over transformers' hidden states."""

    def __init__(self, head_dir: Path, target: torch.nn.Module) -> None:
        from safetensors.torch import load_file

        self.w = load_file(head_dir / "model.safetensors")
        self.config = LlamaConfig.from_pretrained(head_dir)
        self.rope = LlamaRotaryEmbedding(self.config)
        self.target = target

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[name]

    @torch.inference_mode()
    def prenorm(self, tokens: list[int], residual: torch.Tensor) -> torch.Tensor:
        """The head's hidden states before its norm; row i reads token i + 1 and the
        residual stream ``residual[i]`` (``fc`` of the target's, or its own)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, cfg = self.w, self.config
        n, heads, kvh = len(tokens), cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.hidden_size // heads
        e = self.target.model.embed_tokens(torch.tensor(tokens))
        x = torch.cat((self._norm(e, "midlayer.input_layernorm.weight"),
                       self._norm(residual, "midlayer.hidden_norm.weight")), -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        cos, sin = self.rope(v[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(heads // kvh, dim=-3) for t in (k[0], v[None][0]))
        scores = (q[0] @ k.transpose(-1, -2)) / d**0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
        r = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
        y = self._norm(r, "midlayer.post_attention_layernorm.weight")
        gate = torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T)
        mlp = (gate * (y @ w["midlayer.mlp.up_proj.weight"].T)) @ \
            w["midlayer.mlp.down_proj.weight"].T
        return r + mlp

    @torch.inference_mode()
    def proposals(self, context: list[int], k: int) -> list[int]:
        states = self.target(torch.tensor([context]), output_hidden_states=True)
        aux = torch.cat([states.hidden_states[i][0, :-1] for i in AUX], -1)
        residual = aux @ self.w["fc.weight"].T
        tokens = list(context[1:])
        drafts: list[int] = []
        for _ in range(k):
            out = self.prenorm(tokens, residual)[-1]
            best = int((self._norm(out, "norm.weight") @ self.w["lm_head.weight"].T).argmax())
            token = best + int(self.w["d2t"][best])
            drafts.append(token)
            tokens.append(token)
            residual = torch.cat((residual, out[None]))
        return drafts


def test_every_eagle3_proposal_is_the_head_s_own_over_the_target_s_layers(
        heads, tmp_path, monkeypatch):
    """EAGLE-3: the three target layers' inputs, its own norm and draft vocabulary
    mapped through d2t; chunked prefill, preemption-free; greedy output unchanged."""
    target = heads[0]
    head = write_head3(target, tmp_path / "eagle3")
    seen = record_drafts(monkeypatch)
    plain, _ = _greedy(target, None)
    got, stats = _greedy(target, {"method": "eagle3", "model": str(head),
                                  "num_speculative_tokens": K,
                                  "disable_by_batch_size": None},
                         max_num_batched_tokens=8)
    assert got == plain
    assert len(seen) > 20
    hand = _HandHead3(head, hf_model(target))
    kept = set((torch.arange(DRAFT_VOCAB) + hand.w["d2t"]).tolist())
    for context, drafts in seen:
        assert set(drafts) <= kept
        assert drafts == hand.proposals(context, len(drafts)), context


def test_bad_eagle3_heads_are_refused_naming_the_field(heads, tmp_path):
    target = heads[0]
    head = write_head3(target, tmp_path / "good")
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    far = tmp_path / "far"
    far.mkdir()
    (far / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes())
    config = json.loads((head / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}
    (far / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculative_config\.model .* three of the "
                                         r"target's 2 layers, got layer ids \[0, 1, 5\]"):
        LLM(str(target), device="cpu", speculative_config={**spec, "model": str(far)})
    no_map = tmp_path / "no_map"
    no_map.mkdir()
    (no_map / "config.json").write_text((head / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(head / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, no_map / "model.safetensors")
    with pytest.raises(ValueError, match=r"speculative_config\.model .* no d2t for a draft "
                                         r"vocabulary of 200 tokens"):
        LLM(str(target), device="cpu", speculative_config={**spec, "model": str(no_map)})


def test_a_grammar_and_parallel_samples_keep_their_rules_with_a_head(heads):
    """A regex grammar cuts and masks the head's proposals (greedy output unchanged and
    in the language); n = 2 samples (top-k 1: deterministic) fork on the head's pages."""
    import re

    target, head, _ = heads
    regex = r"[a-z]{2,5}( [a-z]{2,5}){0,3}\."
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": K,
            "disable_by_batch_size": None}
    grammar = SamplingParams(temperature=0, max_tokens=30,
                             structured_outputs={"regex": regex})
    forked = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True)
    runs = []
    for config in (None, spec):
        with LLM(str(target), device="cpu", block_size=4, speculative_config=config) as llm:
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            runs.append(([o.outputs[0].text for o in llm.generate(prompts, grammar)],
                         [[c.token_ids for c in o.outputs]
                          for o in llm.generate(prompts, forked)]))
    assert runs[1] == runs[0]
    for text in runs[1][0]:
        assert re.fullmatch(regex, text), text


# -- async scheduling ----------------------------------------------------------------------
#: Per prompt: two stop early, so that two run on alone (see :func:`_async_greedy`).
ASYNC_MAX_TOKENS = [6, 10, 24, 24]


def _async_greedy(path, spec, monkeypatch) -> tuple[list[list[int]], int]:
    """Greedy outputs of :data:`PROMPTS` with async scheduling and drafts off from 3
    running sequences: asynchronous steps while 3 or 4 run (the head keeps its K/V,
    reading each step's pending token on the device), then synchronous ones with drafts
    once two have stopped. Also the asynchronous steps taken."""
    steps = count_async_steps(monkeypatch)
    with LLM(str(path), device="cpu", block_size=4, async_scheduling=True,
             speculative_config={**spec, "disable_by_batch_size": 3}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                             for m in ASYNC_MAX_TOKENS])
        assert llm.engine.core.block_manager.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], len(steps)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_async_scheduling_keeps_the_head_s_proposals_and_greedy_output(method, heads,
                                                                       tmp_path,
                                                                       monkeypatch):
    """Every draft verified, after the asynchronous steps too, is the one the head
    gives by hand over the target's hidden states, so the K/V the head wrote in those
    steps is right; greedy output is the target's."""
    target, head, _ = heads
    if method == "eagle3":
        head = write_head3(target, tmp_path / "eagle3")
    plain, _ = _greedy(target, None, max_tokens=24)
    seen = record_drafts(monkeypatch)
    got, async_steps = _async_greedy(target, {"method": method, "model": str(head),
                                              "num_speculative_tokens": K}, monkeypatch)
    assert got == [p[:m] for p, m in zip(plain, ASYNC_MAX_TOKENS)]
    assert async_steps >= 5 and len(seen) >= 4
    hand = (_HandHead(head, hf_model(target)) if method == "eagle"
            else _HandHead3(head, hf_model(target)))
    for context, drafts in seen:
        assert drafts == hand.proposals(context, len(drafts)), context
