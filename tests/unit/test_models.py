"""Our model implementations and loader against Hugging Face transformers as the oracle.

Tiny random-weight checkpoints (2 layers, hidden 64) are built with transformers, saved as
safetensors, loaded by ``quire.models.loader`` and run as one flattened prefill through the
cpu reference attention backend; logits must match HF's eager model in float32.
"""

from __future__ import annotations

import copy
import math
import os
import re
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from quire.interfaces.attention import AttentionBatch
from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.gguf_file import BLOCK_NAMES, GLOBAL_NAMES, hf_tensor_name, unpermute_rows
from quire.models.layers.rotary import SUPPORTED_ROPE_TYPES, get_rope
from quire.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, head_dim_of
from quire.models.loader import iter_weights, load_model
from quire.models.registry import ModelRegistry, resolve_architecture
from quire.ops.attention import ReferenceAttentionBackend
from quire.plugins.spec import ModelSpec
from tiny_models import SingleRank

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 200, 5]  # 12 tokens, all < 256
TOL = 1e-4


# --------------------------------------------------------------------------- helpers


class _ThreadGroup:
    """Shared state of a fake process group whose ranks are threads of this process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=120)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return everyone


class ThreadCommunicator(Communicator):
    """Real collectives between threads: lets tensor parallelism run in one process."""

    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group.exchange(self._rank, tensor)).sum(0)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.group.exchange(self._rank, tensor), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.group.exchange(self._rank, tensor)[src].clone()

    def barrier(self) -> None:
        self.group.barrier.wait()


@dataclass
class Sequences:
    """Paged KV state of a few sequences, and the flattened steps that feed them."""

    model: torch.nn.Module
    num_seqs: int = 1
    block_size: int = 4
    max_len: int = 32
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        self.backend = ReferenceAttentionBackend()
        self.blocks_per_seq = -(-self.max_len // self.block_size)
        self.kv_caches = [
            self.backend.allocate_kv_cache(
                self.num_seqs * self.blocks_per_seq,
                self.block_size,
                self.model.num_kv_heads,
                self.model.head_dim,
                self.dtype,
                torch.device("cpu"),
            )
            for _ in range(self.model.num_layers)
        ]
        # sequence i owns blocks [i * n, (i + 1) * n), in reverse so pages are not in order
        self.block_tables = torch.stack(
            [
                torch.arange(self.blocks_per_seq, dtype=torch.int32).flip(0)
                + i * self.blocks_per_seq
                for i in range(self.num_seqs)
            ]
        )
        self.lens = [0] * self.num_seqs

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step with ``new_tokens[seq]`` appended to each listed sequence.

        :returns: per sequence, float32 logits [n_new, vocab].
        """
        seqs = sorted(new_tokens)
        ids, positions, slots, q_lens = [], [], [], []
        for s in seqs:
            start, n = self.lens[s], len(new_tokens[s])
            for p in range(start, start + n):
                block = int(self.block_tables[s, p // self.block_size])
                slots.append(block * self.block_size + p % self.block_size)
            ids += new_tokens[s]
            positions += list(range(start, start + n))
            q_lens.append(n)
            self.lens[s] += n
        seq_lens = [self.lens[s] for s in seqs]
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=self.block_tables[seqs],
            block_size=self.block_size,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens=tuple(q_lens),
        )
        ctx = ForwardContext(self.backend, self.backend.build_metadata(batch), self.kv_caches)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        out, row = {}, 0
        for s, n in zip(seqs, q_lens):
            out[s] = logits[row : row + n]
            row += n
        return out


def _common(**overrides: object) -> dict:
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    return base


CASES: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_common(architectures=["LlamaForCausalLM"])),
    "llama-llama3-rope": LlamaConfig(
        **_common(
            architectures=["LlamaForCausalLM"],
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    "llama-tied-bias": LlamaConfig(
        **_common(
            architectures=["LlamaForCausalLM"],
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        )
    ),
    "mistral-window": MistralConfig(
        **_common(architectures=["MistralForCausalLM"], sliding_window=5)
    ),
    "qwen2-window": Qwen2Config(
        **_common(
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        )
    ),
    "qwen3": Qwen3Config(**_common(architectures=["Qwen3ForCausalLM"], head_dim=32)),
}


def _save_hf_checkpoint(config: PretrainedConfig, path: str) -> torch.nn.Module:
    """A seeded random HF model, every parameter perturbed (biases, norms too), saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(  # a copy: from_config may annotate it
        copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for p in model.parameters():  # tied weights appear once
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint(case) -> (directory, HF model)``, each built once per module."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(case: str) -> tuple[str, torch.nn.Module]:
        if case not in built:
            path = str(tmp_path_factory.mktemp(case))
            built[case] = (path, _save_hf_checkpoint(CASES[case], path))
        return built[case]

    return get


# --------------------------------------------------------------------------- logits vs HF


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_match_transformers(case: str, checkpoint) -> None:
    path, hf = checkpoint(case)
    model, config = load_model(path, SingleRank(), "cpu", torch.float32)
    assert type(model).__name__ == config.architectures[0]
    ours = Sequences(model).step({0: PROMPT})[0]
    diff = _max_diff(ours, _hf_logits(hf, PROMPT))
    print(f"{case}: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def test_prefill_then_decode_and_batching_match_transformers(checkpoint) -> None:
    """Chunked prefill, single-token decodes, and two sequences in one flattened step."""
    path, hf = checkpoint("qwen2-window")  # windowed layer: exercises the cached prefix
    model, _ = load_model(path, SingleRank(), "cpu", torch.float32)
    other = [5, 6, 7, 8, 9, 10, 11]
    expect_a, expect_b = _hf_logits(hf, PROMPT), _hf_logits(hf, other)

    seqs = Sequences(model, num_seqs=2)
    got_a = [seqs.step({0: PROMPT[:5], 1: other})]  # two prefills in one step
    diffs = [_max_diff(got_a[0][1], expect_b)]
    got_a = [got_a[0][0], seqs.step({0: PROMPT[5:9]})[0]]  # a chunk after a cached prefix
    for t in PROMPT[9:]:  # decodes
        got_a.append(seqs.step({0: [t]})[0])
    diffs.append(_max_diff(torch.cat(got_a), expect_a))
    print(f"batched/decode max diffs: {diffs}")
    assert max(diffs) <= TOL


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_transformers(world_size: int, tmp_path: str) -> None:
    """Shards on threads with real collectives: vocab 250 (padded), tied, biased, 2 KV heads
    (sharded at 2 ranks, replicated at 4)."""
    config = LlamaConfig(
        **_common(
            architectures=["LlamaForCausalLM"],
            vocab_size=250,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        )
    )
    hf = _save_hf_checkpoint(config, str(tmp_path))
    TP_PROMPT = [t % 250 for t in PROMPT[:-1]] + [249]  # the last row of the vocabulary
    expected = _hf_logits(hf, TP_PROMPT)
    group = _ThreadGroup(world_size)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            comm = ThreadCommunicator(group, rank)
            model, _ = load_model(str(tmp_path), comm, "cpu", torch.float32)
            results[rank] = Sequences(model).step({0: TP_PROMPT})[0]
        except BaseException as e:  # surfaced below; a dead rank breaks the barrier
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    diffs = [_max_diff(results[r], expected) for r in range(world_size)]
    print(f"tp={world_size}: max diffs per rank {diffs}")
    assert max(diffs) <= TOL


def test_bfloat16_keeps_loaders_and_runs(checkpoint) -> None:
    path, hf = checkpoint("llama")
    model, _ = load_model(path, SingleRank(), "cpu", torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hasattr(model.model.layers[0].self_attn.qkv_proj.weight, "weight_loader")
    logits = Sequences(model, dtype=torch.bfloat16).step({0: PROMPT})[0]
    assert logits.dtype == torch.float32
    diff = _max_diff(logits, _hf_logits(hf, PROMPT))
    print(f"bfloat16 vs HF float32: max |logits diff| = {diff:.3g}")
    assert diff < 0.1  # bf16 rounding only


# --------------------------------------------------------------------------- loading errors


def test_missing_and_unknown_tensors_are_named(checkpoint, tmp_path: str) -> None:
    from safetensors.torch import save_file

    path, _ = checkpoint("llama")
    tensors = dict(iter_weights(path))
    config_json = open(os.path.join(path, "config.json")).read()

    def write(state: dict) -> str:
        d = tmp_path / f"ckpt{len(os.listdir(tmp_path))}"
        d.mkdir()
        (d / "config.json").write_text(config_json)
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
        return str(d)

    partial = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(write(partial), SingleRank(), "cpu", torch.float32)
    extra = {**tensors, "model.layers.0.mlp.mystery.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="mystery"):
        load_model(write(extra), SingleRank(), "cpu", torch.float32)
    bad = {**tensors, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape mismatch"):
        load_model(write(bad), SingleRank(), "cpu", torch.float32)


# --------------------------------------------------------------------------- registry


def test_registry_resolves_and_lists_supported() -> None:
    assert resolve_architecture(CASES["qwen3"]) is Qwen3ForCausalLM
    no_arch = Qwen2Config(**_common())
    assert no_arch.architectures is None  # as GGUF-derived configs are
    assert resolve_architecture(no_arch) is Qwen2ForCausalLM
    gpt2 = PretrainedConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        resolve_architecture(gpt2)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


def test_registry_plugins_add_but_never_replace() -> None:
    class Custom(torch.nn.Module):
        pass

    registry = ModelRegistry([ModelSpec("CustomForCausalLM", lambda: Custom)])
    assert registry.resolve(PretrainedConfig(architectures=["CustomForCausalLM"])) is Custom
    assert "CustomForCausalLM" in registry.supported()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*quire-evil.*quire\.models\.llama"):
        ModelRegistry([(ModelSpec("LlamaForCausalLM", lambda: Custom), "quire-evil")])


# --------------------------------------------------------------------------- rotary


def _hf_table(config: PretrainedConfig, positions: torch.Tensor, seq_len: int | None = None):
    rope_type = config.rope_parameters["rope_type"]
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos() * scale, freqs.sin() * scale


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)],
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_rope_tables_match_transformers(name: str) -> None:
    params = {"rope_theta": 10000.0, **ROPE_CASES[name]}
    config = LlamaConfig(**_common(max_position_embeddings=64, rope_parameters=params))
    rope = get_rope(config, head_dim_of(config))
    half = head_dim_of(config) // 2
    positions = torch.arange(rope.max_position)
    if name == "longrope":  # short factors below the original length, long from there
        short = _hf_table(config, positions)
        long = _hf_table(config, positions, seq_len=17)
        cos = torch.where(positions[:, None] < 16, short[0], long[0])
        sin = torch.where(positions[:, None] < 16, short[1], long[1])
    else:
        cos, sin = _hf_table(config, positions)
    ours_cos, ours_sin = (t[:, 0] for t in rope(positions, torch.float32))  # [P, D] each
    assert _max_diff(ours_cos[:, :half], cos) <= 1e-6
    assert torch.equal(ours_cos[:, half:], ours_cos[:, :half])  # cos | cos
    assert _max_diff(ours_sin[:, half:], sin) <= 1e-6
    assert torch.equal(ours_sin[:, :half], -ours_sin[:, half:])  # -sin | sin
    if name.startswith("yarn"):
        assert rope.max_position == 64  # covers original * factor


def test_rope_old_style_config_and_unknown_type() -> None:
    # transformers 4.x style: rope_theta beside a rope_scaling dict keyed "type"
    old = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    rope = get_rope(old, 16)
    inv = 1.0 / (500.0 ** (torch.arange(0, 16, 2).float() / 16)) / 2.0
    cos, _ = rope(torch.tensor([5]), torch.float32)
    assert _max_diff(cos[0, 0, :8], torch.cos(5 * inv)) <= 1e-6
    bad = LlamaConfig(**_common(rope_parameters={"rope_type": "mystery", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="mystery") as err:
        get_rope(bad, 16)
    assert all(t in str(err.value) for t in SUPPORTED_ROPE_TYPES)


# --------------------------------------------------------------------------- GGUF


def test_gguf_names_and_unpermute() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.2.ffn_gate.weight") == "model.layers.2.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_rows(_llama_cpp_permute(w, 3), 3), w)
    b = np.arange(24, dtype=np.float32)
    assert np.array_equal(unpermute_rows(_llama_cpp_permute(b, 3), 3), b)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written out."""
    split = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return split.swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_rope_freqs(params: dict, dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 rope scaling."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(hf: torch.nn.Module, arch: str, path: str) -> None:
    """Convert a tiny HF model to an unquantised GGUF the way llama.cpp does."""
    import gguf

    cfg = hf.config
    to_gguf = {v: k for k, v in BLOCK_NAMES.items()}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_key_length(head_dim_of(cfg))
    writer.add_value_length(head_dim_of(cfg))
    if cfg.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(cfg.rope_parameters, 16))
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if m:
            gguf_name = f"blk.{m[1]}.{to_gguf[m[2]]}.{m[3]}"
        else:
            stem, kind = name.rsplit(".", 1)
            gguf_name = f"{ {v: k for k, v in GLOBAL_NAMES.items()}[stem]}.{kind}"
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "case,arch",
    [("llama-llama3-rope", "llama"), ("llama-tied-bias", "llama"), ("qwen3", "qwen3")],
)
def test_gguf_conversion_roundtrip_matches_transformers(
    case: str, arch: str, checkpoint, tmp_path: str
) -> None:
    """Q/K un-permutation (weights and biases, GQA), names, ties, qwen3's key_length, and
    llama3 scaling carried by ``rope_freqs``: a GGUF we convert must give HF's logits."""
    _, hf = checkpoint(case)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(hf, arch, path)
    model, config = load_model(path, SingleRank(), "cpu", torch.float32)
    assert type(model).__name__ == type(hf).__name__
    assert model.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.head_dim == head_dim_of(hf.config)
    diff = _max_diff(Sequences(model).step({0: PROMPT})[0], _hf_logits(hf, PROMPT))
    print(f"GGUF round trip {case}: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


#: Class constants of transformers' config classes that a cached config does not carry:
#: tensor- and pipeline-parallel plans, Gemma 3's rope defaults (already applied to its
#: ``rope_parameters``), and two values the base class reads another way.
CONFIG_CLASS_CONSTANTS = {"base_model_tp_plan", "base_model_pp_plan", "default_theta",
                          "per_layer_config", "transformers_version", "use_cache"}


@pytest.mark.parametrize("case,arch", [("llama-tied-bias", "llama"), ("qwen3", "qwen3")])
def test_gguf_cached_config_has_every_value_of_the_family_class(
    case: str, arch: str, checkpoint, tmp_path
) -> None:
    """The config a GGUF start reads (transformers' base class, never the family's, whose
    import costs a second) answers every attribute the family class does, alike."""
    from quire.models.gguf_file import load_gguf_config
    from quire.models.gguf_hf_cache import cached_config, hf_dir_for_gguf

    _, hf = checkpoint(case)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(hf, arch, path)
    family = load_gguf_config(path)
    cached = cached_config(hf_dir_for_gguf(path, root=tmp_path / "cache"))
    assert type(cached).__name__ != type(family).__name__
    compared = 0
    for name in dir(family):
        if name.startswith("_") or name in CONFIG_CLASS_CONSTANTS:
            continue
        value = getattr(family, name)
        if callable(value):
            continue
        assert getattr(cached, name) == value, name
        compared += 1
    assert compared > 40 and cached.model_type == arch


def test_a_cached_config_keeps_the_family_aliases_and_pickles(tmp_path) -> None:
    """MoE families name ``num_experts`` through ``attribute_map``; the cached config keeps
    the alias, per instance, so it still pickles by its class (to worker processes)."""
    import json
    import pickle

    from transformers import Qwen3MoeConfig

    from quire.models.gguf_hf_cache import FULL_CONFIG, cached_config

    family = Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2)
    (tmp_path / FULL_CONFIG).write_text(json.dumps(
        {"values": family.to_dict(), "attribute_map": type(family).attribute_map}))
    cached = cached_config(tmp_path)
    assert cached.num_experts == family.num_experts == 8
    again = pickle.loads(pickle.dumps(cached))
    assert again.num_experts == 8 and again.num_experts_per_tok == 2


