"""A small Prometheus registry: counters, gauges and histograms, rendered in the text
exposition format, version 0.0.4.

Not thread-safe: one thread owns a registry, observes into it and renders it (the
server's engine thread; see :mod:`quire.entrypoints.server.metrics`). A metric with label names keeps
one child per combination of label values, made on first use by :meth:`_Family.labels`;
a metric without labels is used directly (``counter.inc()``).

Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

#: The ``Content-Type`` of :meth:`Registry.render`'s text.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class Counter:
    """A value that only goes up (one child of a counter family)."""

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """:raises ValueError: for a negative amount (a counter never goes down)."""
        if amount < 0:
            raise ValueError(f"a counter only goes up; got inc({amount})")
        self.value += amount

    def sync(self, total: float) -> None:
        """Mirror a count that something else owns: become ``total``.

        :raises ValueError: when ``total`` is below the current value.
        """
        if total < self.value:
            raise ValueError(f"a counter only goes up; got sync({total}) at {self.value}")
        self.value = float(total)

    def samples(self, name: str) -> Iterator[tuple[str, str, float]]:
        yield name, "", self.value


class Gauge:
    """A value that goes up and down (one child of a gauge family)."""

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def samples(self, name: str) -> Iterator[tuple[str, str, float]]:
        yield name, "", self.value


class Histogram:
    """Counts of observations per bucket, with their sum (one child of a histogram family).

    Bucket ``i`` counts observations ``<= bounds[i]``; rendered cumulatively with a last
    ``+Inf`` bucket equal to ``_count``.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str) -> Iterator[tuple[str, str, float]]:
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            yield f"{name}_bucket", f'le="{_format_value(bound)}"', running
        yield f"{name}_sum", "", self.sum
        yield f"{name}_count", "", self.count


M = TypeVar("M", Counter, Gauge, Histogram)


class _Family(Generic[M]):
    """One named metric: its help, type, label names and a child per label values."""

    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid metric name")
        bad = [n for n in labelnames if not _LABEL_NAME.fullmatch(n) or n.startswith("__")]
        if bad:
            raise ValueError(f"{name}: invalid label names {bad}")
        self.name, self.help = name, help
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], M] = {}
        if not self.labelnames:
            self.labels()  # an unlabelled metric shows 0 before its first observation

    def _new_child(self) -> M:
        raise NotImplementedError

    def labels(self, **values: str) -> M:
        """The child for these label values (every label name, no other); made on first use.

        :raises ValueError: when the names differ from the family's label names.
        """
        if set(values) != set(self.labelnames):
            raise ValueError(f"{self.name} has labels {list(self.labelnames)}, "
                             f"got {sorted(values)}")
        key = tuple(str(values[n]) for n in self.labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _only(self) -> M:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {list(self.labelnames)}; "
                             "use .labels(...) first")
        return self._children[()]

    def render(self) -> Iterator[str]:
        yield f"# HELP {self.name} {_escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.kind}"
        for key, child in self._children.items():
            own = ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(self.labelnames, key))
            for sample, extra, value in child.samples(self.name):
                labels = ",".join(part for part in (own, extra) if part)
                braces = f"{{{labels}}}" if labels else ""
                yield f"{sample}{braces} {_format_value(value)}"


class CounterFamily(_Family[Counter]):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        # the 0.0.4 format names a counter's sample like its family: keep the suffix
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in '_total'; got {name!r}")
        super().__init__(name, help, labelnames)

    def _new_child(self) -> Counter:
        return Counter()

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def sync(self, total: float) -> None:
        self._only().sync(total)

    @property
    def value(self) -> float:
        return self._only().value


class GaugeFamily(_Family[Gauge]):
    kind = "gauge"

    def _new_child(self) -> Gauge:
        return Gauge()

    def set(self, value: float) -> None:
        self._only().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    @property
    def value(self) -> float:
        return self._only().value


class HistogramFamily(_Family[Histogram]):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or not all(math.isfinite(b) for b in bounds) or any(
                a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name}: buckets must be finite and strictly increasing, "
                             f"got {list(buckets)}")
        if "le" in labelnames:
            raise ValueError(f"{name}: 'le' is the bucket label; choose another label name")
        self.bounds = bounds
        super().__init__(name, help, labelnames)

    def _new_child(self) -> Histogram:
        return Histogram(self.bounds)

    def observe(self, value: float) -> None:
        self._only().observe(value)

    @property
    def count(self) -> int:
        return self._only().count


F = TypeVar("F", CounterFamily, GaugeFamily, HistogramFamily)


class Registry:
    """Owns metric families by name and renders them in the order they were added.

    Each method raises ``ValueError`` for an invalid or repeated name or label name.
    """

    def __init__(self) -> None:
        self._families: dict[str, CounterFamily | GaugeFamily | HistogramFamily] = {}

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> CounterFamily:
        """A counter; its ``name`` must end in ``_total``."""
        return self._add(CounterFamily(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> GaugeFamily:
        return self._add(GaugeFamily(name, help, labelnames))

    def histogram(self, name: str, help: str, buckets: Sequence[float],
                  labelnames: Sequence[str] = ()) -> HistogramFamily:
        """A histogram with these finite, strictly increasing upper bounds (``+Inf`` is
        added); no label may be called ``le``."""
        return self._add(HistogramFamily(name, help, buckets, labelnames))

    def _add(self, family: F) -> F:
        if family.name in self._families:
            raise ValueError(f"a metric named {family.name!r} already exists")
        self._families[family.name] = family
        return family

    def render(self) -> str:
        """Every metric in the text format (ends with a newline)."""
        lines = [line for family in self._families.values() for line in family.render()]
        return "\n".join(lines) + "\n"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
