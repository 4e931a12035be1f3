"""Stop strings found with an Aho-Corasick automaton, at a cost per character that does
not grow with the number of stop strings.

It returns exactly what ``detokenizer.find_stop`` returns: among the stop strings that
end inside the newest delta, the one that starts earliest, ties going to the one listed
first. Among the matches that end at one position the longest starts earliest, so each
node keeps only the longest stop string ending there (the node's own, or the one its
dictionary suffix link points to), and a character costs its goto/failure transitions
plus one comparison.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_ROOT = 0
_NO_STOP = -1


@dataclass(slots=True)
class StopScan:
    """Where one sequence's scan stands: its automaton node and how many characters it
    has fed (the index, in the sequence's text, of the next character)."""

    node: int = _ROOT
    fed: int = 0


class StopMatcher:
    """Built once per request from its stop strings (non-empty, deduplicated) and shared
    by its sequences; immutable after construction, so safe to share between threads."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop string {i} must be a non-empty str, got {stop!r}")
        self._stops = stops
        #: Length of the longest stop string (0 if none).
        self.longest = max(map(len, stops), default=0)
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [_ROOT]
        #: Index in ``stops`` of the longest stop string ending at each node, or _NO_STOP.
        self._out: list[int] = [_NO_STOP]
        for i, stop in enumerate(stops):
            self._insert(stop, i)
        self._link()

    def _insert(self, stop: str, index: int) -> None:
        """Add ``stop`` to the trie; a duplicate keeps the first index, as find_stop does."""
        node = _ROOT
        for ch in stop:
            child = self._goto[node].get(ch)
            if child is None:
                child = len(self._goto)
                self._goto[node][ch] = child
                self._goto.append({})
                self._fail.append(_ROOT)
                self._out.append(_NO_STOP)
            node = child
        if self._out[node] == _NO_STOP:
            self._out[node] = index

    def _link(self) -> None:
        """Set failure links breadth first, and give each node that ends no stop string
        the output of its dictionary suffix link (its nearest proper suffix that does)."""
        queue = deque(self._goto[_ROOT].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                self._fail[child] = self._next(self._fail[node], ch)
                if self._out[child] == _NO_STOP:
                    self._out[child] = self._out[self._fail[child]]
                queue.append(child)

    def _next(self, node: int, ch: str) -> int:
        """The node reached from ``node`` on ``ch``, following failure links."""
        goto, fail = self._goto, self._fail
        while node != _ROOT and ch not in goto[node]:
            node = fail[node]
        return goto[node].get(ch, _ROOT)

    def start(self) -> StopScan:
        """A fresh scan for one sequence, at the start of its text."""
        return StopScan()

    def feed(self, scan: StopScan, delta: str, report: bool = True) -> tuple[int, str] | None:
        """Advance ``scan`` over ``delta``, the text appended to its sequence.

        :param report: False only advances (stops do not apply yet, but a later match
            may start inside this delta).
        :returns: when ``report``, the earliest-starting stop string that ends inside
            ``delta``, as (its start index in all the text fed so far, the stop string);
            otherwise, or if none ends there, None.
        """
        node, end = scan.node, scan.fed
        best_start, best_index = end + len(delta), _NO_STOP
        for ch in delta:
            node = self._next(node, ch)
            end += 1
            index = self._out[node]
            if report and index != _NO_STOP:
                start = end - len(self._stops[index])
                if start < best_start or (start == best_start and index < best_index):
                    best_start, best_index = start, index
        scan.node, scan.fed = node, end
        return None if best_index == _NO_STOP else (best_start, self._stops[best_index])