def test_a_gguf_start_imports_no_family_config_class(checkpoint, tmp_path) -> None:
    """A worker loading a GGUF model from the conversion cache leaves the family's config
    module (and what transformers 5 imports with it) unimported."""
    import subprocess
    import sys

    from quire.models.gguf_hf_cache import hf_dir_for_gguf

    _, hf = checkpoint("llama-tied-bias")
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(hf, "llama", path)
    hf_dir_for_gguf(path)  # the first start converts, with the family class
    script = (
        "import sys, torch\n"
        "from quire.config import EngineConfig\n"
        "from quire.executor.worker import Worker\n"
        f"Worker(EngineConfig.from_kwargs({path!r}, device='cpu', max_model_len=64))\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.slow
def test_gguf_smollm2_matches_transformers(smollm2_gguf) -> None:
    path = str(smollm2_gguf)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    hf.eval()
    state = hf.state_dict()
    seen, worst = set(), 0.0
    for name, tensor in iter_weights(path):
        assert name in state, name
        assert tensor.shape == state[name].shape, name
        worst = max(worst, _max_diff(tensor, state[name]))
        seen.add(name)
    assert set(state) - seen == {"lm_head.weight"}  # tied to the embedding
    print(f"GGUF weights: {len(seen)} tensors, max |diff| = {worst:.3g}")
    assert worst <= 1e-6

    model, config = load_model(path, SingleRank(), "cpu", torch.float32)
    assert isinstance(model, LlamaForCausalLM) and model.tie_word_embeddings
    prompt = [1, 9690, 314, 253, 1345, 28, 2]  # ids only; any in-vocabulary ids do
    ours = Sequences(model, max_len=16).step({0: prompt})[0]
    diff = _max_diff(ours, _hf_logits(hf, prompt))
    print(f"GGUF logits: max |diff| = {diff:.3g}")
    assert diff <= 1e-3


@pytest.mark.slow
def test_gguf_config_and_tokenizer_cache_round_trips(tmp_path, smollm2_gguf):
    """The cached HF directory gives the same config and tokenizer as a fresh conversion,
    and a changed file (new mtime) gets a new entry."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from quire.models.gguf_file import load_gguf_config
    from quire.models.gguf_hf_cache import cached_config, cached_tokenizer, hf_dir_for_gguf

    source = tmp_path / smollm2_gguf.name
    shutil.copy(smollm2_gguf, source)
    first = hf_dir_for_gguf(str(source), root=tmp_path / "cache")
    assert hf_dir_for_gguf(str(source), root=tmp_path / "cache") == first
    fresh = load_gguf_config(str(source)).to_dict()
    cached = AutoConfig.from_pretrained(first).to_dict()
    fresh.pop("_name_or_path", None), cached.pop("_name_or_path", None)
    assert cached == fresh
    direct = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    text = "The capital of France is Paris. 안녕하세요 🎉 <|im_start|>user"
    cached_tok = AutoTokenizer.from_pretrained(first)
    assert cached_tok.encode(text) == direct.encode(text)
    assert cached_tok.chat_template == direct.chat_template
    # what a start loads: the saved class, without AutoTokenizer's tables, its BPE
    # pipeline rebuilt from the tables the conversion saved (no tokenizer.json parse)
    from quire.models.gguf_bpe_tables import TABLES
    from quire.models.gguf_hf_cache import LOADING

    assert (first / TABLES).is_file() and (first / LOADING).is_file()
    started = cached_tokenizer(first)
    assert type(started) is type(direct) and started.encode(text) == direct.encode(text)
    assert started.chat_template == direct.chat_template
    assert started.all_special_ids == direct.all_special_ids
    assert started.added_tokens_decoder == direct.added_tokens_decoder
    started_config = cached_config(first)
    for key, value in load_gguf_config(str(source)).to_dict().items():
        if key not in CONFIG_CLASS_CONSTANTS | {"_name_or_path"}:
            assert getattr(started_config, key) == value, key
    os.utime(source, ns=(1, 1))
    assert hf_dir_for_gguf(str(source), root=tmp_path / "cache") != first
