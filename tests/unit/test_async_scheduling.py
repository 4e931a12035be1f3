"""Async scheduling's parts on their own: the scheduler's pending-token accounting, the
placeholders a step carries for tokens still on the device and how the input batch and
the host fill them, the sampler's two halves, the option's checks."""

import pytest
import torch
from quire.config import EngineConfig
from quire.engine.block_manager import BlockManager
from quire.engine.scheduler import ScheduledSeq, Scheduler
from quire.engine.sequence import Sequence, SequenceStatus
from quire.executor.input_batch import InputBatch
from quire.engine.step_items import ItemBuilder
from quire.executor.messages import (
    PENDING_TOKEN,
    StepItem,
    resolve_pending,
)
from quire.sampler import Sampler
from quire.sampling_params import SamplingParams

BS = 4


def _seq(seq_id: int, n_prompt: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}",
                    prompt_token_ids=[10 + seq_id * 7 + k for k in range(n_prompt)],
                    params=SamplingParams(max_tokens=max_tokens), arrival=seq_id,
                    max_num_tokens=n_prompt + max_tokens)


def _scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=8,
                     max_num_batched_tokens=budget)


def _add(sched: Scheduler, seq: Sequence) -> Sequence:
    sched.add(seq, seq.max_num_tokens - 1)
    return seq


def _sampled(sched: Scheduler, out) -> list[Sequence]:
    """Complete a step and mark a pending token on each sequence that sampled, as the
    core does between sampling on the device and scheduling the next step."""
    sched.complete_step(out)
    seqs = [s.seq for s in out.scheduled if s.samples]
    for seq in seqs:
        seq.num_pending_tokens = 1
    return seqs


def _land(seqs: list[Sequence], token: int = 3) -> None:
    """The pending tokens reach the host."""
    for seq in seqs:
        seq.num_pending_tokens = 0
        seq.output_token_ids.append(token)


# -- the scheduler ---------------------------------------------------------------------------
def test_a_pending_token_is_scheduled_sampled_and_given_its_page():
    sched = _scheduler()
    seq = _add(sched, _seq(0, n_prompt=8))  # two full pages: the pending token needs a third
    out = sched.schedule()
    assert [(s.start, s.num_tokens, s.samples) for s in out.scheduled] == [(0, 8, True)]
    pending = _sampled(sched, out)
    assert seq.num_tokens == 8 and seq.num_uncomputed_tokens == 1
    out = sched.schedule()
    [item] = out.scheduled
    assert (item.start, item.num_tokens, item.samples) == (8, 1, True)
    assert len(seq.block_table) == 3  # position 8 lives on the third page
    _land(pending)
    sched.complete_step(out)
    assert seq.num_computed_tokens == 9 and seq.num_uncomputed_tokens == 0
    sched.block_manager.check_invariants(sched.live_sequences())


def test_a_prefill_chunk_that_samples_nothing_leaves_nothing_pending():
    sched = _scheduler(budget=5)
    seq = _add(sched, _seq(0, n_prompt=8))
    out = sched.schedule()
    assert not out.scheduled[0].samples
    assert _sampled(sched, out) == []
    out = sched.schedule()
    assert [(s.start, s.num_tokens, s.samples) for s in out.scheduled] == [(5, 3, True)]
    assert seq.num_pending_tokens == 0


def test_a_pending_token_that_ends_the_sequence_by_length_is_not_scheduled():
    sched = _scheduler()
    short = _add(sched, _seq(0, n_prompt=4, max_tokens=2))
    other = _add(sched, _seq(1, n_prompt=4, max_tokens=8))
    out = sched.schedule()
    pending = _sampled(sched, out)  # each has its first token pending
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {0, 1}  # 2 tokens: not the last yet
    _land(pending)
    pending = _sampled(sched, out)  # short's second (and last) token is pending
    assert short.pending_finishes_it and not other.pending_finishes_it
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    # its K/V never grows past the tokens it was admitted for (prompt + max_tokens - 1)
    assert short.num_computed_tokens == 5 and len(short.block_table) == 2


def test_every_running_sequence_pending_can_still_be_preempted():
    # 4 pages of 4: two sequences of 8 prompt tokens fill them; the next tokens need more
    sched = _scheduler(num_blocks=4)
    a, b = _add(sched, _seq(0, n_prompt=8)), _add(sched, _seq(1, n_prompt=8))
    out = sched.schedule()
    assert len(out.scheduled) == 2
    pending = _sampled(sched, out)
    out = sched.schedule()
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING
    assert [s.seq for s in out.scheduled] == [a]
    assert sched.stats.num_preemptions == 1
    # b's pending token still lands (the core appends it), and b recomputes it later
    _land(pending)
    assert b.num_computed_tokens == 0 and b.num_uncomputed_tokens == 9
    sched.block_manager.check_invariants(sched.live_sequences())


