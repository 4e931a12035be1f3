"""Scheduler on its own (no model): budget, chunked prefill, caps, preemption, FCFS."""

import random

import pytest
from quire.engine.block_manager import BlockManager
from quire.engine.scheduler import Scheduler, SchedulerOutput
from quire.engine.sequence import Sequence, SequenceStatus
from quire.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(n_prompt: int, max_tokens: int = 8, base: int = 0) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}",
                    prompt_token_ids=[(base + i * 7 + k) % 1000 for k in range(n_prompt)],
                    params=SamplingParams(max_tokens=max_tokens), arrival=i)


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True,
                   prefix=True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     enable_chunked_prefill=chunked)


def add(sched: Scheduler, seq: Sequence) -> Sequence:
    sched.add(seq, seq.num_tokens + seq.params.max_tokens - 1)
    return seq


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """What the engine does after a forward: mark computed, sample, finish at max_tokens."""
    sched.complete_step(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.output_token_ids.append(token)
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, "length")
    sched.block_manager.check_invariants(sched.live_sequences())


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {s.seq.request_id: s.num_tokens for s in out.scheduled}


def test_prompts_fill_the_token_budget_then_decode_one_token_each():
    sched = make_scheduler(budget=32)
    a, b = add(sched, make_seq(10)), add(sched, make_seq(12))
    out = sched.schedule()
    assert shares(out) == {a.request_id: 10, b.request_id: 12}
    finish_step(sched, out)
    out = sched.schedule()
    assert shares(out) == {a.request_id: 1, b.request_id: 1}


def test_chunked_prefill_splits_a_long_prompt_and_decodes_alongside():
    sched = make_scheduler(budget=16, num_blocks=64)
    short = add(sched, make_seq(4))
    long = add(sched, make_seq(40))
    out = sched.schedule()
    assert shares(out) == {short.request_id: 4, long.request_id: 12}
    assert [s.samples for s in out.scheduled] == [True, False]
    finish_step(sched, out)
    out = sched.schedule()  # decode token for short, next chunk for long
    assert shares(out) == {short.request_id: 1, long.request_id: 15}
    assert out.scheduled[1].start == 12
    finish_step(sched, out)
    out = sched.schedule()
    assert shares(out) == {short.request_id: 1, long.request_id: 13}
    assert out.scheduled[1].samples


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=16, chunked=False)
    a = add(sched, make_seq(10))
    b = add(sched, make_seq(10))
    out = sched.schedule()
    assert shares(out) == {a.request_id: 10}  # b does not fit in the 6 tokens left
    finish_step(sched, out)
    out = sched.schedule()
    assert shares(out) == {a.request_id: 1, b.request_id: 10}


def test_without_chunked_prefill_an_oversized_prompt_is_refused_at_once():
    sched = make_scheduler(budget=16, chunked=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        add(sched, make_seq(17))


def test_a_request_that_can_never_fit_the_pool_is_refused():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="4 pages"):
        add(sched, make_seq(10, max_tokens=8))  # 17 tokens of K/V: 5 pages


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_seqs=2)
    seqs = [add(sched, make_seq(3)) for _ in range(4)]
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_pages_running_out_preempt_the_newest_and_it_is_recomputed_first():
    # 6 pages of 2 tokens; three prompts of 3 tokens take 2 pages each
    sched = make_scheduler(num_blocks=6, block_size=2, budget=64, prefix=False)
    a, b, c = (add(sched, make_seq(3, max_tokens=6)) for _ in range(3))
    out = sched.schedule()
    assert shares(out) == {a.request_id: 3, b.request_id: 3, c.request_id: 3}
    finish_step(sched, out)
    # each now holds 4 tokens' worth of pages: the next token is free (page has room)
    out = sched.schedule()
    assert len(out.scheduled) == 3 and not out.preempted
    finish_step(sched, out)
    # 5th token of each needs a 3rd page: none left, so c (newest) is preempted
    out = sched.schedule()
    assert out.preempted == [c]
    assert shares(out) == {a.request_id: 1, b.request_id: 1}
    assert c.status is SequenceStatus.WAITING and c.block_table == []
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.waiting[0] is c
    assert sched.stats.num_preemptions == 1
    finish_step(sched, out)


def test_preemption_takes_the_sequence_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=2, budget=64, prefix=False)
    a = add(sched, make_seq(3, max_tokens=3))  # 2 pages, room for one more token
    b = add(sched, make_seq(2, max_tokens=2))  # 1 full page
    out = sched.schedule()
    assert shares(out) == {a.request_id: 3, b.request_id: 2}
    finish_step(sched, out)
    # a's next token fits its page; b needs a new page, none is free, and b is the newest
    out = sched.schedule()
    assert out.preempted == [b]
    assert shares(out) == {a.request_id: 1}
    finish_step(sched, out)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, block_size=2, budget=64, prefix=False)
    a = add(sched, make_seq(3, max_tokens=4))
    b = add(sched, make_seq(3, max_tokens=4))
    finish_step(sched, sched.schedule())
    finish_step(sched, sched.schedule())
    late = add(sched, make_seq(1, max_tokens=1))
    out = sched.schedule()
    assert out.preempted == [b]
    assert late not in [s.seq for s in out.scheduled]
    assert list(sched.waiting) == [b, late]  # arrival order kept


def test_abort_frees_pages_at_once():
    sched = make_scheduler()
    a = add(sched, make_seq(9))
    finish_step(sched, sched.schedule())
    assert a.block_table
    used = sched.block_manager.num_used_blocks
    sched.abort(a)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "abort"
    assert sched.block_manager.num_used_blocks == used - 3
    assert not sched.has_unfinished()


