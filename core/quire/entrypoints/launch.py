"""The first step of the ``quire`` console script and of the processes Quire starts
(engine cores, workers, API servers): their code imported without full garbage
collections, and what the imports made frozen.

Importing torch, transformers and the engine makes a few hundred thousand objects that
live as long as the process. CPython's full collections walk them again and again while
they are being made (several during the imports of a cold start), and every later full
collection walks them again, to find nothing. The imports run with the young
generations collected as usual (their short-lived cycles freed, so the peak stays
where it was) but no full collection; then what they made goes to the permanent
generation (``gc.freeze``), and the collector runs as before for all that is made after
it. The figures are in docs/bench.md ("Start-up").
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

#: A third-generation threshold no import reaches: no full collection while importing.
_NEVER = 1 << 30


@contextlib.contextmanager
def _importing() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds[:2], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.freeze()


def imported(module: str, name: str) -> Any:
    """``module``'s attribute ``name``, the module imported as said above (the
    bootstraps of the processes Quire starts call this first)."""
    with _importing():
        return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    """Import :mod:`quire.entrypoints.cli` as said above, then run ``quire`` with
    ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    return imported("quire.entrypoints.cli", "main")(argv)
