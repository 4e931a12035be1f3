"""One throughput workload over several values of one engine option, as a table and a plot.

Each value gets a fresh engine (built after the previous one is released), so the peak
resident memory and KV pool of every point are its own.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quire.bench.quire_engine import build_engine, describe
from quire.bench.stats import median_figures
from quire.bench.throughput import run_quire
from quire.bench.workloads import BenchRequest
from quire.config import EngineConfig
from quire.plugins.registry import PlatformRegistry

#: Engine options a sweep may vary: integers, one value per point.
SWEEPABLE = ("block_size", "max_num_batched_tokens", "max_num_seqs")


@dataclass(frozen=True)
class SweepPoint:
    """The median figures of one value."""

    value: int
    figures: dict[str, float]
    description: str


def parse_values(text: str) -> list[int]:
    """``"8,16,32"`` -> ``[8, 16, 32]``. :raises ValueError: naming the bad item."""
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"expected comma-separated integers >= 1, got {item!r} in {text!r}")
        values.append(int(item))
    if len(set(values)) != len(values):
        raise ValueError(f"a value is repeated in {text!r}")
    return values


def run_sweep(config: EngineConfig, param: str, values: Sequence[int],
              runs: Sequence[list[BenchRequest]], registry: PlatformRegistry,
              warmup: int = 0) -> list[SweepPoint]:
    """Throughput of every pass in ``runs`` at each value of ``param``: the median over
    the passes after the first ``warmup`` (which run untimed, to warm the new engine up).

    :raises ValueError: for a parameter that cannot be swept, or a value the engine refuses.
    """
    if param not in SWEEPABLE:
        raise ValueError(f"cannot sweep {param!r}; sweepable: {', '.join(SWEEPABLE)}")
    points = []
    for value in values:
        change: dict[str, Any] = {param: value}
        engine = build_engine(dataclasses.replace(config, **change), registry)
        results = [run_quire(engine, requests).figures() for requests in runs][warmup:]
        points.append(SweepPoint(value, median_figures(results), describe(engine)))
        del engine
        gc.collect()
    return points


def plot(points: Sequence[SweepPoint], param: str, path: str | Path, title: str) -> None:
    """Throughput and KV memory against the swept value, as a PNG at ``path``.

    Uses matplotlib's object API with the Agg canvas: no pyplot, no global figure state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [str(p.value) for p in points]
    xs = list(range(len(points)))
    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    speed, memory = fig.subplots(1, 2)
    for key, label in (("output_tokens_per_s", "output tokens/s"),
                       ("total_tokens_per_s", "total tokens/s")):
        speed.plot(xs, [p.figures.get(key) for p in points], marker="o", label=label)
    speed.set_ylabel("tokens/s")
    for key, label in (("peak_kv_mib", "KV in use at peak"), ("kv_pool_mib", "KV pool")):
        memory.plot(xs, [p.figures.get(key) for p in points], marker="o", label=label)
    memory.set_ylabel("MiB")
    for ax in (speed, memory):
        ax.set_xticks(xs, labels)
        ax.set_xlabel(param.replace("_", "-"))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
