"""Async scheduling changes no output: the same tokens, finish and stop reasons, logprobs
and text as synchronous steps, through chunked prefill, preemption, prefix hits, n > 1,
stop strings, stop token ids, EOS, max_tokens, min_tokens, penalties, a grammar and
aborts, on the cpu platform (where the forward runs inside ``submit``, so this checks
the ordering and the bookkeeping, not an overlap) and once with worker processes."""

from __future__ import annotations

import pytest
from eos_variant import eos_variant
from quire import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8], [5, 17, 42, 9, 77, 3, 101, 64, 8, 6, 6],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)), [12, 7, 7], [1, 2, 3, 4, 5]]
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){0,3}\."


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny llama whose EOS is a token greedy decoding reaches, and a stop
    string and a stop token id that the greedy outputs hold."""
    return eos_variant(tiny_checkpoint("llama"), PROMPTS, tmp_path_factory.mktemp("async"),
                       eos_at=4)


def _params(stop: str, stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),  # EOS on
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=9, ignore_eos=True,
                       logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=[stop]),
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=3, max_tokens=10, min_tokens=5,
                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.7, seed=11, max_tokens=30,
                       structured_outputs={"regex": REGEX}),
    ]


def _generate(path: str, async_on: bool, params: list[SamplingParams], passes: int = 1,
              **options) -> tuple[list, object]:
    """Every pass's outputs (per sample: tokens, finish and stop reasons, logprobs,
    text) and the engine's stats; checks that nothing leaked."""
    with LLM(path, device="cpu", block_size=4, async_scheduling=async_on, **options) as llm:
        core = llm.engine.core
        assert core._async is async_on
        runs = []
        for _ in range(passes):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            runs.append([[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
                           [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                            for d in c.logprobs or []])
                          for c in o.outputs] for o in outs])
        assert not core.has_unfinished_requests() and not core._in_flight
        assert core.block_manager.num_used_blocks == 0
        assert core.sampler.num_seq_generators() == 0
        return runs, core.stats()


def _page_bytes(path: str) -> int:
    with LLM(path, device="cpu", block_size=4) as probe:
        return probe.engine.core.executor.bytes_per_block()


@pytest.mark.parametrize("scenario", ["chunked-prefill", "preemption", "prefix-hits"])
def test_async_outputs_equal_synchronous_ones(scenario, setup):
    path, eos, stop, stop_id = setup
    options: dict = {}
    passes = 1
    if scenario == "chunked-prefill":
        options = {"max_num_batched_tokens": 8}
    elif scenario == "preemption":
        options = {"kv_cache_memory": 14 * _page_bytes(path)}
    else:
        passes = 2  # the second pass finds every prompt's full pages cached
    params = _params(stop, stop_id)
    sync, sync_stats = _generate(path, False, params, passes, **options)
    async_, async_stats = _generate(path, True, params, passes, **options)
    assert async_ == sync
    # the rules this workload is meant to exercise did fire
    samples = [s for run in sync for out in run for s in out]
    assert any(s[1] == "stop" and s[2] is None and s[0][-1] == eos for s in samples), "no EOS"
    assert any(s[2] == stop_id for s in samples), "no stop token id"
    assert any(s[2] == stop for s in samples), "no stop string"
    assert any(s[1] == "length" for s in samples)
    assert all(len(s[0]) >= 5 for s in sync[0][4])  # min_tokens
    if scenario == "preemption":
        assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    if scenario == "prefix-hits":
        assert async_stats.prefix_hits > 0 and sync_stats.prefix_hits > 0


