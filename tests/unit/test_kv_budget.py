"""One KV budget shared by several models' engines: the fair-share rule, the ledger, the
block manager's limit, and memory given back on the cpu platform."""

from __future__ import annotations

import os

import pytest
import torch
from quire.engine.block_manager import BlockManager
from quire.engine.kv_budget import (
    KVLedger,
    KVShare,
    KVShareSpec,
    SlotState,
    decide,
    fair_shares,
)
from quire.engine.sequence import Sequence
from quire.sampling_params import SamplingParams


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=tokens,
                    params=SamplingParams(max_tokens=4), arrival=seq_id)


# -- the rule ------------------------------------------------------------------------------
@pytest.mark.parametrize(("budget", "wants", "shares"), [
    (100, [0, 0], [0, 0]),
    (100, [30, 0], [30, 0]),
    (100, [30, 200], [30, 70]),
    (100, [200, 200], [50, 50]),
    (100, [10, 200, 200], [10, 45, 45]),
    (90, [40, 40, 40], [30, 30, 30]),
    (100, [20, 30], [20, 30]),
])
def test_fair_shares_are_max_min_fair(budget: int, wants: list[int],
                                      shares: list[int]) -> None:
    assert fair_shares(budget, wants) == shares


def test_a_model_grows_into_free_budget_by_at_least_the_quantum() -> None:
    states = [SlotState(0, 10, True), SlotState(0, 0, True)]
    assert decide(100, 0, states, quantum=25) == 25
    states = [SlotState(0, 40, True), SlotState(70, 0, True)]
    assert decide(100, 0, states, quantum=25) == 30  # only what is free


def test_an_idle_model_keeps_its_cached_pages_until_another_needs_the_room() -> None:
    idle = SlotState(held=80, want=0, alive=True)
    assert decide(100, 0, [idle, SlotState(20, 20, True)], quantum=5) == 80
    # the other wants 60, holds 20, 0 free: the idle one gives back 40 (only that)
    assert decide(100, 0, [idle, SlotState(20, 60, True)], quantum=5) == 40
    # the other wants everything: its fair share is all of it, the idle one keeps none
    assert decide(100, 0, [idle, SlotState(20, 500, True)], quantum=5) == 0


def test_a_busy_model_above_its_share_shrinks_to_it_when_the_other_is_short() -> None:
    big, small = SlotState(90, 200, True), SlotState(10, 200, True)
    assert decide(100, 0, [big, small], quantum=5) == 50
    assert decide(100, 1, [big, small], quantum=5) == 10  # no free budget to grow into
    # nobody short: nothing moves
    assert decide(100, 0, [big, SlotState(10, 10, True)], quantum=5) == 90


def test_a_dead_slot_holds_nothing() -> None:
    gone = SlotState(held=90, want=90, alive=False)
    assert decide(100, 1, [gone, SlotState(0, 50, True)], quantum=5) == 50


# -- the block manager's limit -------------------------------------------------------------
def test_pages_past_the_limit_are_not_handed_out_and_park_when_released() -> None:
    bm = BlockManager(8, 4)
    a = seq(0, list(range(16)))  # 4 pages
    assert bm.allocate(a, 16)
    assert bm.extent == 4 and bm.num_used_blocks == 4
    bm.set_limit(2)
    assert bm.num_free_blocks == 0
    b = seq(1, [7])
    assert not bm.allocate(b, 1)
    bm.check_invariants([a, b])
    assert bm.release_top() is None  # pages 2, 3 are used
    bm.free(a)
    bm.check_invariants([a, b])
    assert bm.release_top() == (2, 4)
    assert bm.extent == 2 and bm.num_free_blocks == 2 and bm.num_used_blocks == 0
    bm.check_invariants([a, b])


