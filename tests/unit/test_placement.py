"""Placement across data-parallel replicas: least loaded first, prompts sharing their first
full pages back to the replica that holds them, unless it is busier than the slack."""

from __future__ import annotations

from quire.engine.messages import EngineStats
from quire.engine.placement import PREFIX_PAGES, Placement


def _stats(running: int = 0, waiting: int = 0, kv: float = 0.0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_usage=kv,
                       num_used_blocks=0, num_blocks=100, num_preemptions=0,
                       prefix_queries=0, prefix_hits=0, has_unfinished=running > 0)


def test_one_replica_takes_everything():
    p = Placement(1, block_size=4)
    assert {p.place(list(range(i, i + 9)), [None]) for i in range(5)} == {0}


def test_least_loaded_replica_wins_and_waiting_counts_double():
    p = Placement(3, block_size=4)
    stats = [_stats(running=4), _stats(running=1, waiting=2), _stats(running=3)]
    assert p.place([1, 2], stats) == 2  # loads 4, 5, 3
    # placed-but-not-yet-reported requests count: replica 2 now weighs 4, like replica 0
    assert p.place([3, 4], stats) == 0  # ties go to the replica placed on less


def test_requests_placed_since_the_last_report_count_until_the_next():
    p = Placement(2, block_size=4)
    stats = [_stats(), _stats()]
    first = [p.place([i], stats) for i in range(6)]
    assert sorted(first) == [0, 0, 0, 1, 1, 1]  # alternates while nothing is reported
    p.saw_stats(0)  # replica 0 reported (stats say idle): its placed count is reset
    assert p.place([9], stats) == 0


def test_a_shared_prefix_goes_back_to_its_replica():
    p = Placement(2, block_size=4)
    system = list(range(100, 100 + 4 * PREFIX_PAGES))
    stats = [_stats(), _stats()]
    first = p.place(system + [1, 2, 3], stats)
    other = p.place([7, 8, 9, 10, 11], stats)  # unrelated: goes to the other replica
    assert other != first
    # the same first pages, whatever follows, and although the other replica is idler
    stats[first] = _stats(running=2)
    assert p.place(system + [50, 51], stats) == first
    assert p.by_prefix == 1


def test_only_the_first_pages_name_a_prefix():
    p = Placement(2, block_size=4)
    stats = [_stats(), _stats()]
    head = list(range(4 * PREFIX_PAGES))
    a = p.place(head + [1] * 8, stats)
    b = p.place(head + [2] * 8, stats)  # differs only after PREFIX_PAGES pages
    assert a == b


def test_load_beyond_the_slack_moves_a_prefix():
    p = Placement(2, block_size=4, slack=2.0)
    prompt = list(range(40))
    stats = [_stats(), _stats()]
    home = p.place(prompt, stats)
    p.saw_stats(home)
    stats[home] = _stats(running=3)  # 3 > 0 + slack
    moved = p.place(prompt, stats)
    assert moved != home
    p.saw_stats(moved)
    stats[home], stats[moved] = _stats(), _stats(running=1)
    assert p.place(prompt, stats) == moved  # the prefix now lives where it moved


def test_prompts_shorter_than_a_page_have_no_affinity():
    p = Placement(2, block_size=16)
    stats = [_stats(), _stats()]
    assert [p.place([1, 2, 3], stats) for _ in range(4)] == [0, 1, 0, 1]
    assert p.by_prefix == 0
