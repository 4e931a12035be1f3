"""Decode steps replayed from captured graphs give what eager steps give.

No GPU here, so the graphs are a fake with a graph's semantics: ``replay`` re-runs the
captured forward on the same fixed input tensors and writes into the tensor the capture
returned. The model runs the cuda platform's Triton backend and ops in Triton's
interpreter, so the padding slots, the fixed-buffer metadata and the decode split frozen
at capture (sized for ``max_model_len``, more shares than eager steps use) are the real
ones. What the fake cannot show (a sync inside the forward, the memory pool) needs the
GPU check in ``scripts/device_cuda_check.sh``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.distributed import TorchDistributedCommunicator
from quire.engine.llm_engine import LLMEngine
from quire.executor.messages import StepItem
from quire.executor.model_runner import ModelRunner, StepLimits
from quire.interfaces.communicator import Communicator
from quire.interfaces.platform import Availability, GraphCapture, Platform
from quire.kernels import TritonAttentionBackend, TritonAttentionConfig
from quire.models.loader import load_model
from quire.ops import OpSet, reference_ops
from quire.platforms.cpu.memory import CpuMemoryProfiler

pytest.importorskip("triton")

#: Decode split by the longest sequence: 16-key tiles, one tile per share at least, so a
#: capture at max_model_len uses more shares than the eager steps of short sequences.
ATTENTION = TritonAttentionConfig(decode_tile_n=16, decode_min_tiles_per_split=1)


class ReplayingCapture(GraphCapture):
    """A graph's semantics on the CPU: replay re-runs the captured work, reading the
    inputs' current contents, into the tensor the capture returned."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        out = fn()
        self.sizes.append(out.shape[0])

        def replay() -> torch.Tensor:
            out.copy_(fn())
            return out

        return replay


def triton_op_set() -> OpSet:
    from quire.kernels.triton_ops import triton_ops

    return reference_ops().with_ops("triton", **triton_ops())


class FakeGraphPlatform(Platform):
    """cuda's backend and ops on CPU tensors, with the fake graphs."""

    name = "fakegraph"
    device_type = "cpu"
    distributed_backend = "gloo"
    supported_dtypes = (torch.float32,)
    default_block_size = 4

    def __init__(self) -> None:
        self.captures: list[ReplayingCapture] = []

    def availability(self) -> Availability:
        return Availability.yes()

    def make_ops(self) -> OpSet:
        return triton_op_set()

    def make_attention_backend(self) -> TritonAttentionBackend:
        return TritonAttentionBackend(ATTENTION)

    def make_communicator(self, rank: int = 0, world_size: int = 1,
                          group: object | None = None) -> Communicator:
        return TorchDistributedCommunicator("gloo", rank, world_size, group)

    def make_memory_profiler(self, device_index: int = 0) -> CpuMemoryProfiler:
        return CpuMemoryProfiler()

    def graph_capture(self, device_index: int = 0) -> GraphCapture:
        self.captures.append(ReplayingCapture())
        return self.captures[-1]


