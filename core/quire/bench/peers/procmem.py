"""Peak resident memory of a process and its children, from Linux's ``/proc``.

Standard library only: the peer workers import this file from their own virtual
environments, where quire is not installed.

``VmHWM`` is a process's resident-set high-water mark. Writing ``5`` to
``/proc/PID/clear_refs`` resets it to the current resident set, so a peak can be taken
over one measured run instead of the process's whole life (model loading often peaks
higher than generating). Peers such as vLLM run their engine in a child process, so the
peak of a run is summed over the process and all its descendants; memory the processes
share (shared-memory buffers, the same mapped file) is then counted once per process, so
the sum is an upper bound.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def _status_kib(pid: int, field: str) -> int | None:
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except OSError:  # the process ended, or no /proc
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir(_PROC) if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            stat = (_PROC / entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may contain spaces; the parent id follows its ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def peak_rss_bytes(pid: int | None = None, include_children: bool = True) -> int | None:
    """``VmHWM`` of ``pid`` (default: this process), plus its descendants' if asked.

    :returns: None where ``/proc`` cannot tell (not Linux).
    """
    pid = os.getpid() if pid is None else pid
    own = _status_kib(pid, "VmHWM")
    if own is None:
        return None
    total = own
    if include_children:
        total += sum(_status_kib(child, "VmHWM") or 0 for child in descendants(pid))
    return total * 1024


def reset_peak_rss(pid: int | None = None, include_children: bool = True) -> bool:
    """Reset ``VmHWM`` to the current resident set. :returns: False if it could not be
    reset for every process (then a peak is over the process's life so far)."""
    pid = os.getpid() if pid is None else pid
    pids = [pid] + (descendants(pid) if include_children else [])
    ok = True
    for p in pids:
        try:
            (_PROC / str(p) / "clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok
