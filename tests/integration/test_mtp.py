"""Speculative decoding with a checkpoint's own multi-token-prediction layers
(``method: "mtp"``), on a tiny random checkpoint in Xiaomi MiMo's layout: a Qwen2 model
(``model_type`` ``mimo``, ``MiMoForCausalLM``) with ``num_nextn_predict_layers`` MTP
layers stored as ``model.mtp_layers.{i}.*``.

The target alone generates what transformers' Qwen2 generates on its weights; each MTP
layer's logits are those of a plain-torch MTP layer written here from vLLM's
description (so the layout is read right); every proposal the engine verifies is the
one those layers give by hand; greedy output equals the target's; bad configs are
refused at start naming the field. No published MiMo checkpoint is used (none can be
downloaded here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quire import LLM, SamplingParams
from quire.interfaces.attention import AttentionBatch
from quire.models.context import ForwardContext
from quire.models.loader import load_model
from quire.models.mimo import MiMoForCausalLM, load_mtp_head
from quire.ops.attention import ReferenceAttentionBackend
from safetensors.torch import load_file, save_file
from spec_probes import count_async_steps, record_drafts
from tiny_models import _COMMON, SingleRank, _tokenizer, hf_greedy, randomize
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8, 5, 17, 42, 9], [12, 7, 7, 12, 7, 7, 12, 7],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)) * 2]
LAYERS = 2  # MTP layers in the checkpoint
K = 3  # drafts per step: more than the layers, so the last one is reused


def mtp_tensors(config: Qwen2Config, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP layers in MiMo's names: its own norms and ``input_proj``, and a Qwen2
    decoder layer's tensors, under ``model.mtp_layers.{i}.``."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def rand(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    tensors = {}
    for i in range(layers):
        own = {
            "token_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            "hidden_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            "input_proj.weight": rand(hidden, 2 * hidden),
            "final_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            "input_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            "post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.2),
            "self_attn.q_proj.weight": rand(q, hidden),
            "self_attn.q_proj.bias": rand(q),
            "self_attn.k_proj.weight": rand(kv, hidden),
            "self_attn.k_proj.bias": rand(kv),
            "self_attn.v_proj.weight": rand(kv, hidden),
            "self_attn.v_proj.bias": rand(kv),
            "self_attn.o_proj.weight": rand(hidden, q),
            "mlp.gate_proj.weight": rand(inter, hidden),
            "mlp.up_proj.weight": rand(inter, hidden),
            "mlp.down_proj.weight": rand(hidden, inter),
        }
        tensors |= {f"model.mtp_layers.{i}.{name}": t for name, t in own.items()}
    return tensors


def build_mimo(directory: Path, layers: int = LAYERS, seed: int = 0
               ) -> tuple[Path, torch.nn.Module]:
    """A tiny random MiMo checkpoint (float32), and transformers' Qwen2 model over the
    same target weights."""
    config = Qwen2Config(**_COMMON, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    meta = json.loads((directory / "config.json").read_text())
    meta.update(architectures=["MiMoForCausalLM"], model_type="mimo",
                num_nextn_predict_layers=layers)
    (directory / "config.json").write_text(json.dumps(meta))
    weights = load_file(directory / "model.safetensors")
    weights |= mtp_tensors(config, layers, seed + 1)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config._attn_implementation = "eager"
    return directory, model.eval()


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return build_mimo(tmp_path_factory.mktemp("mimo"))


@pytest.fixture(scope="module")
def plain(mimo):
    """The target's greedy outputs without speculation, 24 tokens each."""
    return _greedy(mimo[0], None, max_tokens=24)[0]


class HandMTP:
    """MiMo's MTP layers in plain torch, from vLLM's description: norm(embedding of the
    next token, zero at position 0) and norm(hidden state), joined [hidden, embedding],
    projected, one Qwen2 decoder layer, the final norm; the target's LM head after."""

    def __init__(self, path: Path, target: torch.nn.Module) -> None:
        self.w = {k: v for k, v in load_file(path / "model.safetensors").items()
                  if k.startswith("model.mtp_layers.")}
        self.config = target.config
        self.rope = Qwen2RotaryEmbedding(self.config)
        self.target = target

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[name]

    @torch.inference_mode()
    def hidden(self, layer: int, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s output at every position ``i`` (reading ``tokens[i]``, the
        token at ``i + 1``, and ``features[i]``), over a whole sequence at once."""
        def w(name: str) -> torch.Tensor:
            return self.w[f"model.mtp_layers.{layer}.{name}"]

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            return self._norm(x, f"model.mtp_layers.{layer}.{name}.weight")

        cfg = self.config
        n, heads, kvh = len(tokens), cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.hidden_size // heads
        e = self.target.model.embed_tokens(torch.tensor(tokens)).clone()
        e[0] = 0  # position 0
        x = torch.cat((norm(features, "hidden_layernorm"), norm(e, "token_layernorm")), -1)
        r = x @ w("input_proj.weight").T
        y = norm(r, "input_layernorm")

        def proj(name: str, width: int) -> torch.Tensor:
            out = y @ w(f"self_attn.{name}.weight").T + w(f"self_attn.{name}.bias")
            return out.view(n, width, d).transpose(0, 1)

        q, k, v = proj("q_proj", heads), proj("k_proj", kvh), proj("v_proj", kvh)
        cos, sin = self.rope(v[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(heads // kvh, dim=-3) for t in (k[0], v))
        scores = (q[0] @ k.transpose(-1, -2)) / d**0.5
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
        r = r + attn @ w("self_attn.o_proj.weight").T
        y = norm(r, "post_attention_layernorm")
        gate = torch.nn.functional.silu(y @ w("mlp.gate_proj.weight").T)
        r = r + (gate * (y @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
        return norm(r, "final_layernorm")

    @torch.inference_mode()
    def target_features(self, context: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its norm) at every position."""
        out = self.target(torch.tensor([context]), output_hidden_states=True)
        return out.hidden_states[-1][0]

    @torch.inference_mode()
    def proposals(self, context: list[int], k: int) -> list[int]:
        """What the MTP layers propose after ``context`` (its last token not yet
        computed by the target): draft ``j`` from layer ``min(j, LAYERS - 1)``, over the
        target's hidden states and the earlier drafts' own outputs."""
        features = self.target_features(context)[:-1]
        tokens = list(context[1:])
        drafts: list[int] = []
        for j in range(k):
            out = self.hidden(min(j, LAYERS - 1), tokens, features)[-1]
            token = int(self.target.lm_head(out).argmax())
            drafts.append(token)
            tokens.append(token)
            features = torch.cat((features, out[None]))
        return drafts


def _greedy(path, spec, max_tokens=16, rounds=1, **options):
    """Greedy outputs of :data:`PROMPTS`, ``rounds`` times over (one ``generate`` each,
    in one engine), and the engine's stats."""
    with LLM(str(path), device="cpu", block_size=4, speculative_config=spec,
             **options) as llm:
        got = []
        for _ in range(rounds):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True))
            got += [o.outputs[0].token_ids for o in outs]
        core = llm.engine.core
        assert core.block_manager.num_used_blocks == 0
        return got, core.stats()


def _mtp(k: int = K) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}


@pytest.mark.slow  # about 8 s: transformers recomputes every prefix (the logits test
# below compares the target's hidden states with transformers' in the default suite)
def test_the_target_alone_generates_what_transformers_qwen2_generates(mimo, plain):
    assert plain == [hf_greedy(mimo[1], p, 24) for p in PROMPTS]


# -- the head's logits against the hand-written layer ---------------------------------------

def _prefill(model: torch.nn.Module, n: int) -> ForwardContext:
    """A context for one sequence's ``n``-token prefill into fresh pages of 4 tokens."""
    backend = ReferenceAttentionBackend()
    pages = -(-n // 4)
    caches = [backend.allocate_kv_cache(pages, 4, model.num_kv_heads, model.head_dim,
                                        torch.float32, torch.device("cpu"))
              for _ in range(model.num_layers)]
    table = torch.arange(pages, dtype=torch.int32).flip(0)[None]  # pages out of order
    slots = [int(table[0, p // 4]) * 4 + p % 4 for p in range(n)]
    batch = AttentionBatch(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, n]),
                           seq_lens=torch.tensor([n]), block_tables=table, block_size=4,
                           max_query_len=n, max_seq_len=n, query_lens=(n,))
    return ForwardContext(backend, backend.build_metadata(batch), caches)


@torch.inference_mode()
def test_each_mtp_layer_s_logits_equal_the_hand_written_layer(mimo):
    """The head over a whole sequence, step 0 (layer 0, from the target's hidden
    states) and step 1 (layer 1), against :class:`HandMTP` in float32."""
    path, hf = mimo
    comm = SingleRank()
    target, _ = load_model(str(path), comm, "cpu", torch.float32)
    assert isinstance(target, MiMoForCausalLM)
    head = load_mtp_head(str(path), comm, "cpu", torch.float32, target)
    assert head.num_layers == LAYERS
    context = PROMPTS[3]
    n = len(context)
    ids, positions = torch.tensor(context), torch.arange(n)
    hidden = target(ids, positions, _prefill(target, n))
    hand = HandMTP(path, hf)
    features = hand.target_features(context)
    torch.testing.assert_close(hidden, features, atol=1e-4, rtol=1e-4)
    for step in range(LAYERS + 1):  # a step past the layers reuses the last
        out = head(ids[1:], positions[:-1], _prefill(head, n - 1), hidden[:-1], step)
        want = hand.hidden(min(step, LAYERS - 1), context[1:], features[:-1])
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.compute_logits(out), hf.lm_head(want),
                                   atol=1e-4, rtol=1e-4)


# -- through the engine ---------------------------------------------------------------------
def test_every_proposal_is_the_mtp_layers_own_over_the_target_s_hidden_states(
        mimo, plain, monkeypatch):
    """Through chunked prefill (an 8-token budget cuts the prompts) and decoding, with
    more drafts than layers: the drafts each verification received are those the
    layers give by hand, and greedy output is the target's."""
    path, hf = mimo
    seen = record_drafts(monkeypatch)
    got, stats = _greedy(path, _mtp(), max_num_batched_tokens=8)
    assert got == [p[:16] for p in plain]
    assert stats.spec_num_draft_tokens > 0 and len(seen) > 20
    hand = HandMTP(path, hf)
    for context, drafts in seen[:: len(seen) // 8]:  # eight of them, spread
        assert drafts == hand.proposals(context, len(drafts)), context


@pytest.mark.parametrize("scenario", ["k1", "preemption", "prefix-hits"])
def test_greedy_outputs_equal_the_target_s(scenario, mimo, plain):
    """One draft a step (one layer); preempted sequences (their head K/V recomputed);
    prompts served a second time from the prefix cache (pages the head wrote too)."""
    path, _ = mimo
    spec = _mtp(1 if scenario == "k1" else K)
    options: dict = {}
    if scenario == "preemption":
        with LLM(str(path), device="cpu", block_size=4, speculative_config=spec) as probe:
            page = probe.engine.core.executor.bytes_per_block()
        options = {"kv_cache_memory": 20 * page}
    if scenario == "prefix-hits":
        options = {"enable_prefix_caching": True}
    rounds = 2 if scenario == "prefix-hits" else 1
    got, stats = _greedy(path, spec, max_tokens=24, rounds=rounds, **options)
    assert got == plain * rounds
    assert stats.spec_num_draft_tokens > 0
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix-hits":
        assert stats.prefix_hits > 0


def test_async_scheduling_keeps_the_mtp_proposals_and_greedy_output(mimo, plain,
                                                                    monkeypatch):
    """Async scheduling with drafts off from 3 running sequences: asynchronous steps
    while 3 or 4 run (the head writes its K/V from each step's pending token, read on
    the device), synchronous ones with drafts once two have stopped. The drafts verified
    then are the layers' own by hand, and greedy output is the target's."""
    path, hf = mimo
    steps = count_async_steps(monkeypatch)
    seen = record_drafts(monkeypatch)
    max_tokens = [6, 10, 24, 24]
    with LLM(str(path), device="cpu", block_size=4, async_scheduling=True,
             speculative_config={**_mtp(), "disable_by_batch_size": 3}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                             for m in max_tokens])
        assert llm.engine.core.block_manager.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in outs] == \
        [p[:m] for p, m in zip(plain, max_tokens)]
    assert len(steps) >= 5 and len(seen) >= 4
    hand = HandMTP(path, hf)
    for context, drafts in seen:
        assert drafts == hand.proposals(context, len(drafts)), context


@pytest.mark.slow  # about 15 s: two worker processes
def test_pipeline_stages_run_the_mtp_layers_on_the_last_and_keep_their_proposals(
        mimo, plain, monkeypatch):
    """The MTP layers run on the last stage, with a copy of the embedding, and send
    their proposals to the first stage before that one's forward: every draft verified
    is the layers' own by hand, and greedy output is the target's."""
    path, hf = mimo
    seen = record_drafts(monkeypatch)
    got, stats = _greedy(path, _mtp(), max_tokens=24, pipeline_parallel_size=2,
                         distributed_executor_backend="mp")
    assert got == plain
    assert stats.spec_num_draft_tokens > 0 and len(seen) > 10
    hand = HandMTP(path, hf)
    for context, drafts in seen[:: len(seen) // 8]:  # eight of them, spread
        assert drafts == hand.proposals(context, len(drafts)), context


@pytest.mark.slow  # about 10 s: two worker processes
def test_tensor_parallel_ranks_share_the_mtp_layers_and_keep_greedy_output(mimo, plain):
    got, stats = _greedy(mimo[0], _mtp(), max_tokens=24, tensor_parallel_size=2,
                         distributed_executor_backend="mp")
    assert got == plain
    assert stats.spec_num_draft_tokens > 0


def test_bad_mtp_configs_are_refused_naming_the_field(mimo, tiny_checkpoint, tmp_path):
    path, _ = mimo
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp' needs a "
                                         r"checkpoint with its own MTP layers .* "
                                         r"Qwen2ForCausalLM with 0"):
        LLM(str(tiny_checkpoint("qwen2")), device="cpu", speculative_config=_mtp())
    none = tmp_path / "none"
    none.mkdir()
    for file in path.iterdir():
        (none / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp' needs .* "
                                         r"MiMoForCausalLM with 0"):
        LLM(str(none), device="cpu", speculative_config=_mtp())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 3}))
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp': .* declares 3 "
                                         r"MTP layers but does not provide layers\.2\."):
        LLM(str(none), device="cpu", speculative_config=_mtp())
    for k in (0, 17):
        with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens "
                                             r"must be an integer in \[1, 16\]"):
            LLM(str(path), device="cpu", speculative_config=_mtp(k))
    with pytest.raises(ValueError, match=r"speculative_config\.model does not apply to "
                                         r"method 'mtp'"):
        LLM(str(path), device="cpu", speculative_config={**_mtp(), "model": str(path)})