def test_lowering_the_limit_evicts_cached_pages_past_it() -> None:
    bm = BlockManager(8, 4)
    a = seq(0, list(range(17)))
    assert bm.allocate(a, 17)
    bm.cache_full_blocks(a, 17)
    bm.free(a)
    assert bm.num_cached_blocks == 4
    bm.set_limit(2)
    assert bm.num_cached_blocks == 2 and bm.num_evictions == 2
    assert bm.release_top() == (2, 5)
    again = seq(1, list(range(17)))
    assert len(bm.find_cached_prefix(again)) == 2  # the prefix below the limit survives
    bm.check_invariants([again])


def test_raising_the_limit_frees_parked_pages_again() -> None:
    bm = BlockManager(8, 4)
    a = seq(0, list(range(24)))
    assert bm.allocate(a, 24)
    bm.set_limit(3)
    bm.free(a)  # pages 3..5 park
    bm.set_limit(8)
    assert bm.num_free_blocks == 8
    b = seq(1, list(range(32)))
    assert bm.allocate(b, 32)
    bm.check_invariants([b])
    assert sorted(b.block_table) == list(range(8))


# -- the ledger and a share ----------------------------------------------------------------
def test_two_pools_share_one_budget_through_the_ledger(tmp_path) -> None:
    """Model 0 fills the budget and goes idle with cached pages; model 1's demand takes
    them back, evicting 0's prefixes, and the budget is never exceeded."""
    path = str(tmp_path / "ledger")
    KVLedger.create(path, 2, budget=0).close()
    bpb = 1000
    shares = [KVShare(KVShareSpec(path, i), bpb) for i in range(2)]
    assert shares[0].budget_bytes(16 * bpb) == 16 * bpb
    assert shares[1].budget_bytes(99 * bpb) == 16 * bpb  # the first engine set it
    pools = [BlockManager(16, 4), BlockManager(16, 4)]
    for pool in pools:
        pool.set_limit(0)

    def held() -> int:
        return sum(s.held for s in shares[0].ledger.slots())

    assert shares[0].tend(pools[0], want_blocks=16) is None
    assert pools[0].limit == 16
    a = seq(0, list(range(64)))
    assert pools[0].allocate(a, 64)
    pools[0].cache_full_blocks(a, 64)
    pools[0].free(a)  # idle, 16 cached pages
    shares[0].tend(pools[0], want_blocks=0)
    assert pools[0].limit == 16 and held() == 16 * bpb

    shares[1].tend(pools[1], want_blocks=6)  # nothing free yet
    assert pools[1].limit == 0
    released = shares[0].tend(pools[0], want_blocks=0)
    assert released == (10, 16) and pools[0].num_cached_blocks == 10
    assert held() <= 16 * bpb
    shares[1].tend(pools[1], want_blocks=6)
    assert pools[1].limit == 6 and held() == 16 * bpb
    for pool in pools:
        pool.check_invariants()
    shares[0].close()
    assert shares[1].ledger.slots()[0].alive is False
    shares[1].close()


def test_a_ledger_file_that_is_not_one_is_refused(tmp_path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a KV budget ledger"):
        KVLedger(str(path))


# -- memory given back (cpu) ---------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux")
def test_the_cpu_backend_gives_released_pages_memory_back() -> None:
    from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend

    backend = CpuSdpaAttentionBackend(prefault="off")
    assert backend.releases_kv_memory
    cache = backend.allocate_kv_cache(512, 16, 4, 64, torch.float32, torch.device("cpu"))
    cache.fill_(1.0)  # 2 x 512 pages of 16 KiB: 16 MiB resident
    before = _rss_bytes()
    backend.release_kv_pages(cache, 256, 512)
    freed = before - _rss_bytes()
    assert freed >= 7 << 20, f"only {freed} bytes went back"
    assert bool((cache[:, :256] == 1.0).all())  # the pages kept are untouched
    # the others read as fresh memory, but for the OS pages they share with a kept page
    assert float((cache[:, 256:] == 0.0).float().mean()) > 0.99
