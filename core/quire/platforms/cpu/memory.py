"""Host-RAM readings for the cpu platform, from Linux's /proc (and cgroup v2 limits).

The "device" is system RAM, shared with the OS and every other process, so the readings
are about this process's share of it:

- total / free: ``MemTotal`` / ``MemAvailable`` from ``/proc/meminfo``, each capped by
  the cgroup v2 limit when the process runs in a memory-limited container (where
  ``/proc/meminfo`` still shows the whole host). Without ``/proc``, ``os.sysconf``.
- peak: this process's resident set high-water mark (``VmHWM``), which Linux resets when
  ``5`` is written to ``/proc/self/clear_refs``.
"""

from __future__ import annotations

import os
from pathlib import Path

from quire.interfaces.memory import MemoryProfiler

_GIB = 1 << 30
#: Tokens of the start-up profiling forward on this platform (see ``profile_tokens``).
PROFILE_TOKENS = 256


class CpuMemoryProfiler(MemoryProfiler):
    """Reads host RAM. All figures are bytes.

    :param proc: where procfs is mounted; tests point it at a fake tree.
    :param cgroup: the process's cgroup v2 directory as seen from inside it (with a
        cgroup namespace, as in containers, that is the mount root).
    """

    def __init__(
        self,
        proc: str | os.PathLike[str] = "/proc",
        cgroup: str | os.PathLike[str] = "/sys/fs/cgroup",
    ) -> None:
        self._proc = Path(proc)
        self._cgroup = Path(cgroup)
        # (VmRSS, VmHWM) at the last reset, kept only when clear_refs could not be written.
        self._fallback_window: tuple[int, int] | None = None

    # -- capacity ------------------------------------------------------------------------

    def total_memory(self) -> int:
        meminfo = _read_fields(self._proc / "meminfo")
        total = meminfo["MemTotal"] if "MemTotal" in meminfo else _sysconf_bytes("SC_PHYS_PAGES")
        limit = self._cgroup_limit()
        return min(total, limit) if limit is not None else total

    def free_memory(self) -> int:
        """RAM that can be allocated without swapping, capped by the cgroup's headroom.

        ``MemAvailable`` counts reclaimable page cache as available. Without
        ``/proc/meminfo``, ``SC_AVPHYS_PAGES`` counts only never-used pages: an
        underestimate, which errs on the safe side.
        """
        meminfo = _read_fields(self._proc / "meminfo")
        if "MemAvailable" in meminfo:
            free = meminfo["MemAvailable"]
        else:
            free = _sysconf_bytes("SC_AVPHYS_PAGES")
        limit = self._cgroup_limit()
        if limit is not None:
            # memory.current includes page cache the kernel could reclaim, so this
            # headroom is a lower bound; safer than an OOM kill by the container.
            used = _read_int(self._cgroup / "memory.current") or 0
            free = min(free, max(0, limit - used))
        return min(free, self.total_memory())

    def default_budget(self, free: int) -> int:
        """``min(40% of free, 8 GiB)``.

        Why so modest: host RAM is shared with the OS and other processes, and what is
        "available" now includes page cache that others may want back. The attention
        backends also gather pages into a dense copy per step, which a single profiled
        step (a short one, see ``profile_tokens``) may not show at its worst. And CPU
        decoding is compute-bound long before the cache is large: 8 GiB already holds
        ~65k tokens of a Llama-3-8B-sized model in bfloat16. Users who want more pass ``kv_cache_memory`` explicitly.
        """
        return min(int(free * 0.4), 8 * _GIB)

    def profile_tokens(self, num_tokens: int) -> int:
        """At most :data:`PROFILE_TOKENS`, scaled up by the engine.

        A full-size profiling forward (2048 tokens by default) costs as much as a whole
        prompt batch, seconds on a few cores, at every start. The cpu backends' activations
        grow linearly with the step's tokens (the SDPA backend keeps no ``[T, T]`` scores
        for a fresh prompt), so a short forward scaled up bounds the long one; the default
        budget's headroom (60% of free RAM) covers what the estimate misses.
        """
        return min(num_tokens, PROFILE_TOKENS)

    # -- peak ----------------------------------------------------------------------------

    def reset_peak(self) -> None:
        """Reset ``VmHWM`` through clear_refs, or open a fallback window if not allowed."""
        try:
            (self._proc / "self" / "clear_refs").write_text("5")
            self._fallback_window = None
        except OSError:
            status = _read_fields(self._proc / "self" / "status")
            self._fallback_window = (status.get("VmRSS", 0), status.get("VmHWM", 0))

    def peak_memory(self) -> int:
        """Highest resident set since :meth:`reset_peak`.

        Exact when clear_refs could be written (Linux resets ``VmHWM`` to the current
        RSS). Otherwise ``VmHWM`` is the lifetime high, so: if it rose since the reset,
        the new high was reached inside the window and is reported exactly; if not, the
        window's true peak is unknown (anywhere up to the old lifetime high), and the
        reading is ``max(RSS at reset, RSS now)``, a *lower bound* that misses memory
        allocated and freed inside the window.
        """
        status = _read_fields(self._proc / "self" / "status")
        hwm = status.get("VmHWM", 0)
        if self._fallback_window is None:
            return hwm
        rss_at_reset, hwm_at_reset = self._fallback_window
        if hwm > hwm_at_reset:
            return hwm
        return max(rss_at_reset, status.get("VmRSS", 0))

    def _cgroup_limit(self) -> int | None:
        """The cgroup v2 ``memory.max`` in bytes, or None when unlimited or absent."""
        return _read_int(self._cgroup / "memory.max")


def _read_fields(path: Path) -> dict[str, int]:
    """Parse ``Name:  123 kB`` lines (meminfo, status) into bytes; {} if unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            unit = 1024 if parts[1:] == ["kB"] else 1
            fields[name.strip()] = int(parts[0]) * unit
    return fields


def _read_int(path: Path) -> int | None:
    """A file holding one integer; None when absent, unreadable or ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _sysconf_bytes(pages_name: str) -> int:
    """``pages_name`` pages times the page size, for hosts without /proc.

    :raises RuntimeError: when the OS offers neither /proc nor that sysconf name.
    """
    try:
        return os.sysconf(pages_name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError) as err:
        raise RuntimeError(
            f"cannot read host memory: no /proc/meminfo and os.sysconf({pages_name!r}) "
            f"failed ({err})"
        ) from err
