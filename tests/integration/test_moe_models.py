"""Qwen3-MoE and Mixtral against transformers float32, and the MoE layer's loading.

Logits of one flattened prefill (and of decodes after it) must match HF's eager model
within 1e-4, also under tensor parallelism (ranks as threads with real sums). Through
``tiny_models.ARCHS`` both also run ``test_hf_parity.py``'s greedy equality under every
engine scenario and ``tests/distributed/test_tensor_parallel.py``'s TP=2 and PP=2 over
gloo worker processes (slow).
Routing in these checkpoints really differs per token: every token picks 2 of 4 or 8
experts from its own router logits.
"""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
from quire.interfaces.attention import AttentionBatch
from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.layers.fused_moe import FusedMoE
from quire.models.loader import iter_weights, load_model
from quire.models.moe import DenseMLP, MixtralForCausalLM, Qwen3MoeForCausalLM
from quire.models.registry import resolve_architecture
from quire.ops import reference_ops
from quire.ops.attention import ReferenceAttentionBackend
from tiny_models import SingleRank, hf_model, tiny_config

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 200, 5, 33, 301, 12, 90]
TOL = 1e-4
MOE_ARCHS = ("qwen3_moe", "mixtral")



class ThreadRank(Communicator):
    """A rank of a group whose ranks are threads: real sums and gathers in one process."""

    def __init__(self, shared: dict, rank: int, world_size: int) -> None:
        self.shared, self._rank, self._world = shared, rank, world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self._rank] = tensor
        self.shared["barrier"].wait()
        everyone = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return everyone

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor)).sum(0)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._exchange(tensor)[src].clone()

    def barrier(self) -> None:
        self.shared["barrier"].wait()


def run_steps(model: torch.nn.Module, steps: list[list[int]], ops=None) -> torch.Tensor:
    """One sequence fed ``steps`` chunk after chunk through paged KV; float32 logits of
    every token, concatenated."""
    backend, block = ReferenceAttentionBackend(), 4
    caches = [backend.allocate_kv_cache(16, block, model.num_kv_heads, model.head_dim,
                                        torch.float32, torch.device("cpu"))
              for _ in range(model.num_layers)]
    table = torch.arange(16, dtype=torch.int32).flip(0)[None]  # pages out of order
    done, out = 0, []
    for chunk in steps:
        n, end = len(chunk), done + len(chunk)
        pos = torch.arange(done, end)
        batch = AttentionBatch(
            slot_mapping=(table[0, pos // block].long() * block + pos % block),
            query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([end]),
            block_tables=table, block_size=block, max_query_len=n, max_seq_len=end,
            query_lens=(n,))
        ctx = ForwardContext(backend, backend.build_metadata(batch), caches,
                             **({"ops": ops} if ops is not None else {}))
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(chunk), pos, ctx)))
        done = end
    return torch.cat(out)


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    model, config = load_model(str(path), SingleRank(), "cpu", torch.float32)
    assert type(model).__name__ == config.architectures[0]
    expected = hf_logits(path, PROMPT)
    torch.testing.assert_close(run_steps(model, [PROMPT]), expected, rtol=TOL, atol=TOL)
    chunks = [PROMPT[:6], PROMPT[6:11]] + [[t] for t in PROMPT[11:]]
    torch.testing.assert_close(run_steps(model, chunks), expected, rtol=TOL, atol=TOL)


def test_layers_follow_sparse_step_and_mlp_only_layers():
    config = tiny_config("qwen3_moe")
    config.num_hidden_layers, config.decoder_sparse_step = 6, 2
    config.mlp_only_layers = [3]
    model = Qwen3MoeForCausalLM(config, SingleRank())
    kinds = [type(layer.mlp) for layer in model.model.layers]
    # sparse where (i + 1) % 2 == 0 and i not in mlp_only_layers
    assert kinds == [DenseMLP, FusedMoE, DenseMLP, DenseMLP, DenseMLP, FusedMoE]
    moe = model.model.layers[1].mlp
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (8, 2, True)
    assert tuple(moe.w13.shape) == (8, 2 * 32, 64) and tuple(moe.w2.shape) == (8, 64, 32)
    mixtral = MixtralForCausalLM(tiny_config("mixtral"), SingleRank())
    assert all(isinstance(layer.mlp, FusedMoE) and layer.mlp.renormalize
               for layer in mixtral.model.layers)
    assert mixtral.variant.sliding_windows == (12, 12)


def test_registry_resolves_both_by_architecture_and_model_type():
    for arch, cls in (("qwen3_moe", Qwen3MoeForCausalLM), ("mixtral", MixtralForCausalLM)):
        config = tiny_config(arch)
        assert config.architectures is None
        assert resolve_architecture(config) is cls
        config.architectures = [cls.__name__]
        assert resolve_architecture(config) is cls


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_transformers_stacked_experts_load_as_the_per_expert_tensors(arch, tiny_checkpoint):
    """transformers holds every expert in one tensor (``experts.gate_up_proj``); loading
    its in-memory state gives the parameters the checkpoint's per-expert tensors give."""
    path = tiny_checkpoint(arch)
    from_disk, _ = load_model(str(path), SingleRank(), "cpu", torch.float32)
    stacked_state = hf_model(path).state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in stacked_state)
    model = type(from_disk)(from_disk.config, SingleRank())
    loaded = model.load_weights(stacked_state.items())
    assert loaded == {n for n, _ in model.named_parameters()}
    for (name, ours), (_, theirs) in zip(model.named_parameters(),
                                         from_disk.named_parameters()):
        assert torch.equal(ours, theirs), name