def _abort_run(path: str, async_on: bool) -> dict[str, list[int]]:
    """Requests added, some aborted after a few steps (one of them mid-prompt, one with
    forked samples), the rest run to the end."""
    with LLM(path, device="cpu", block_size=4, async_scheduling=async_on,
             max_num_batched_tokens=12) as llm:
        engine, core = llm.engine, llm.engine.core
        ids = [engine.add_request(p, SamplingParams(
            n=2 if i == 1 else 1, temperature=0.9, seed=i, max_tokens=12, ignore_eos=True),
            request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        done: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [t for c in out.outputs for t in c.token_ids]
            steps += 1
            if steps == 3:
                for rid in (ids[1], ids[3], ids[5]):
                    engine.abort_request(rid)
                assert core._in_flight or not async_on  # aborted with a step in flight
        assert core.block_manager.num_used_blocks == 0
        assert core.sampler.num_seq_generators() == 0
        assert not core.scheduler.has_unfinished() and not core._in_flight
        return done


def test_aborts_mid_run_leak_nothing_and_leave_the_others_alone(setup):
    path = setup[0]
    sync, async_ = _abort_run(path, False), _abort_run(path, True)
    assert async_ == sync
    assert set(sync) == {"r0", "r2", "r4"}


@pytest.mark.slow  # about 25 s: two worker processes per engine
def test_async_outputs_with_worker_processes_equal_synchronous_ones(setup):
    """The ``mp`` executor resolves pending tokens on the host before the plan crosses."""
    path, _, stop, stop_id = setup
    params = _params(stop, stop_id)
    sync, _ = _generate(path, False, params, tensor_parallel_size=2, max_model_len=128)
    async_, _ = _generate(path, True, params, tensor_parallel_size=2, max_model_len=128)
    assert async_ == sync


def test_a_replayed_decode_step_takes_pending_tokens_from_the_device(tiny_checkpoint):
    """A graph reads fixed buffers: the pending tokens, written into the input batch on
    the device, must reach them, each from its own row."""
    import torch
    from quire.executor.messages import PENDING_TOKEN
    from quire.models.loader import load_model
    from test_decode_graphs import STEPS, _items, _runner, _single_rank

    model, _ = load_model(str(tiny_checkpoint("llama")), _single_rank(), "cpu",
                          torch.float32)
    eager, _ = _runner(model, with_graphs=False)
    graphed, _ = _runner(model, with_graphs=True)
    assert graphed.graphs is not None
    prefill, decode = STEPS[0][0], STEPS[1][0]  # three prompts, then one token each
    eager.execute(_items(prefill))
    graphed.execute(_items(prefill))
    want = eager.execute(_items(decode))
    # the decode tokens as the previous step's sampled ids, in another order than items
    sampled = torch.tensor([tokens[0] for _, tokens, _ in reversed(decode)])
    items = [item.__class__(item.seq_id, [PENDING_TOKEN], item.start, item.block_table,
                            True, prev_row=len(decode) - 1 - i)
             for i, item in enumerate(_items(decode))]
    replays = graphed.graphs.replays
    got = graphed.execute(items, sampled=sampled)
    assert graphed.graphs.replays == replays + 1
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


@pytest.mark.slow  # about 45 s: every step's kernels in Triton's interpreter, twice
def test_async_outputs_with_graphs_equal_synchronous_ones(tiny_checkpoint):
    """The engine with (fake) graphs replaying its decode steps, under preemption."""
    from test_decode_graphs import _generate as generate_with_graphs
    from test_decode_graphs import _page_bytes

    path = str(tiny_checkpoint("llama"))
    options = {"kv_cache_memory": 12 * _page_bytes(path)}
    sync, _ = generate_with_graphs(path, False, **options)
    async_, llm = generate_with_graphs(path, False, async_scheduling=True, **options)
    assert async_ == sync
    graphs = llm.engine.core.executor.worker.runner.graphs
    assert graphs is not None and graphs.replays > 0
    assert llm.engine.core.scheduler.stats.num_preemptions > 0


def test_the_host_overhead_bench_measures_async_steps(tiny_checkpoint):
    """``quire bench host --async-scheduling true``: every part timed, nothing left."""
    from quire.bench.host_overhead import measure
    from quire.config import EngineConfig
    from quire.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                async_scheduling=True))
    try:
        figures = measure(engine, batch=4, steps=3).figures()
        assert all(figures[f"{part}_ms"] > 0 for part in ("schedule", "inputs", "sample"))
        assert not engine.has_unfinished_requests()
        assert engine.core.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()
