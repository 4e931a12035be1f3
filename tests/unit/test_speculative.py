"""Speculative decoding's parts without a model: the sampler's verification rows, the
scheduler's drafts and their pages, the input batch's rows, the speculator's limits, the
configuration and the metrics. The end-to-end checks are in
``tests/integration/test_speculative_outputs.py``; the rejection rule's own statistics in
``test_rejection_sampling.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from quire.config import EngineConfig
from quire.engine.block_manager import BlockManager
from quire.engine.messages import EngineStats
from quire.engine.scheduler import ScheduledSeq, Scheduler
from quire.engine.sequence import Sequence, SequenceStatus
from quire.engine.speculation import DraftKV, Speculator
from quire.engine.step_items import ItemBuilder
from quire.executor.input_batch import InputBatch
from quire.executor.messages import StepItem
from quire.sampler import Sampler
from quire.sampling.rows import DraftRow
from quire.sampling_params import SamplingParams
from quire.spec.config import SpeculativeConfig

V = 12
_ids = itertools.count()


def make_seq(params: SamplingParams, prompt: list[int] | None = None,
             output: list[int] | None = None, max_num_tokens: int = 10**6) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt or [1, 2, 3],
                    params=params, output_token_ids=list(output or []),
                    max_num_tokens=max_num_tokens)


# -- the sampler ---------------------------------------------------------------------------
def _adjusted_argmax(sampler_seed: int, logits: torch.Tensor, row) -> int:
    """What a plain greedy step picks for ``row`` from ``logits`` (one row)."""
    return Sampler(frozenset({0}), V, sampler_seed).sample(logits.clone()[None], [row]) \
        .token_ids[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7,
                   presence_penalty=0.4),
    SamplingParams(temperature=0, min_tokens=4, logit_bias={5: 1.5}),
    SamplingParams(temperature=0, bad_words_token_ids=[[6, 6], [2, 7], [5]],
                   allowed_token_ids=list(range(0, V, 2)) + [5, 7]),
    SamplingParams(temperature=0, logits_processors=[
        lambda out, logits: logits - 2.0 * (torch.arange(V) == (out[-1] + 1) % V)]),
])
def test_each_verification_row_is_adjusted_as_if_its_drafts_were_output(params):
    """Penalties, ``min_tokens`` and bias of row j count drafts 0..j-1 as output: with
    drafts equal to what plain greedy steps would choose, every draft is accepted."""
    torch.manual_seed(0)
    seq = make_seq(params, prompt=[3, 4], output=[6])
    rows = torch.randn(5, V)
    rows[:, 0] += 3.0  # EOS the likeliest: min_tokens must keep it out
    rows[:, 6] += 1.0
    drafts: list[int] = []
    for j in range(4):  # the greedy chain, one plain step at a time
        drafts.append(_adjusted_argmax(0, rows[j], DraftRow.extend(seq, drafts)))
    bonus = _adjusted_argmax(0, rows[4], DraftRow.extend(seq, drafts))
    sampler = Sampler(frozenset({0}), V)
    out = sampler.verify(rows.clone(), [seq], [drafts])
    assert out.token_ids == [drafts + [bonus]] and out.num_accepted == [4]
    # a wrong draft at position 2 is rejected there, and the row's choice replaces it
    wrong = drafts[:2] + [(drafts[2] + 1) % V, drafts[3]]
    out = Sampler(frozenset({0}), V).verify(rows.clone(), [seq], [wrong])
    assert out.token_ids == [drafts[:3]] and out.num_accepted == [2]
    assert seq.output_token_ids == [6]  # the sequence itself is untouched


def test_verification_keeps_the_target_distribution_through_the_sampler():
    """One draft per sequence at temperature 0.8 with top-k: the first emitted token
    follows the filtered target distribution, whatever the draft (total variation
    within the bound that test_sampler uses)."""
    torch.manual_seed(1)
    logits = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.5, -3.0, 0.8, -0.5, 1.0, -2.0, 0.5])
    params = SamplingParams(temperature=0.8, top_k=6)
    n = 30000
    seqs = [make_seq(params) for _ in range(n)]
    drafts = [[d] for d in torch.randint(0, V, (n,)).tolist()]
    batch = torch.stack([logits, logits.roll(1)]).repeat(n, 1)
    out = Sampler(frozenset(), V, seed=3).verify(batch, seqs, drafts)
    firsts = torch.tensor([t[0] for t in out.token_ids])
    scaled = logits.double() / 0.8
    keep = scaled >= scaled.sort(descending=True).values[5]
    want = torch.where(keep, scaled.softmax(-1), 0.0)
    want /= want.sum()
    got = torch.bincount(firsts, minlength=V).double() / n
    bound = math.sqrt((V * math.log(2) + math.log(2 / 1e-6)) / (2 * n))
    assert 0.5 * (got - want).abs().sum().item() < bound
    assert (got[~keep] == 0).all()
    accepted = sum(out.num_accepted) / n
    assert accepted == pytest.approx(sum(want[d[0]].item() for d in drafts) / n, abs=0.02)


def test_seeded_verification_draws_from_the_sequence_s_generator():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(3, V)

    def run(other_rows: int) -> list[int]:
        seqs = [make_seq(params)] + [make_seq(SamplingParams(temperature=1.0))
                                     for _ in range(other_rows)]
        seqs[0].seq_id = 10**9  # one id for the seeded sequence in both runs
        drafts = [[4, 5]] + [[] for _ in range(other_rows)]
        rows = torch.cat([logits] + [torch.randn(1, V) for _ in range(other_rows)])
        return Sampler(frozenset(), V, seed=other_rows).verify(rows, seqs, drafts).token_ids[0]

    assert run(0) == run(3)


def test_verification_logprobs_are_each_token_s_own_row():
    params = SamplingParams(temperature=0, logprobs=2)
    seq = make_seq(params)
    rows = torch.randn(3, V)
    drafts = [int(rows[0].argmax()), int(rows[1].argmax())]
    out = Sampler(frozenset(), V).verify(rows.clone(), [seq], [drafts])
    assert out.num_accepted == [2] and len(out.logprobs[0]) == 3
    for j, (token, entry) in enumerate(zip(out.token_ids[0], out.logprobs[0])):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(rows[j].log_softmax(-1)[token].item(), abs=1e-5)


def test_verification_refuses_rows_that_do_not_match_the_drafts():
    with pytest.raises(ValueError, match=r"\[3, 12\]"):
        Sampler(frozenset(), V).verify(torch.zeros(2, V), [make_seq(SamplingParams())], [[1, 2]])


# -- the scheduler and the pages -------------------------------------------------------------
def _scheduler(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs=8,
                     max_num_batched_tokens=budget)


def _decoding(sched: Scheduler, prompt: list[int], room: int = 50) -> Sequence:
    """A sequence past its prompt, with one output token."""
    seq = make_seq(SamplingParams(max_tokens=room), prompt=prompt)
    sched.add(seq, len(prompt) + room - 1)
    out = sched.schedule()
    sched.complete_step(out)
    seq.output_token_ids.append(9)
    return seq


def test_drafts_follow_the_known_token_and_their_pages_go_back_when_rejected():
    sched = _scheduler()
    bm = sched.block_manager
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7])  # 7 computed, 8 tokens
    seq.spec_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.start, item.num_tokens, item.spec) == (7, 6, (11, 12, 13, 14, 15))
    assert item.samples and len(seq.block_table) == 4  # 13 positions
    sched.complete_step(out)
    assert seq.num_named_blocks == 2  # the pages of its 8 known tokens, not the drafts'
    seq.output_token_ids += [11, 30]  # one draft accepted, then the target's token
    assert sched.settle_drafts(seq)
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    bm.check_invariants([seq])
    # the prefix cache holds the accepted tokens' pages, never a page of drafts: a
    # prompt of the known tokens and the rejected drafts finds only the first two
    other = make_seq(SamplingParams(), prompt=seq.token_ids[:8] + [11, 12, 13, 14, 1])
    assert len(bm.find_cached_prefix(other)) == 2
    # once the accepted token and the next fill the third page, it is found too
    seq.output_token_ids += [31, 32, 33]
    sched.block_manager.cache_full_blocks(seq, 12)
    assert len(bm.find_cached_prefix(make_seq(SamplingParams(),
                                              prompt=seq.token_ids[:12] + [1]))) == 3


def test_drafts_give_way_to_the_budget_and_before_any_preemption():
    sched = _scheduler(budget=4)
    seq = _decoding(sched, [1, 2, 3])
    seq.spec_token_ids = [5, 6, 7, 8, 9]
    (item,) = sched.schedule().scheduled
    assert item.num_tokens == 4 and item.spec == (5, 6, 7)

    sched = _scheduler(num_blocks=3, budget=64)
    b = _decoding(sched, [1, 2], room=4)  # 1 page
    a = _decoding(sched, [1, 2, 3, 4, 5, 6, 7], room=4)  # 2 pages; 8 tokens fill them
    b.output_token_ids.append(9)  # the token a's step computed b's logits for
    a.spec_token_ids = [5, 6]  # would need a third and fourth page: none free
    out = sched.schedule()
    assert not out.preempted
    assert {s.seq.seq_id: s.spec for s in out.scheduled} == {a.seq_id: (), b.seq_id: ()}
    assert b.status is SequenceStatus.RUNNING


def test_drafts_never_take_the_page_a_later_sequence_needs():
    sched = _scheduler(num_blocks=4, budget=64)
    a = make_seq(SamplingParams(max_tokens=8), prompt=[1, 2, 3, 4, 5, 6, 7])
    b = make_seq(SamplingParams(max_tokens=8), prompt=[1, 2, 3, 9])
    for seq in (a, b):
        sched.add(seq, seq.num_tokens + 7)
    out = sched.schedule()  # both prompts: 2 + 1 pages, one left
    sched.complete_step(out)
    a.output_token_ids.append(8)  # position 7 still fits a's second page
    b.output_token_ids.append(8)  # position 4 needs b's second page: the last one
    a.spec_token_ids = [5]  # position 8 would need the last page too
    out = sched.schedule()
    assert not out.preempted
    assert [(s.seq.seq_id, s.num_tokens, s.spec) for s in out.scheduled] == \
        [(a.seq_id, 1, ()), (b.seq_id, 1, ())]
    a.spec_token_ids = []


def test_a_preempted_sequence_drops_its_drafts():
    sched = _scheduler()
    seq = _decoding(sched, [1, 2, 3])
    seq.spec_token_ids = [4, 5]
    sched._preempt(seq)
    assert seq.spec_token_ids == []


def test_a_shrunk_table_is_sent_again_from_where_it_shrank():
    builder = ItemBuilder()
    sched = _scheduler()
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7])
    seq.spec_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    (item,) = builder.items(out.scheduled)
    assert item.token_ids == [9, 11, 12, 13, 14, 15] and item.num_spec == 5
    batch = InputBatch(4, torch.device("cpu"))
    batch.prepare([item])
    sched.complete_step(out)
    seq.output_token_ids += [11, 30]
    assert sched.settle_drafts(seq)
    builder.truncate(seq.seq_id, len(seq.block_table))
    seq.spec_token_ids = [40, 41, 42, 43, 44, 45]  # needs a fourth page again: a new one
    out = sched.schedule()
    (item,) = builder.items(out.scheduled)
    assert item.first_page == 3 and item.block_table == seq.block_table[3:]
    inputs = batch.prepare([item])
    assert batch.pages_of(seq.seq_id) == seq.block_table
    assert inputs.sample_items == (0,) * 7


def test_a_draft_model_gets_the_tokens_its_k_v_lags_by():
    """The drafter runs only in steps that draft, over every item: a prompt computed
    without drafts reaches it at the first drafting step. It writes its K/V for the
    known tokens and its own proposals but the last: after a step that accepted every
    draft, the next item names that last one."""
    draft_kv = DraftKV(every_step=False)
    builder = ItemBuilder(draft_kv)
    sched = _scheduler()
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6, 7])  # 8 tokens, 7 computed, without drafts
    out = sched.schedule()
    (item,) = builder.items(out.scheduled)  # a step without drafts
    assert item.draft_lag == []  # the drafter skips it: nothing to send
    sched.complete_step(out)
    draft_kv.settle(out.scheduled)
    assert seq.draft_computed == -1
    seq.output_token_ids.append(10)
    seq.spec_token_ids = [0, 0, 0]  # stand-ins
    out = sched.schedule()
    (item,) = builder.items(out.scheduled)
    assert item.draft_lag == [1, 2, 3, 4, 5, 6, 7, 9] and item.start == 8
    assert item.token_ids == [10, 0, 0, 0] and item.num_spec == 3
    sched.complete_step(out)
    draft_kv.settle(out.scheduled)
    assert seq.draft_computed == 11  # the known tokens, drafts 1 and 2
    seq.output_token_ids += [21, 22, 23, 24]  # all three accepted, and one more
    sched.settle_drafts(seq)
    assert seq.num_computed_tokens == 12
    seq.spec_token_ids = [0]
    out = sched.schedule()
    (item,) = builder.items(out.scheduled)
    assert (item.start, item.token_ids, item.draft_lag) == (12, [24, 0], [23])
    # without a draft model nothing lags
    assert ItemBuilder().items([ScheduledSeq(seq, 12, 2, (0,))])[0].draft_lag == []
    # an EAGLE head runs every step and trusts the cache: it starts where the sequence
    # does, and after each step lacks the positions from that step's start on
    eagle = DraftKV(every_step=True)
    sched.complete_step(out)
    seq.output_token_ids += [25]  # its draft rejected
    sched.settle_drafts(seq)
    fresh = make_seq(SamplingParams(), prompt=[1, 2, 3])
    assert eagle.lag(fresh, 3) == [] and fresh.draft_computed == 3
    eagle.settle([ScheduledSeq(seq, 12, 2, (0,))])
    assert seq.draft_computed == 12 and eagle.lag(seq, 13) == [24]


def test_the_input_batch_samples_every_draft_position_in_order():
    batch = InputBatch(4, torch.device("cpu"))
    items = [StepItem(0, [1, 2, 3], 0, [0], True),
             StepItem(1, [7, 20, 21], 5, [1, 2], True, num_spec=2),
             StepItem(2, [4, 5], 0, [3], False),
             StepItem(3, [8, 30], 9, [4, 5, 6], True, num_spec=1)]
    inputs = batch.prepare(items)
    assert inputs.sample_items == (0, 1, 1, 1, 3, 3)
    assert inputs.sample_rows.tolist() == [2, 3, 4, 5, 8, 9]
    assert inputs.positions.tolist() == [0, 1, 2, 5, 6, 7, 0, 1, 9, 10]


# -- the speculator ------------------------------------------------------------------------
class _Matcher:
    """Allows tokens below 20 only."""

    def num_valid(self, tokens: list[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t >= 20), len(tokens))


def test_drafts_never_outgrow_the_length_limit_nor_the_grammar_and_stop_at_batch_size():
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 2, disable_by_batch_size=3))
    text = [5, 6, 7, 8, 25, 9, 5, 6]  # "5 6" recurs: 7 8 25 9 follows it
    free = make_seq(SamplingParams(), prompt=text)
    short = make_seq(SamplingParams(), prompt=text, max_num_tokens=len(text) + 3)
    done = make_seq(SamplingParams(), prompt=text, max_num_tokens=len(text) + 1)
    held = make_seq(SamplingParams(), prompt=text)
    thinking = make_seq(SamplingParams(), prompt=text)
    seqs = [free, short, done, held, thinking]
    spec.propose(seqs, num_running=2, matchers={held.seq_id: _Matcher()},
                 thinking={thinking.seq_id})
    assert free.spec_token_ids == [7, 8, 25, 9]
    assert short.spec_token_ids == [7, 8]  # two drafts and one sampled token fill it
    assert done.spec_token_ids == []
    assert held.spec_token_ids == [7, 8]  # the grammar allows no 25
    assert thinking.spec_token_ids == []
    spec.propose(seqs, num_running=3, matchers={}, thinking=set())
    assert all(s.spec_token_ids == [] for s in seqs)


def test_token_arrays_follow_each_sequence_as_it_grows():
    from quire.engine.speculation import TokenArrays

    arrays = TokenArrays()
    seq = make_seq(SamplingParams(), prompt=list(range(50)))
    assert arrays.of(seq).tolist() == seq.token_ids
    for step in range(100):  # past the first capacity, twice
        seq.output_token_ids += [step, step + 1][: 1 + step % 2]
        assert arrays.of(seq).tolist() == seq.token_ids
    arrays.forget(seq.seq_id)
    assert len(arrays) == 0


def test_acceptance_counts_per_position():
    spec = Speculator(SpeculativeConfig("ngram", 3, 1, 1))
    spec.stats.record(3, 2)
    spec.stats.record(2, 0)
    spec.stats.record(0, 0)
    assert (spec.stats.num_drafts, spec.stats.num_draft_tokens,
            spec.stats.num_accepted_tokens, spec.stats.accepted_per_pos) == (2, 5, 2, [1, 1, 0])


# -- configuration and metrics ---------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"\.model must name"),
    ({"method": "mtp", "model": "x", "num_speculative_tokens": 2},
     r"\.model does not apply to method 'mtp'"),
    ({"method": "mimo_mtp", "num_speculative_tokens": 2, "quantization": "int8"},
     r"\.quantization does not apply to method 'mtp'"),
    ({"method": "mtp", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"\.model must name the draft"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2},
     r"\.model does not apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "dtype": "bfloat16"},
     r"\.quantization and \.dtype apply to a draft model"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "quantization": "int3"},
     r"speculative_config\.quantization must be one of"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "dtype": "float8"},
     r"speculative_config\.dtype must be"),
    ({"model": "some/draft", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ("{not json", "JSON object"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=value)


def test_vllm_defaults_and_the_json_form():
    assert EngineConfig(model="m", speculative_config='{"method": "ngram", '
                        '"num_speculative_tokens": 3}').speculative_config == \
        SpeculativeConfig("ngram", 3, 5, 5, disable_by_batch_size=40)
    always = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                      "disable_by_batch_size": None})
    assert always.disable_by_batch_size is None
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    # with async scheduling: synchronous steps while drafts are due (EngineCore.step)
    EngineConfig(model="m", async_scheduling=True,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # a model alone means a draft model, vLLM's way
    draft = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 4,
                                     "quantization": "int8", "dtype": "bfloat16"})
    assert (draft.method, draft.model, draft.quantization, draft.dtype) == \
        ("draft_model", "d", "int8", "bfloat16")
    # a draft model runs on the first stage, an EAGLE, EAGLE-3 or MTP head on the last
    # (the integration tests compare outputs)
    for spec in ({"model": "d"}, {"method": "eagle", "model": "d"},
                 {"method": "eagle3", "model": "d"}, {"method": "mtp"}):
        EngineConfig(model="m", pipeline_parallel_size=2,
                     speculative_config={**spec, "num_speculative_tokens": 3})
    # heads too: their K/V kept in asynchronous steps from the pending tokens on the
    # device (tests/integration/test_eagle.py and test_mtp.py compare outputs)
    for method in ("eagle", "eagle3"):
        EngineConfig(model="m", async_scheduling=True, speculative_config={
            "method": method, "model": "d", "num_speculative_tokens": 3})
    # vLLM's older per-family names are its "mtp"
    for name in ("mtp", "mimo_mtp", "deepseek_mtp"):
        assert SpeculativeConfig.parse({"method": name, "num_speculative_tokens": 2}) \
            .method == "mtp"
    EngineConfig(model="m", async_scheduling=True, speculative_config={
        "method": "mtp", "num_speculative_tokens": 3})
    EngineConfig(model="m", pipeline_parallel_size=2,  # n-gram drafts run with stages
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_the_cli_flag_names_itself_in_its_error():
    import argparse

    from quire.entrypoints.cli.common import UsageError
    from quire.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 99}'])
    with pytest.raises(UsageError, match="--speculative-config"):
        engine_config_from_args(args)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 2


def test_metrics_carry_vllm_s_spec_decode_counters():
    from quire.entrypoints.server.metrics import ServerMetrics

    stats = EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, num_used_blocks=0,
                        num_blocks=1, num_preemptions=0, prefix_queries=0, prefix_hits=0,
                        has_unfinished=False, spec_num_drafts=4, spec_num_draft_tokens=12,
                        spec_num_accepted_tokens=5, spec_accepted_per_pos=[3, 2, 0])
    text = ServerMetrics(max_model_len=64).render([stats], {})
    assert 'quire:spec_decode_num_drafts_total{engine="0"} 4.0' in text
    assert 'quire:spec_decode_num_draft_tokens_total{engine="0"} 12.0' in text
    assert 'quire:spec_decode_num_accepted_tokens_total{engine="0"} 5.0' in text
    assert ('quire:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2.0'
            in text)


def test_bench_serve_reads_the_counters_from_either_server_s_metrics():
    """What ``quire bench serve`` scrapes around a pass: our /metrics summed over
    engines, and vLLM's names; a server without them gives none."""
    from quire.bench.serve import spec_counts
    from quire.bench.stats import SpecCounts, spec_figures
    from quire.entrypoints.server.metrics import ServerMetrics

    def stats(drafts: int, proposed: int, accepted: int, per_pos: list[int]) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, num_used_blocks=0,
                           num_blocks=1, num_preemptions=0, prefix_queries=0, prefix_hits=0,
                           has_unfinished=False, spec_num_drafts=drafts,
                           spec_num_draft_tokens=proposed, spec_num_accepted_tokens=accepted,
                           spec_accepted_per_pos=per_pos)

    text = ServerMetrics(max_model_len=64).render(
        [stats(4, 12, 5, [3, 2, 0]), stats(2, 6, 4, [2, 1, 1])], {})
    ours = spec_counts(text)
    assert ours == SpecCounts(6, 18, 9, (5, 3, 1))
    vllm = spec_counts('# TYPE vllm:spec_decode_num_drafts counter\n'
                       'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0\n'
                       'vllm:spec_decode_num_draft_tokens_total{engine="0"} 6.0\n'
                       'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 3.0\n'
                       'vllm:spec_decode_num_accepted_tokens_per_pos_total'
                       '{engine="0",position="0"} 2.0\n'
                       'vllm:spec_decode_num_accepted_tokens_per_pos_total'
                       '{engine="0",position="1"} 1.0\n')
    assert vllm == SpecCounts(2, 6, 3, (2, 1))
    assert spec_counts(ServerMetrics(max_model_len=64).render(
        [stats(0, 0, 0, [])], {})) is None
    figures = spec_figures(vllm, ours)
    assert figures["spec_acceptance_rate"] == pytest.approx(6 / 12)
    assert figures["spec_mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert figures["spec_acceptance_rate_pos0"] == pytest.approx(3 / 4)
    assert figures["spec_acceptance_rate_pos2"] == pytest.approx(1 / 4)


def test_a_draft_model_skips_sequences_first_stepped_under_load_and_hopeless_catch_ups():
    """A draft model's rules: a sequence first proposed for while some wait and running
    + waiting reach disable_by_batch_size never drafts, even once the batch is small;
    one whose draft lags by more tokens than it has left (and than a drafting step
    leaves) stops drafting; n-gram keeps only the per-step switch."""
    from quire.engine.speculation import DRAFT_STAND_IN, Speculator
    from quire.spec.config import SpeculativeConfig

    config = SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": 2,
                                      "disable_by_batch_size": 4})
    spec = Speculator(config)

    def seq(i: int, prompt: int, max_tokens: int) -> Sequence:
        return Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(range(prompt)),
                        params=SamplingParams(max_tokens=max_tokens), arrival=i,
                        max_num_tokens=prompt + max_tokens)

    loaded, alone, full = seq(0, 8, 32), seq(1, 8, 32), seq(3, 8, 32)
    spec.propose([full], num_running=5, matchers={}, thinking=set())
    assert full.spec_token_ids == []  # the per-step switch: a full batch, none waiting
    spec.propose([full], num_running=1, matchers={}, thinking=set())
    assert full.spec_token_ids == [DRAFT_STAND_IN] * 2  # it was never under a queue
    late = seq(4, 8, 32)  # first stepped in a full batch, then sat out 20 tokens
    spec.propose([late], num_running=5, matchers={}, thinking=set())
    late.output_token_ids.extend([5] * 21)
    spec.propose([late], num_running=1, matchers={}, thinking=set())
    assert late.spec_token_ids == []  # 29 tokens to catch up, 10 left to produce
    spec.propose([loaded], num_running=2, matchers={}, thinking=set(), num_waiting=2)
    assert loaded.spec_token_ids == []
    spec.propose([loaded], num_running=1, matchers={}, thinking=set())
    assert loaded.spec_token_ids == []  # decided at its first proposal
    spec.propose([alone], num_running=1, matchers={}, thinking=set(), num_waiting=2)
    assert alone.spec_token_ids == [DRAFT_STAND_IN] * 2
    alone.draft_computed = 9  # it drafted once: the lag a drafting step leaves is fine
    alone.output_token_ids.extend([5] * 3)
    spec.propose([alone], num_running=1, matchers={}, thinking=set())
    assert alone.spec_token_ids == [DRAFT_STAND_IN] * 2
    alone.output_token_ids.extend([5] * 21)  # then it sat out while its output grew
    spec.propose([alone], num_running=1, matchers={}, thinking=set())
    assert alone.spec_token_ids == []  # 23 tokens to catch up, 7 left to produce
    ngram = Speculator(SpeculativeConfig.parse({"method": "ngram",
                                                "num_speculative_tokens": 2,
                                                "prompt_lookup_min": 2,
                                                "prompt_lookup_max": 3,
                                                "disable_by_batch_size": 4}))
    repeat = seq(2, 8, 32)
    repeat.output_token_ids.extend([0, 1, 2])
    ngram.propose([repeat], num_running=2, matchers={}, thinking=set(), num_waiting=9)
    ngram.propose([repeat], num_running=1, matchers={}, thinking=set())
    assert repeat.spec_token_ids  # the per-step switch only
