"""Block manager on its own: pages, tables, ref counts, prefix caching, eviction."""

import random

import pytest
from quire.engine.block_manager import BlockManager
from quire.engine.sequence import Sequence
from quire.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens: list[int]) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(tokens),
                    params=SamplingParams(max_tokens=8), arrival=i)


def compute(bm: BlockManager, seq: Sequence, cached: list[int] | None = None) -> None:
    """Admit ``seq`` whole, as the scheduler would, and mark its K/V computed."""
    cached = cached if cached is not None else bm.find_cached_prefix(seq)
    n_cached = len(cached) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - n_cached, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq, seq.num_tokens)


def test_pages_are_allocated_lazily_as_the_sequence_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq([1, 2, 3])
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    assert bm.allocate(seq, 1)  # 4th token still fits page 0
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    assert bm.allocate(seq, 1)  # 5th token needs page 1
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 6
    bm.check_invariants([seq])


def test_free_returns_every_page_at_once():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    compute(bm, seq)
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    bm.check_invariants([seq])


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)))
    compute(bm, a)
    b = make_seq(list(range(100, 112)))
    before = (bm.num_free_blocks, list(a.block_table))
    assert not bm.allocate(b, 12)  # needs 3 pages, 1 left
    assert (bm.num_free_blocks, a.block_table) == before
    assert b.block_table == []
    bm.check_invariants([a, b])


def test_shared_prefix_reuses_pages_without_copying():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(50, 58))  # two full pages
    a = make_seq(system + [1, 2, 3])
    compute(bm, a)
    b = make_seq(system + [7, 8])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    compute(bm, b, cached)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    for block_id in a.block_table[:2]:
        assert bm.ref_count(block_id) == 2
    bm.check_invariants([a, b])


def test_a_different_earlier_page_breaks_the_chain():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    # same second page, different first page: nothing may be reused
    b = make_seq([9, 9, 3, 4, 5])
    assert bm.find_cached_prefix(b) == []


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)))  # exactly two pages
    compute(bm, a)
    same = make_seq(list(range(8)))
    assert bm.find_cached_prefix(same) == a.block_table[:1]


def test_released_pages_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])  # pages: [1,2] [3,4] [5]
    compute(bm, a)
    a_table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_blocks == 2  # the two full pages
    assert bm.num_free_blocks == 4
    # a new unrelated sequence takes the unnamed free page first, then evicts the
    # cached tail page [3,4] before the prefix page [1,2]
    b = make_seq([7, 8, 9, 10])
    assert bm.allocate(b, 2)
    b.num_computed_tokens = 2
    assert bm.allocate(b, 2)
    assert bm.num_evictions == 0
    assert a_table[2] in b.block_table  # the unnamed page, not a cached one
    assert bm.num_cached_blocks == 2
    # all four pages are now used or cached-but-claimed; ask for more to force eviction
    c = make_seq([11, 12])
    assert bm.allocate(c, 2)
    assert bm.num_evictions == 1
    assert c.block_table == [a_table[1]]  # the tail page went first
    still = make_seq([1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(still) == [a_table[0]]
    bm.check_invariants([b, c])


def test_reviving_a_cached_page_takes_it_from_the_evictable_list():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert bm.allocate(b, 1, cached)
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_revived_pages_count_against_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)  # 2 cached pages + 1 free
    b = make_seq([1, 2, 3, 4, 6, 7, 8, 9])
    cached = bm.find_cached_prefix(b)
    # 2 revived + 2 new > 3 in the pool: must fail and change nothing
    assert not bm.allocate(b, 4, cached)
    assert bm.num_cached_blocks == 2 and b.block_table == []
    bm.check_invariants([a, b])


def test_duplicate_content_keeps_the_first_page_named():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3])
    b = make_seq([1, 2, 3])
    # both computed before either is cached (same step): b's copy stays unnamed
    assert bm.allocate(a, 3) and bm.allocate(b, 3)
    bm.cache_full_blocks(a, 3)
    bm.cache_full_blocks(b, 3)
    assert bm.block_hash(a.block_table[0]) is not None
    assert bm.block_hash(b.block_table[0]) is None
    bm.free(b)
    bm.check_invariants([a])


def test_prefix_caching_off_names_nothing():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []


def test_pages_used_before_are_taken_before_never_used_ones_latest_first():
    """A host pool's never-used page costs a fault at its first write, so a released page
    is handed out again before the pool's untouched part grows."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7])
    compute(bm, a)
    compute(bm, b)
    assert a.block_table + b.block_table == [0, 1, 2, 3]  # never-used pages in id order
    assert bm.num_never_used_blocks == 4
    bm.free(a)  # releases 1, then 0 (last-first)
    c = make_seq([9] * 6)
    compute(bm, c)
    assert c.block_table == [0, 1, 4]  # the latest released first, then page 4
    assert bm.num_never_used_blocks == 3
    bm.check_invariants([b, c])


def test_never_used_pages_are_taken_before_cached_ones_are_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4])
    compute(bm, a)
    bm.free(a)
    b = make_seq([5, 6, 7, 8])
    compute(bm, b)
    assert b.block_table == [2, 3] and bm.num_evictions == 0
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 0])) == [0, 1]
    c = make_seq([9, 9])
    compute(bm, c)
    assert bm.num_evictions == 1 and bm.num_never_used_blocks == 0
    bm.check_invariants([b, c])


def test_invariant_check_catches_a_never_used_page_in_a_table():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2])
    compute(bm, a)
    bm._ref_count[3] = 1  # corrupt on purpose: a page past the used ones, held
    a.block_table.append(3)
    with pytest.raises(AssertionError, match="!= total"):
        bm.check_invariants([a])
    bm._ref_count[3], bm._ref_count[0] = 0, 0  # counts balance, the state does not
    bm._fresh_from = 0
    with pytest.raises(AssertionError, match="past the used ones"):
        bm.check_invariants()


def test_invariant_check_catches_a_wrong_ref_count():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])
    compute(bm, a)
    bm._ref_count[a.block_table[0]] += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([a])


def test_reset_prefix_cache_frees_cached_pages():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    bm.check_invariants([])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_invariants_hold_after_random_operations(seed, block_size):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            seq = make_seq(tokens)
            cached = bm.find_cached_prefix(seq)
            n_cached = len(cached) * block_size
            if bm.allocate(seq, seq.num_tokens - n_cached, cached):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq, seq.num_tokens)
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)  # decode one token
            if bm.allocate(seq, 1):
                seq.output_token_ids.append(rng.randrange(50))
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq, seq.num_computed_tokens)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


class _LookEveryTime(BlockManager):
    """The oracle: names pages by looking at every full page on each call."""

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        self._extend_hashes(seq, num_full)
        for i in range(num_full):
            block_id = seq.block_table[i]
            h = seq.block_hashes[i]
            if self._hash[block_id] is None and h not in self._by_hash:
                self._hash[block_id] = h
                self._by_hash[h] = block_id


def test_a_page_left_unnamed_for_a_duplicate_is_named_once_the_duplicate_goes():
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    assert bm.allocate(a, 3) and bm.allocate(b, 3)
    bm.cache_full_blocks(a, 3)
    bm.cache_full_blocks(b, 3)
    assert bm.block_hash(b.block_table[0]) is None
    bm.free(a)  # a's first page: evictable, then taken for c, which unnames it
    c = make_seq([9] * 6)
    assert bm.allocate(c, 6) and bm.num_evictions == 1
    b.output_token_ids.append(4)
    bm.cache_full_blocks(b, 4)
    assert bm.block_hash(b.block_table[0]) is not None
    assert bm.block_hash(b.block_table[1]) is not None
    bm.check_invariants([b, c])


@pytest.mark.parametrize("seed", range(5))
def test_skipping_named_pages_names_what_looking_at_every_page_names(seed):
    """Two pools driven alike (pages taken in the same order) end every step with the
    same names, though one skips the pages it already named."""
    rng = random.Random(seed)
    pools = BlockManager(num_blocks=16, block_size=2), _LookEveryTime(16, 2)
    live: list[tuple[Sequence, Sequence]] = []
    heads = [[rng.randrange(9) for _ in range(5)] for _ in range(2)]
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(heads)[: rng.randrange(1, 6)] + [rng.randrange(9)]
            pair = make_seq(tokens), make_seq(tokens)
            cached = [bm.find_cached_prefix(s) for bm, s in zip(pools, pair)]
            ok = [bm.allocate(s, s.num_tokens - len(c) * 2, c)
                  for bm, s, c in zip(pools, pair, cached)]
            assert ok[0] == ok[1]
            if ok[0]:
                live.append(pair)
                computed = pair[0].num_tokens - rng.randrange(2)
                for bm, s in zip(pools, pair):
                    s.num_computed_tokens = computed
                    bm.cache_full_blocks(s, computed)
        elif op < 0.8 and live:
            pair = rng.choice(live)
            token = rng.randrange(9)
            if all(bm.allocate(s, 1) for bm, s in zip(pools, pair)):
                for bm, s in zip(pools, pair):
                    s.output_token_ids.append(token)
                    s.num_computed_tokens = s.num_tokens - 1
                    bm.cache_full_blocks(s, s.num_computed_tokens)
        elif live:
            pair = live.pop(rng.randrange(len(live)))
            for bm, s in zip(pools, pair):
                bm.free(s)
            if rng.random() < 0.5:  # preempted: admitted again on what is still cached
                cached = [bm.find_cached_prefix(s) for bm, s in zip(pools, pair)]
                if all(bm.allocate(s, s.num_tokens - len(c) * 2, c)
                       for bm, s, c in zip(pools, pair, cached)):
                    live.append(pair)
                    for bm, s in zip(pools, pair):
                        s.num_computed_tokens = s.num_tokens
                        bm.cache_full_blocks(s, s.num_tokens)
        assert pools[0]._hash == pools[1]._hash and pools[0]._by_hash == pools[1]._by_hash
        assert [p[0].block_table for p in live] == [p[1].block_table for p in live]
        pools[0].check_invariants(p[0] for p in live)
