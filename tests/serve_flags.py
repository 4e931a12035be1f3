"""What the tests of ``quire serve``'s flags share, beside the ``nothing_loads`` fixture
(``conftest.py``): the one line a refused flag prints."""

from __future__ import annotations


def one_line(capsys) -> str:
    """Standard error, which must be exactly one line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]