def _run_ranks(path, world_size: int) -> list[torch.Tensor]:
    shared = {"slots": [None] * world_size, "barrier": threading.Barrier(world_size, timeout=120)}
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            comm = ThreadRank(shared, rank, world_size)
            model, _ = load_model(str(path), comm, "cpu", torch.float32)
            results[rank] = run_steps(model, [PROMPT[:9], PROMPT[9:]])
        except BaseException as e:  # surfaced below; a dead rank breaks the barrier
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[r] for r in range(world_size)]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tensor_parallel_shards_experts_and_matches_transformers(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    expected = hf_logits(path, PROMPT)
    for logits in _run_ranks(path, 2):
        torch.testing.assert_close(logits, expected, rtol=TOL, atol=TOL)


def test_the_layer_runs_the_platforms_ops(tiny_checkpoint):
    """FusedMoE routes and runs experts through ``ctx.ops``, never the reference directly."""
    model, _ = load_model(str(tiny_checkpoint("mixtral")), SingleRank(), "cpu", torch.float32)
    calls = []
    ref = reference_ops()

    def counted(name):
        def op(*args, **kwargs):
            calls.append(name)
            return getattr(ref, name)(*args, **kwargs)
        return op

    ops = ref.with_ops("counting", select_experts=counted("select_experts"),
                       fused_moe=counted("fused_moe"))
    run_steps(model, [PROMPT[:5]], ops=ops)
    assert calls == ["select_experts", "fused_moe"] * 2  # two sparse layers


def test_missing_expert_and_bad_shapes_are_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import save_file

    path = tiny_checkpoint("mixtral")
    tensors = dict(iter_weights(str(path)))
    config_json = (path / "config.json").read_text()

    def write(state: dict) -> str:
        d = tmp_path / f"ckpt{len(os.listdir(tmp_path))}"
        d.mkdir()
        (d / "config.json").write_text(config_json)
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
        return str(d)

    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.w13"):
        load_model(write({k: v for k, v in tensors.items() if k != gone}), SingleRank(),
                   "cpu", torch.float32)
    bad = {**tensors, "model.layers.0.block_sparse_moe.experts.2.w2.weight": torch.zeros(64, 3)}
    with pytest.raises(ValueError, match=r"experts\.2\.w2.*expert 2 down: expected shape"):
        load_model(write(bad), SingleRank(), "cpu", torch.float32)
    extra = {**tensors, "model.layers.0.block_sparse_moe.experts.9.w1.weight": torch.zeros(96, 64)}
    with pytest.raises(ValueError, match=r"experts\.9\.w1.*expert below 4"):
        load_model(write(extra), SingleRank(), "cpu", torch.float32)


def test_bad_configs_are_refused_by_name():
    config = tiny_config("qwen3_moe")
    config.moe_intermediate_size = 33
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    with pytest.raises(ValueError, match="moe intermediate_size=33"):
        Qwen3MoeForCausalLM(config, ThreadRank(shared, 0, 2))
    config = copy.deepcopy(tiny_config("mixtral"))
    config.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        MixtralForCausalLM(config, SingleRank())
    config = tiny_config("mixtral")
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        MixtralForCausalLM(config, SingleRank())


def test_hf_saves_these_checkpoints_per_expert(tiny_checkpoint):
    """The names the loader must take are those transformers writes to disk."""
    names = {n for n, _ in iter_weights(str(tiny_checkpoint("qwen3_moe")))}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer
    names = {n for n, _ in iter_weights(str(tiny_checkpoint("mixtral")))}
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names


def test_bfloat16_loads_and_stays_near_float32(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    model, _ = load_model(str(path), SingleRank(), "cpu", torch.bfloat16)
    assert model.model.layers[1].mlp.w13.dtype == torch.bfloat16
    backend = ReferenceAttentionBackend()
    caches = [backend.allocate_kv_cache(4, 16, model.num_kv_heads, model.head_dim,
                                        torch.bfloat16, torch.device("cpu"))
              for _ in range(model.num_layers)]
    n = len(PROMPT)
    batch = AttentionBatch(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]), block_tables=torch.arange(4, dtype=torch.int32)[None],
        block_size=16, max_query_len=n, max_seq_len=n, query_lens=(n,))
    ctx = ForwardContext(backend, backend.build_metadata(batch), caches)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(n), ctx))
    assert logits.dtype == torch.float32
    diff = (logits - hf_logits(path, PROMPT)).abs().max()
    print(f"bfloat16 vs HF float32: max |logits diff| = {diff:.3g}")
    assert diff < 0.15  # bfloat16 rounding only
