"""Per-request timings the engine puts on ``RequestOutput.metrics`` (tiny model, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.outputs import RequestMetrics, request_metrics

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    # one sequence at a time: a second request must wait for the first to finish
    return LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=64,
                                              max_num_seqs=1))


def run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the requests did not finish within 100 steps")


def test_timings_are_ordered_and_a_queued_request_waits(engine):
    engine.add_request([1, 2, 3, 4], PARAMS, request_id="first")
    engine.add_request([5, 6, 7], PARAMS, request_id="second")
    outs = run(engine)
    for rid in ("first", "second"):
        steps = outs[rid]
        assert len(steps) == 4 and steps[-1].finished
        m = steps[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time \
            <= m.last_token_time <= m.finished_time
        assert m.time_to_first_token == m.first_token_time - m.arrival_time
        assert m.e2e_latency == m.finished_time - m.arrival_time
        # each output's last token time is its own step's, and they never go back
        token_times = [o.metrics.last_token_time for o in steps]
        assert token_times == sorted(token_times) and len(set(token_times)) == 4
        assert {o.metrics.first_token_time for o in steps} == {m.first_token_time}
        assert all(o.metrics.finished_time is None for o in steps[:-1])
    first, second = outs["first"][-1].metrics, outs["second"][-1].metrics
    # max_num_seqs=1: the second is scheduled only after the first finished
    assert second.first_scheduled_time >= first.finished_time
    assert second.queue_time > 0
    assert second.queue_time > first.queue_time


def test_abort_while_waiting_has_no_schedule_or_token_times(engine):
    engine.add_request([1, 2, 3], PARAMS, request_id="running")
    engine.add_request([4, 5, 6], PARAMS, request_id="queued")
    engine.step()  # admits "running" only
    out = engine.abort_request("queued")
    m = out.metrics
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert m.first_scheduled_time is None and m.first_token_time is None
    assert m.queue_time is None and m.time_to_first_token is None
    assert m.finished_time >= m.arrival_time
    out = engine.abort_request("running")
    assert out.metrics.first_token_time is not None
    assert out.metrics.finished_time >= out.metrics.last_token_time
    assert not engine.has_unfinished_requests()


def test_metrics_do_not_change_output_equality(engine):
    engine.add_request([1, 2, 3], PARAMS, request_id="a")
    [a] = run(engine)["a"][-1:]
    engine.add_request([1, 2, 3], PARAMS, request_id="a")
    [b] = run(engine)["a"][-1:]
    assert a.metrics != b.metrics
    assert a == b


def test_the_offline_api_reports_them_too(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", max_model_len=64)
    [out] = llm.generate([1, 2, 3], PARAMS)
    m = out.metrics
    assert m is not None and m.finished_time is not None and m.time_to_first_token > 0


def test_the_fronts_fast_builder_makes_what_the_constructor_makes():
    for values in [(1.0, None, None, None, None), (1.0, 2.0, 3.5, 4.0, 5.0),
                   (0.5, 0.75, None, None, 2.0)]:
        fast, slow = request_metrics(*values), RequestMetrics(*values)
        assert type(fast) is RequestMetrics
        assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
        # every field, in order, and nothing else: a field added later must be built too
        assert list(vars(fast)) == [f.name for f in dataclasses.fields(RequestMetrics)]
        assert fast.e2e_latency == slow.e2e_latency
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.arrival_time = 0.0