class OnePlatform:
    """The registry's two calls the engine makes, answered with one platform."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def resolve(self, name: str) -> Platform:
        return self.platform

    def model_specs(self) -> list:
        return []


# -- the runner, step by step ----------------------------------------------------------------
SENTINEL = 7.0
PAGES = 18  # page 0 and the last page are never given to a sequence: padding must not write


def _items(step: list[tuple[int, list[int], int]]) -> list[StepItem]:
    """(seq, new tokens, start) -> items; sequence ``s`` owns pages 1+4s .. 4+4s."""
    return [StepItem(s, tokens, start, list(range(1 + 4 * s, 5 + 4 * s)), True)
            for s, tokens, start in step]


STEPS: list[tuple[list[tuple[int, list[int], int]], tuple[int, ...]]] = [
    # (step, sequences released before it)
    ([(0, [5, 17, 42, 9, 77], 0), (1, [3, 101, 64], 0), (2, [8, 6, 5, 4, 3, 2], 0)], ()),
    ([(0, [11], 5), (1, [12], 3), (2, [13], 6)], ()),  # 3 -> padded to 4
    ([(0, [21], 6), (1, [22], 4), (2, [23], 7)], ()),
    ([(0, [31], 7), (2, [33], 8)], (1,)),  # 2 after a release
    ([(3, [9, 9, 1, 2], 0), (0, [41], 8), (2, [43], 9)], ()),  # a prefill among decodes
    ([(0, [51], 9), (2, [53], 10), (3, [54], 4)], ()),  # 3 -> 4
    ([(0, [61], 10)], (2, 3)),  # 1
]
REPLAYED = [False, True, True, True, False, True, True]


def _runner(model, with_graphs: bool) -> tuple[ModelRunner, ReplayingCapture | None]:
    backend = TritonAttentionBackend(ATTENTION)
    caches = [backend.allocate_kv_cache(PAGES, 4, model.num_kv_heads, model.head_dim,
                                        torch.float32, torch.device("cpu")).fill_(SENTINEL)
              for _ in range(model.num_layers)]
    runner = ModelRunner(model, backend, caches, 4, torch.device("cpu"), ops=triton_op_set(),
                         limits=StepLimits(max_num_seqs=4, max_num_tokens=32, max_pages=8))
    capture = None
    if with_graphs:
        capture = ReplayingCapture()
        runner.capture_graphs(capture, (1, 2, 4), max_seq_len=32)
    return runner, capture


def test_replayed_decode_steps_match_eager_ones_and_others_run_eagerly(tiny_checkpoint):
    model, _ = load_model(str(tiny_checkpoint("llama")), _single_rank(), "cpu",
                          torch.float32)
    eager, _ = _runner(model, with_graphs=False)
    before = [c.clone() for c in eager.kv_caches]
    graphed, capture = _runner(model, with_graphs=True)
    assert capture is not None and capture.sizes == [4, 2, 1]  # the largest first
    assert all(torch.equal(a, b) for a, b in zip(before, graphed.kv_caches)), \
        "capturing changed the pages"
    assert graphed.graphs is not None
    for (step, released), replayed in zip(STEPS, REPLAYED):
        replays = graphed.graphs.replays
        want = eager.execute(_items(step), released)
        got = graphed.execute(_items(step), released)
        assert graphed.graphs.replays - replays == int(replayed)
        assert got.sample_items == want.sample_items
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    assert graphed.graphs.eager_steps == REPLAYED.count(False)
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches):
        # the same slots written, and the pages no sequence holds never touched
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        assert bool((mine[:, 0] == SENTINEL).all()) and bool((mine[:, -1] == SENTINEL).all())


def _single_rank() -> Communicator:
    return TorchDistributedCommunicator("gloo", 0, 1)


# -- the engine, over a workload ---------------------------------------------------------------
PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8], [12, 7, 7], [99, 98, 97, 96, 95, 94],
           [1, 2], [33, 44, 55, 66, 77, 88, 99, 11, 22, 33, 44], [4]]
MAX_TOKENS = [12, 3, 9, 14, 6, 10]  # sequences finish at different steps


def _llm(path: str, enforce_eager: bool, **options) -> LLM:
    config = EngineConfig.from_kwargs(path, device="fakegraph", dtype="float32",
                                      max_model_len=48, max_num_seqs=6,
                                      enforce_eager=enforce_eager, **options)
    return LLM.from_engine(LLMEngine(config, OnePlatform(FakeGraphPlatform())))


def _generate(path: str, enforce_eager: bool, **options) -> tuple[list[list[int]], LLM]:
    llm = _llm(path, enforce_eager, **options)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs], llm


def _page_bytes(path: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    head = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * head * 4


@pytest.mark.slow  # about 40 s each: every step's kernels in Triton's interpreter
@pytest.mark.parametrize("scenario", ["preemption", "chunked-prefill"])
def test_greedy_outputs_with_graphs_equal_eager_ones(scenario, tiny_checkpoint, caplog):
    path = str(tiny_checkpoint("llama"))
    options = ({"kv_cache_memory": 12 * _page_bytes(path)} if scenario == "preemption"
               else {"max_num_batched_tokens": 8})
    eager, eager_llm = _generate(path, True, **options)
    with caplog.at_level(logging.INFO, logger="quire.executor.worker"):
        graphed, llm = _generate(path, False, **options)
    assert "captured decode graphs for 4 batch sizes (1..6)" in caplog.text
    assert graphed == eager
    assert [len(t) for t in graphed] == MAX_TOKENS
    assert eager_llm.engine.core.executor.worker.runner.graphs is None
    graphs = llm.engine.core.executor.worker.runner.graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4, 6)
    assert graphs.replays > 0 and graphs.eager_steps > 0
    if scenario == "preemption":
        assert llm.engine.core.scheduler.stats.num_preemptions > 0


@pytest.mark.slow  # about 40 s
def test_seeded_samples_and_prefix_hits_with_graphs_equal_eager_ones(tiny_checkpoint):
    """n=2 seeded samples (the forks share their prompt's pages), twice: the second pass
    finds the prompts in the prefix cache. Sampling runs outside the graphs, on logits
    the replay computed."""
    path = str(tiny_checkpoint("llama"))
    prompts = [PROMPTS[0], PROMPTS[0] + [6, 6], PROMPTS[2]]
    params = [SamplingParams(n=2, temperature=0.8, seed=7 + i, max_tokens=8,
                             ignore_eos=True) for i in range(len(prompts))]

    def run(enforce_eager: bool) -> tuple[list[list[list[int]]], int, LLM]:
        llm = _llm(path, enforce_eager)
        passes = [llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                  for _ in range(2)]
        tokens = [[c.token_ids for o in outs for c in o.outputs] for outs in passes]
        return tokens, sum(o.num_cached_tokens for o in passes[1]), llm

    eager, _, _ = run(True)
    graphed, cached, llm = run(False)
    assert graphed == eager
    assert cached > 0
    graphs = llm.engine.core.executor.worker.runner.graphs
    assert graphs is not None and graphs.replays > 0
