"""StopMatcher: the same answers as the engine's former linear search (find_stop, kept
here as the reference), delta by delta."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quire.engine.stop_strings import StopMatcher


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The reference the automaton must agree with (the engine's matcher before it):
    the earliest stop string that ends inside the last ``new_chars`` characters.

    :returns: (index where it starts, the stop string), or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def _stop_lists(alphabet: str) -> st.SearchStrategy[tuple[str, ...]]:
    word = st.text(alphabet, min_size=1, max_size=5)
    return st.lists(word, min_size=1, max_size=6, unique=True).map(tuple)


def _deltas(alphabet: str) -> st.SearchStrategy[list[tuple[str, bool]]]:
    delta = st.tuples(st.text(alphabet, max_size=6), st.booleans())
    return st.lists(delta, max_size=12)


def _check_against_find_stop(stops: tuple[str, ...], deltas: list[tuple[str, bool]]) -> None:
    matcher = StopMatcher(stops)
    scan = matcher.start()
    text = ""
    for delta, report in deltas:
        text += delta
        expected = find_stop(text, len(delta), stops) if report else None
        assert matcher.feed(scan, delta, report) == expected, (text, delta)
    assert scan.fed == len(text)


@settings(max_examples=300, deadline=None)
@given(stops=_stop_lists("ab c\n"), deltas=_deltas("ab c\n"))
def test_agrees_with_find_stop(stops, deltas):
    _check_against_find_stop(stops, deltas)


@settings(max_examples=300, deadline=None)
@given(stops=_stop_lists("aé😀\u0301"), deltas=_deltas("aé😀\u0301"))
def test_agrees_with_find_stop_beyond_ascii(stops, deltas):
    _check_against_find_stop(stops, deltas)


def test_no_stops_match_nothing():
    matcher = StopMatcher(())
    scan = matcher.start()
    assert matcher.longest == 0
    assert matcher.feed(scan, "anything at all") is None
    assert scan.fed == len("anything at all")


def test_longest_and_rejected_stops():
    assert StopMatcher(("a", "abcd", "xy")).longest == 4
    with pytest.raises(ValueError, match=r"stop string 1 must be a non-empty str"):
        StopMatcher(("a", ""))


def test_empty_delta_reports_nothing_and_keeps_state():
    matcher = StopMatcher(("ab",))
    scan = matcher.start()
    assert matcher.feed(scan, "xa") is None
    assert matcher.feed(scan, "") is None
    assert matcher.feed(scan, "b") == (1, "ab")


@pytest.mark.parametrize(
    "stops, text, expected",
    [
        (("ab", "abc"), "xabc", (1, "ab")),  # prefix, same start: first listed wins
        (("abc", "ab"), "xabc", (1, "abc")),
        (("bc", "abc"), "xabc", (1, "abc")),  # suffix
        (("b", "abc"), "xabc", (1, "abc")),  # substring: the later-ending one starts first
        (("cd", "bcde"), "abcdef", (1, "bcde")),
        (("aa", "aaa"), "aaaa", (0, "aa")),
    ],
)
def test_nested_stops_pick_earliest_start(stops, text, expected):
    matcher = StopMatcher(stops)
    assert matcher.feed(matcher.start(), text) == expected == find_stop(text, len(text), stops)


@pytest.mark.parametrize("report_first", [True, False])
def test_match_straddling_two_deltas(report_first):
    matcher = StopMatcher(("abc", "zz"))
    scan = matcher.start()
    assert matcher.feed(scan, "xab", report_first) is None
    assert matcher.feed(scan, "cd") == (1, "abc")


def test_match_ending_before_the_delta_is_not_reported_again():
    matcher = StopMatcher(("ab",))
    scan = matcher.start()
    assert matcher.feed(scan, "ab", report=False) is None
    assert matcher.feed(scan, "c") is None


def test_one_matcher_shared_by_independent_scans():
    matcher = StopMatcher(("stop",))
    first, second = matcher.start(), matcher.start()
    assert matcher.feed(first, "st") is None
    assert matcher.feed(second, "xxxxst") is None
    assert matcher.feed(first, "op") == (0, "stop")
    assert matcher.feed(second, "op") == (4, "stop")


def test_hundred_thousand_stops():
    stops = tuple(f"<{i:05d}>" for i in range(100_000))
    matcher = StopMatcher(stops)
    scan = matcher.start()
    filler = "<1234 5678> " * 40
    for _ in range(10):
        assert matcher.feed(scan, filler) is None
    text = filler * 10 + "<99999"
    assert matcher.feed(scan, "<99999") is None
    text += "> and <00000>"
    expected = (len(text) - len("> and <00000>") - len("<99999"), "<99999>")
    assert matcher.feed(scan, "> and <00000>") == expected
    assert find_stop(text, len("> and <00000>"), stops) == expected
