"""``quire plugins``: every discovered platform, its status, and what ``auto`` would pick."""

from __future__ import annotations

import argparse
from typing import Any

from quire.entrypoints.cli.common import open_registry
from quire.plugins.registry import PlatformEntry, PlatformRegistry

_HEADER = ("PLATFORM", "PLUGIN", "DISTRIBUTION", "API", "DESCRIPTION", "STATUS")


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list platform plugins and whether each can run here",
        description="List every discovered platform, whether it is available here, "
        "and which one --device auto would choose.",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    registry = open_registry(args)
    rows = [_HEADER, *(_row(registry, entry) for entry in registry.entries())]
    for line in _table(rows):
        print(line)
    for line in _details(registry):
        print(line)
    for note in _notes(registry):
        print(note)
    print(_auto_line(registry))
    return 0


def _row(registry: PlatformRegistry, entry: PlatformEntry) -> tuple[str, ...]:
    if entry.refused is not None:
        status = f"refused: {entry.refused}"
    else:
        availability = registry.availability(entry.name)
        status = "available" if availability else f"unavailable: {availability.reason}"
    distribution = f"{entry.distribution}=={entry.version}"
    return (entry.name, entry.plugin, distribution, entry.api_version, entry.description, status)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    # The last column (status) is not padded: it can be a long sentence.
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows]


def _details(registry: PlatformRegistry) -> list[str]:
    """What each available platform says it would run here (:meth:`Platform.details`)."""
    return [f"{entry.name}: {line}" for entry in registry.entries()
            if entry.refused is None and registry.availability(entry.name)
            for line in registry.create(entry.name).details()]


def _notes(registry: PlatformRegistry) -> list[str]:
    notes = [
        f"broken: plugin '{b.plugin}' ({b.distribution}=={b.version}): {b.error}"
        for b in registry.broken()
    ]
    installed = {info.plugin for info in registry.disabled()}
    notes += [f"disabled: {info}" for info in registry.disabled()]
    missing = sorted(registry.blocked - installed)
    notes += [f"disabled: plugin '{name}' (not installed)" for name in missing]
    return notes


def _auto_line(registry: PlatformRegistry) -> str:
    try:
        return f"--device auto would choose: {registry.auto_choice()}"
    except RuntimeError as exc:
        return f"--device auto would fail: {exc}"