def test_prefix_cache_hit_counts_tokens_as_computed():
    sched = make_scheduler(block_size=4)
    a = add(sched, make_seq(9))
    finish_step(sched, sched.schedule())
    b = Sequence(seq_id=next(_ids), request_id="b", prompt_token_ids=a.prompt_token_ids[:8] + [999],
                 params=SamplingParams(max_tokens=2), arrival=10**6)
    add(sched, b)
    out = sched.schedule()
    item = [s for s in out.scheduled if s.seq is b][0]
    assert item.start == 8 and item.num_tokens == 1
    assert b.num_cached_tokens == 8
    assert sched.stats.prefix_hits == 8


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_with_all_pages_returned(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.choice([12, 20, 40]), block_size=rng.choice([1, 2, 4]),
                           budget=rng.choice([4, 8, 32]), max_seqs=rng.choice([2, 4, 16]),
                           chunked=True, prefix=rng.random() < 0.5)
    bm = sched.block_manager
    seqs = []
    for _ in range(12):
        seq = make_seq(rng.randrange(1, 12), max_tokens=rng.randrange(1, 8), base=rng.randrange(3))
        if bm.blocks_for(seq.num_tokens + seq.params.max_tokens - 1) <= bm.num_blocks:
            seqs.append(add(sched, seq))
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out, "no progress"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        finish_step(sched, out)
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_lower_priority_is_admitted_first_whatever_the_arrival():
    sched = make_scheduler(max_seqs=2)
    late = [make_seq(4) for _ in range(3)]
    for i, seq in enumerate(late):
        seq.priority = 1 + i  # the k-th sequence of one big request
        add(sched, seq)
    first = add(sched, make_seq(4))  # arrives last, priority 0: a one-sequence request
    assert set(shares(sched.schedule())) == {first.request_id, late[0].request_id}
    # equal priorities go by arrival, whatever the order they were queued in
    a, b = make_seq(4), make_seq(4)
    a.priority = b.priority = 3
    sched2 = make_scheduler(max_seqs=1)
    add(sched2, b)
    add(sched2, a)
    assert set(shares(sched2.schedule())) == {a.request_id}


def test_preemption_takes_the_lowest_priority_first():
    # 4 pages of 4 tokens: two sequences of 6 prompt tokens fill them once they decode
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32, max_seqs=4)
    low = make_seq(6, max_tokens=8)
    low.priority = 5
    high = make_seq(6, max_tokens=8)  # arrives later but ranks first
    add(sched, low)
    add(sched, high)
    out = sched.schedule()
    preempted = []
    for _ in range(8):
        finish_step(sched, out)
        out = sched.schedule()
        preempted += out.preempted
        if preempted:
            break
    assert preempted and preempted[0] is low


# -- pipelines: several steps in flight ------------------------------------------------------
def make_pipeline_scheduler(depth: int, **kw) -> Scheduler:
    bm = BlockManager(kw.pop("num_blocks", 64), kw.pop("block_size", 4),
                      enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs=kw.pop("max_seqs", 8),
                     max_num_batched_tokens=kw.pop("budget", 64), depth=depth)


def test_micro_batches_take_turns_with_disjoint_sequences():
    sched = make_pipeline_scheduler(depth=2)
    seqs = [add(sched, make_seq(5, max_tokens=20)) for _ in range(4)]
    first = sched.schedule()
    second = sched.schedule()  # the first is still in flight
    a, b = set(shares(first)), set(shares(second))
    assert len(a) == len(b) == 2 and not a & b
    assert not sched.schedule()  # everything is in flight: nothing to schedule
    finish_step(sched, first)
    third = sched.schedule()  # the first group decodes again, the second is in flight
    assert set(shares(third)) == a and all(n == 1 for n in shares(third).values())
    finish_step(sched, second)
    finish_step(sched, third)
    assert all(s.num_computed_tokens == 6 or s.num_computed_tokens == 5 for s in seqs)


def test_depth_one_schedules_everything_at_once():
    sched = make_pipeline_scheduler(depth=1)
    for _ in range(4):
        add(sched, make_seq(5))
    assert len(shares(sched.schedule())) == 4


def test_a_sequence_in_flight_is_never_preempted():
    # 4 pages of 4 tokens: two prompts of 8 tokens hold 2 pages each
    sched = make_pipeline_scheduler(depth=2, num_blocks=4, budget=64)
    a, b = add(sched, make_seq(8, max_tokens=8)), add(sched, make_seq(8, max_tokens=8))
    first = sched.schedule()
    assert set(shares(first)) == {a.request_id}
    second = sched.schedule()
    assert set(shares(second)) == {b.request_id}
    finish_step(sched, first)  # a has 9 tokens: computing the 9th needs a third page
    out = sched.schedule()  # no free page; b, newer but in flight, may not be preempted
    assert out.preempted == [a] and not out and b.status is SequenceStatus.RUNNING
    finish_step(sched, second)
    assert shares(sched.schedule()) == {b.request_id: 1}


def test_an_aborted_sequence_in_flight_is_only_released_on_completion():
    sched = make_pipeline_scheduler(depth=2)
    a = add(sched, make_seq(6))
    out = sched.schedule()
    sched.abort(a)
    assert sched.block_manager.num_used_blocks == 0
    sched.complete_step(out)  # no page named, nothing cached for a freed sequence
    assert a.num_computed_tokens == 0 and not sched.in_flight(a)
    sched.block_manager.check_invariants(sched.live_sequences())
