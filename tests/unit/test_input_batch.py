"""The persistent input batch: steps that send only what changed give the same inputs as
building every step from whole page tables, across adds, chunked prefill, prefix hits,
forks, finishes and preemptions; its buffers stay put at the configured limits."""

import random
import sys

import msgspec
import pytest
import torch
from quire.engine.block_manager import BlockManager
from quire.engine.scheduler import ScheduledSeq, Scheduler
from quire.engine.sequence import Sequence
from quire.engine.step_items import ItemBuilder, step_item
from quire.executor.input_batch import InputBatch, StepLimits
from quire.executor.messages import Step, StepItem, StepPlan
from quire.sampling_params import SamplingParams
from residency import resident_pages

BS = 4


def from_scratch(items: list[StepItem], bs: int) -> dict[str, list]:
    """The step's inputs built from whole tables, as the runner did before the batch
    persisted (the oracle)."""
    token_ids, positions, slots, qsl, seq_lens, samples = [], [], [], [0], [], []
    for item in items:
        assert item.first_page == 0
        for k, token in enumerate(item.token_ids):
            p = item.start + k
            token_ids.append(token)
            positions.append(p)
            slots.append(item.block_table[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + len(item.token_ids))
        seq_lens.append(item.end)
        if item.samples:
            samples.append(qsl[-1] - 1)
    return {"input_ids": token_ids, "positions": positions, "slot_mapping": slots,
            "query_start_loc": qsl, "seq_lens": seq_lens, "sample_rows": samples,
            "tables": [list(item.block_table) for item in items]}


def got(batch: InputBatch, items: list[StepItem], released: list[int]) -> dict[str, list]:
    inputs = batch.prepare(items, released)
    tables = inputs.batch.block_tables
    assert tables.is_contiguous() and tables.dtype == torch.int32
    seq_lens = inputs.batch.seq_lens.tolist()
    return {"input_ids": inputs.input_ids.tolist(), "positions": inputs.positions.tolist(),
            "slot_mapping": inputs.batch.slot_mapping.tolist(),
            "query_start_loc": inputs.batch.query_start_loc.tolist(), "seq_lens": seq_lens,
            "sample_rows": inputs.sample_rows.tolist(),
            # columns past a sequence's last page are padding (any valid id)
            "tables": [row[: -(-n // BS)] for row, n in zip(tables.tolist(), seq_lens)]}


def _seq(seq_id: int, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=prompt,
                    params=SamplingParams(max_tokens=max_tokens), arrival=seq_id)


@pytest.mark.parametrize("seed", range(6))
def test_steps_of_changes_equal_steps_built_from_scratch(seed):
    """A small pool forces preemptions; shared prompt heads give prefix hits; a small
    budget chunks prompts; some sequences fork, some finish early (aborts, stops)."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=18, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=24)
    builder = ItemBuilder()
    batch = InputBatch(BS, torch.device("cpu"), StepLimits(2, 8, 2))  # grows as it goes
    heads = [[rng.randrange(1000) for _ in range(9)] for _ in range(3)]
    next_id, steps, preempted, forks = 0, 0, 0, 0
    live: list[Sequence] = []
    while steps < 120:
        if next_id < 40 and rng.random() < 0.4:
            prompt = rng.choice(heads)[: rng.randrange(1, 10)] + [
                rng.randrange(1000) for _ in range(rng.randrange(0, 14))]
            seq = _seq(next_id, prompt or [1], rng.randrange(1, 20))
            next_id += 1
            sched.add(seq, seq.num_tokens + seq.params.max_tokens - 1)
            live.append(seq)
        out = sched.schedule()
        for seq in out.preempted:
            builder.release(seq.seq_id)
            preempted += 1
        if not out:
            if not sched.has_unfinished() and next_id >= 40:
                break
            continue
        steps += 1
        items = builder.items(out.scheduled)
        released = builder.take_released()
        # what a worker receives went through msgpack
        plan = msgspec.msgpack.decode(msgspec.msgpack.encode(Step(StepPlan(items, released))),
                                      type=Step).plan
        want = from_scratch([step_item(s) for s in out.scheduled], BS)
        assert got(batch, plan.items, plan.released) == want, f"step {steps}"
        sched.complete_step(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.samples or seq.is_finished:
                continue
            seq.output_token_ids.append(rng.randrange(1000))
            if seq.num_output_tokens == 1 and rng.random() < 0.2 and next_id < 40:
                child = _seq(next_id, seq.prompt_token_ids, seq.params.max_tokens)
                child.arrival = seq.arrival
                next_id += 1
                sched.fork(seq, child)
                live.append(child)
                forks += 1
            if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.05:
                sched.finish(seq, "length")
                builder.release(seq.seq_id)
        if live and rng.random() < 0.03:  # an abort, wherever the sequence is
            victim = rng.choice(live)
            if not victim.is_finished:
                sched.abort(victim)
                builder.release(victim.seq_id)
        bm.check_invariants(sched.live_sequences())
        # the batch holds a table for every scheduled-once live sequence, no more
        assert batch.num_seqs <= len(builder._known) + len(builder._released)
    assert steps > 50 and preempted and forks and sched.stats.prefix_hits  # all exercised


def test_a_decode_step_sends_only_new_pages():
    bm = BlockManager(num_blocks=16, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    builder = ItemBuilder()
    seq = _seq(0, list(range(7)), 8)
    sched.add(seq, 14)
    out = sched.schedule()
    first = builder.items(out.scheduled)[0]
    assert (first.first_page, first.block_table) == (0, seq.block_table[:2])
    sched.complete_step(out)
    seq.output_token_ids.append(5)  # 8 tokens: the step writes position 7, in page 1
    out = sched.schedule()
    item = builder.items(out.scheduled)[0]
    assert (item.first_page, item.block_table, item.token_ids) == (2, [], [5])
    sched.complete_step(out)
    seq.output_token_ids.append(6)  # position 8 opens page 2
    out = sched.schedule()
    item = builder.items(out.scheduled)[0]
    assert (item.first_page, item.block_table) == (2, [seq.block_table[2]])


def test_a_preempted_sequence_sends_its_table_whole_even_unreleased():
    """Its pages went back to the pool: a continuation of its old table would be wrong."""
    seq = _seq(0, list(range(6)), 8)
    seq.block_table = [3, 4]
    builder = ItemBuilder()
    scheduled = [ScheduledSeq(seq, 0, 6)]
    assert builder.items(scheduled)[0].first_page == 0
    seq.block_table, seq.num_preemptions = [5, 6, 7], 1  # preempted, then admitted again
    item = builder.items(scheduled)[0]
    assert (item.first_page, item.block_table) == (0, [5, 6, 7])
    assert builder.take_released() == []


def test_buffers_keep_their_addresses_within_the_limits_and_grow_past_them():
    batch = InputBatch(BS, torch.device("cpu"), StepLimits(4, 16, 4))
    first = batch.prepare([StepItem(0, [1, 2, 3], 0, [7], True)])
    second = batch.prepare([StepItem(0, [4], 3, [], True, first_page=1),
                            StepItem(1, [9] * 13, 0, [1, 2, 3, 4], True)])
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()
    assert second.batch.block_tables.data_ptr() == first.batch.block_tables.data_ptr()
    assert second.batch.slot_mapping.tolist()[0] == 7 * BS + 3
    big = batch.prepare([StepItem(2, [0] * 40, 0, list(range(10)), True)])  # past 16 tokens
    assert big.input_ids.shape == (40,) and big.batch.block_tables.tolist() == [
        list(range(10))]


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on an anonymous mapping")
def test_host_buffers_hold_memory_only_where_steps_write():
    # Llama 3's 131,072 positions in pages of 16, for 256 sequences: 8 MiB of page
    # tables, of which a step with one short sequence writes a few bytes
    batch = InputBatch(BS, torch.device("cpu"), StepLimits(256, 2048, 8192))
    step = batch.prepare([StepItem(0, [1, 2, 3], 0, [7], True)])
    tables = step.batch.block_tables.untyped_storage()
    whole = torch.empty(0, dtype=torch.int32).set_(tables)
    assert whole.numel() == 256 * 8192
    assert sum(resident_pages(whole)[1]) <= 2  # pages, before reading it
    assert step.batch.block_tables.tolist() == [[7]] and not whole[1:].any()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/maps")
def test_host_buffers_are_private_to_the_process():
    # a shared mapping would be shared with a forked child, which then writes the same
    # step inputs as its parent
    batch = InputBatch(BS, torch.device("cpu"), StepLimits(256, 2048, 8192))
    address = batch.prepare([StepItem(0, [1, 2, 3], 0, [7], True)]).batch.block_tables.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(v, 16) for v in span.split("-"))
            if low <= address < high:
                assert perms[3] == "p", line
                return
    raise AssertionError("the block tables lie in no mapping")


def test_a_continuation_the_batch_never_saw_is_refused():
    batch = InputBatch(BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="sequence 3 sends pages from 2 on"):
        batch.prepare([StepItem(3, [1], 8, [5], True, first_page=2)])
    batch.prepare([StepItem(4, [1, 2], 0, [5], True)])
    batch.release([4])
    assert batch.num_seqs == 0 and batch.pages_of(4) == []
    with pytest.raises(ValueError, match="holds none of its earlier pages"):
        batch.prepare([StepItem(4, [3], 2, [], True, first_page=1)])
    batch.prepare([StepItem(5, [1, 2], 0, [6], True)])
    with pytest.raises(ValueError, match="holds only 1 of its pages"):
        batch.prepare([StepItem(5, [3], 8, [9], True, first_page=2)])
    with pytest.raises(ValueError, match="sequence 5 reaches position 4 with 1 page"):
        batch.prepare([StepItem(5, [3], 4, [], True, first_page=1)])


def test_device_twins_receive_every_input():
    """Where the device is not the host, each step's inputs are copied into buffers of
    their own (tested here with host twins: no accelerator on this machine)."""
    from quire.executor.input_batch import _Buffers

    plain = InputBatch(BS, torch.device("cpu"), StepLimits(4, 32, 8))
    twins = InputBatch(BS, torch.device("cpu"), StepLimits(4, 32, 8))
    twins._dev = _Buffers(4, 32, 8, torch.device("cpu"))
    steps = [
        ([StepItem(0, list(range(9)), 0, [3, 1, 4], True),
          StepItem(1, [5, 6], 0, [2], False)], []),
        ([StepItem(0, [7], 9, [], True, first_page=3),
          StepItem(1, [8, 9, 10], 2, [6], True, first_page=1)], []),
        ([StepItem(1, [11], 5, [], True, first_page=2),
          StepItem(2, [1, 2, 3, 4, 5], 0, [0, 5], True)], [0]),
    ]
    for items, released in steps:
        a, b = plain.prepare(items, released), twins.prepare(items, released)
        assert b.input_ids.data_ptr() != a.input_ids.data_ptr()
        for name in ("input_ids", "positions", "sample_rows"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name


def test_an_engine_s_input_batch_mirrors_its_sequences(tiny_checkpoint):
    """Through an engine with preemptions, forks (n=2) and an abort: after every step the
    worker's batch holds, for each sequence the core says it sent, exactly the pages the
    sequence had then, and nothing for the rest once their release has gone out."""
    from quire.config import EngineConfig
    from quire.engine import LLMEngine

    path = str(tiny_checkpoint("llama"))
    probe = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", block_size=4))
    spec = probe.core.kv_spec
    page = 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_size * 4
    probe.shutdown()
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", block_size=4,
                                                kv_cache_memory=18 * page, max_num_seqs=4))
    core, batch = engine.core, engine.core.executor.worker.runner.input_batch
    rids = [engine.add_request([5 + i, 9, 14, 3, 7 + i], SamplingParams(
        max_tokens=14, n=2 if i % 2 else 1, ignore_eos=True, seed=i))
        for i in range(6)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort_request(rids[0])
        known = core._items._known
        seqs = {s.seq_id: s for s in core.scheduler.live_sequences()}
        for seq_id, (_, pages) in known.items():
            assert batch.pages_of(seq_id) == seqs[seq_id].block_table[:pages]
        assert batch.num_seqs <= len(known) + len(core._items._released)
    assert core.scheduler.stats.num_preemptions > 0
    assert not core._items._known and batch.num_seqs == len(core._items._released)
    engine.shutdown()