def test_finishing_a_sequence_preempted_while_pending_takes_it_off_the_waiting_queue():
    sched = _scheduler(num_blocks=4)
    _add(sched, _seq(0, n_prompt=8))
    b = _add(sched, _seq(1, n_prompt=8))
    pending = _sampled(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [b]
    _land(pending)
    sched.finish(b, "stop")  # its pending token was EOS
    assert b not in sched.waiting and b.is_finished
    assert sched.block_manager.num_used_blocks == len(out.scheduled[0].seq.block_table)


# -- placeholders ----------------------------------------------------------------------------
def _pending_step(prompt_lens: list[int]) -> tuple[list[Sequence], list[ScheduledSeq]]:
    """Sequences that computed their prompts and sampled, pending, then scheduled again."""
    sched = _scheduler()
    seqs = [_add(sched, _seq(i, n)) for i, n in enumerate(prompt_lens)]
    _sampled(sched, sched.schedule())
    return seqs, sched.schedule().scheduled


def test_a_pending_token_travels_as_a_placeholder_naming_its_row():
    seqs, scheduled = _pending_step([5, 7])
    builder = ItemBuilder()
    items = builder.items(scheduled, {0: 1, 1: 0})  # rows in another order than items
    assert [(i.token_ids, i.start, i.prev_row, i.samples) for i in items] == [
        ([PENDING_TOKEN], 5, 1, True), ([PENDING_TOKEN], 7, 0, True)]
    assert resolve_pending(items, [70, 50]) == [
        StepItem(0, [50], 5, items[0].block_table, True, 0, items[0].first_page),
        StepItem(1, [70], 7, items[1].block_table, True, 0, items[1].first_page)]
    with pytest.raises(ValueError, match="no sampled row"):
        ItemBuilder().items(scheduled)


def test_the_input_batch_takes_each_pending_token_from_its_own_row():
    # two sequences whose tokens differ: a swapped or shifted row would show
    batch = InputBatch(BS, torch.device("cpu"))
    first = [StepItem(0, [11, 12, 13], 0, [1], True), StepItem(1, [21, 22], 0, [2], True)]
    batch.prepare(first)
    second = [StepItem(1, [PENDING_TOKEN], 2, [], True, first_page=1, prev_row=0),
              StepItem(0, [PENDING_TOKEN], 3, [], True, first_page=1, prev_row=2)]
    sampled = torch.tensor([222, 999, 111])
    inputs = batch.prepare(second, sampled=sampled)
    assert inputs.input_ids.tolist() == [222, 111]
    assert inputs.positions.tolist() == [2, 3]
    # an item of several tokens whose last is pending gets it at its last position
    mixed = [StepItem(2, [5, 6, PENDING_TOKEN], 0, [3], True, prev_row=1),
             StepItem(1, [7], 3, [], True, first_page=1)]
    assert batch.prepare(mixed, sampled=sampled).input_ids.tolist() == [5, 6, 999, 7]
    with pytest.raises(ValueError, match="sequence 1 has a pending token"):
        batch.prepare([StepItem(1, [PENDING_TOKEN], 4, [4], True, first_page=1,
                                prev_row=0)])


# -- the sampler's halves --------------------------------------------------------------------
def test_sampling_on_the_device_then_on_the_host_is_sampling():
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=0.7, seed=9, logprobs=0)]
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[1, 2], params=p)
            for i, p in enumerate(params)]
    whole = Sampler(frozenset({0}), vocab).sample(logits.clone(), seqs)
    sampler = Sampler(frozenset({0}), vocab)
    on_device = sampler.sample_on_device(logits.clone(), seqs)
    assert on_device.token_ids.tolist() == whole.token_ids
    halves = sampler.to_host(on_device)
    assert halves.token_ids == whole.token_ids
    assert halves.logprobs == whole.logprobs
    assert halves.logprobs[1] is None and len(halves.logprobs[0].top) == 3


# -- the option ------------------------------------------------------------------------------
def test_async_scheduling_with_a_pipeline_is_refused_naming_both():
    with pytest.raises(ValueError, match="async_scheduling.*pipeline_parallel_size"):
        EngineConfig("m", async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be true or false"):
        EngineConfig("m", async_scheduling="yes")  # type: ignore[arg-type]
    assert EngineConfig("m", async_scheduling=True, tensor_parallel_size=2).async_scheduling


def test_the_cli_takes_a_bare_async_scheduling_flag():
    import argparse

    from quire.entrypoints.cli.engine_options import (
        add_engine_options,
        engine_config_from_args,
        expand_bare_flags,
    )

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(expand_bare_flags(parser, ["--async-scheduling", "--model", "m"]))
    assert engine_config_from_args(args).async_scheduling is True
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).async_scheduling is False


# -- the drafters ----------------------------------------------------------------------------
def test_a_draft_model_reads_a_pending_token_from_the_device(tiny_checkpoint):
    """A step in which one sequence drafts while another's last token is still on the
    device: the draft model's proposals and K/V are those with the token on the host."""
    from quire.executor.drafter import Drafter
    from quire.models.loader import load_model
    from quire.ops import reference_ops
    from quire.ops.attention import ReferenceAttentionBackend
    from tiny_models import SingleRank

    cpu = torch.device("cpu")
    model, _ = load_model(str(tiny_checkpoint("llama")), SingleRank(), cpu, torch.float32)
    backend = ReferenceAttentionBackend()

    def run(second: StepItem, sampled: torch.Tensor | None):
        caches = [backend.allocate_kv_cache(4, BS, model.num_kv_heads, model.head_dim,
                                            torch.float32, cpu).zero_()
                  for _ in range(model.num_layers)]
        drafter = Drafter(model, backend, caches, BS, cpu, reference_ops())
        drafting = StepItem(0, [5, 17, 42, 0, 0], 0, [0, 1], True, num_spec=2)
        _, proposals = drafter.propose([drafting, second], sampled=sampled)
        return proposals, caches

    host, host_kv = run(StepItem(1, [9, 33, 77], 0, [2], True), None)
    pending, pending_kv = run(StepItem(1, [9, 33, PENDING_TOKEN], 0, [2], True, prev_row=1),
                              torch.tensor([0, 77]))
    assert pending == host and len(host[0]) == 2 and host[1] == ()
    for got, want in zip(pending_kv, host_kv, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
