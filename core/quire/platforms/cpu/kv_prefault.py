"""The KV pool's pages made resident ahead of use, by a thread that runs on idle CPU.

A fresh page's first write costs a fault, and under a hypervisor that backs guest memory
lazily (or takes freed memory back: virtio-balloon free page reporting) a far dearer
one in the host (docs/bench.md, "first touch", has the figures). A step that reaches a
never-used KV block pays it inside the step. vLLM and llama.cpp write the whole pool at
start, which the start then waits for (the cpu option ``kv_prefault=start``).
:class:`BackgroundPrefault` is the default: the engine starts at once, and a thread at
idle priority (``SCHED_IDLE``) keeps a margin of blocks resident ahead of the highest
block used (as much again as is used, within bounds), in the order the block manager hands out never-used blocks (ascending ids),
paid for with CPU time nobody else wanted: a server between requests, a host with cores
the engine leaves idle. An engine that keeps every
core busy (an offline batch whose OpenMP threads spin between products) leaves it none,
and its steps fault pages in as without it.

Pages are populated with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+,
:func:`quire.heap.populate_write`), which faults a
page in writable without writing it: blocks a step has already written keep their
contents, so the thread needs no coordination with the steps. Where the call is missing,
the pool faults in on first use (logged once).

The thread is stopped and joined at interpreter exit (an ``atexit`` handler, which runs
while the interpreter is still whole), never left to finalization: a daemon thread that
drops the last reference to a KV tensor frees it with the GIL released, and one that
then asks for the GIL back during finalization is ended by ``pthread_exit``, whose
unwinding through torch's C++ frames calls ``std::terminate`` (the SIGABRT, "terminate
called without an active exception", that ``quire generate`` hit at exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quire.heap import populate_write

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: The ``kv_prefault`` option's values (:class:`~quire.platforms.cpu.options.CpuOptions`).
MODES = ("background", "start", "off")
#: Bytes of one tensor half populated per call: small, so that the thread, preempted
#: while the kernel holds the process's mmap lock for the call, holds up a step's
#: ``munmap`` by a fraction of a millisecond at most (16 pages).
CHUNK_BYTES = 64 << 10
#: How far ahead of the highest block used the pool is kept resident, all layers' keys
#: and values together, at most: a few seconds of new tokens at full speed for a small
#: model, so the resident memory follows use (plus this) instead of becoming the whole
#: pool.
AHEAD_BYTES = 512 << 20
#: ... and at least. Between the two the margin is as much again as the steps have
#: used: a lone conversation (a few MiB of pages) keeps tens of MiB ahead of it, not the
#: 512 MiB a batch filling the pool at full speed wants.
MIN_AHEAD_BYTES = 32 << 20
def supported() -> bool:
    """Whether this OS populates pages without writing them (probed on one page)."""
    import torch

    probe = torch.empty(2 * os.sysconf("SC_PAGE_SIZE"), dtype=torch.uint8)
    return populate_write(probe.data_ptr(), 1)


@dataclass
class _Pool:
    """One layer's KV tensor as the thread sees it."""

    #: the tensor, held weakly so that a freed pool is not kept alive
    cache: weakref.ref
    #: blocks in each half (keys, values)
    num_blocks: int
    #: bytes of one block in one half
    block_bytes: int
    #: blocks ``[0, done)`` of both halves are resident
    done: int = 0


class BackgroundPrefault:
    """Keeps the KV tensors given to :meth:`add` resident a margin ahead of use.

    Blocks are populated in ascending order, every layer's together, from one daemon
    thread at idle priority, up to a margin (all layers' keys and values) past the
    highest block a step has reached (:meth:`reached`): as many bytes as the steps have
    reached, but at least ``min_ahead_bytes`` and at most ``ahead_bytes``. So the
    resident memory follows use plus that margin rather than growing to the whole pool. The
    thread holds the tensors weakly (a freed pool is not kept alive) and ends when
    every tensor is resident or gone.
    """

    def __init__(self, ahead_bytes: int = AHEAD_BYTES,
                 chunk_bytes: int = CHUNK_BYTES,
                 min_ahead_bytes: int = MIN_AHEAD_BYTES) -> None:
        self.ahead_bytes = ahead_bytes
        self.min_ahead_bytes = min_ahead_bytes
        self.chunk_bytes = chunk_bytes
        self._cond = threading.Condition()
        self._pending: list[_Pool] = []
        #: The highest block id a step has reached (-1: none yet).
        self._frontier = -1
        #: Blocks from here up were given back (:meth:`released`): nothing past the
        #: highest block used is populated there, so what was given back stays so.
        self._ceiling = sys.maxsize
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: Set while the thread has caught up with the frontier plus the margin.
        self.idle = threading.Event()
        self.idle.set()

    def add(self, cache: torch.Tensor) -> None:
        """Queue one layer's KV tensor: shape ``(2, num_blocks, ...)``, contiguous."""
        if not cache.is_contiguous() or cache.dim() < 2 or cache.numel() == 0:
            raise ValueError("BackgroundPrefault wants a contiguous (2, num_blocks, ...) "
                             "tensor")
        pool = _Pool(weakref.ref(cache), cache.shape[1],
                     cache[0, 0].numel() * cache.element_size())
        with self._cond:
            self._pending.append(pool)
            self.idle.clear()
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="quire-kv-prefault")
                _LIVE.add(self)
                self._thread.start()
            self._cond.notify()

    def reached(self, block: int) -> None:
        """A step wrote block ``block``: keep the margin ahead of it."""
        if block <= self._frontier and block < self._ceiling:  # the common case
            return
        with self._cond:
            if block >= self._ceiling:
                self._ceiling = block + 1
            if block > self._frontier:
                self._frontier = block
            self.idle.clear()
            self._cond.notify()

    def released(self, block: int) -> None:
        """Blocks from ``block`` up were given back: count them as not resident, and
        populate none of them ahead of use from now on."""
        with self._cond:
            self._ceiling = min(self._ceiling, block)
            for pool in self._pending:
                pool.done = min(pool.done, block)

    def stop(self) -> None:
        """Ask the thread to end after its current call."""
        self._stop.set()
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread and wait for it to end (one chunk's call at most). The
        thread is put back at normal priority first, so that a host whose CPUs other
        processes keep busy cannot starve it of the little it needs to stop."""
        self.stop()
        with self._cond:
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        while thread.is_alive():
            _restore_priority(thread)
            thread.join(0.1)

    def _run(self) -> None:
        _lower_priority()
        while not self._stop.is_set():
            with self._cond:
                self._pending = [p for p in self._pending
                                 if p.cache() is not None and p.done < p.num_blocks]
                if not self._pending:
                    self._thread = None
                    self.idle.set()
                    return
                work = list(self._pending)
                per_block = sum(2 * p.block_bytes for p in work)
                used = (self._frontier + 1) * per_block
                margin = min(self.ahead_bytes, max(self.min_ahead_bytes, used))
                limit = min(self._frontier + 1 + max(1, margin // per_block),
                            self._ceiling)
                behind = [p for p in work if p.done < min(limit, p.num_blocks)]
                if not behind:
                    self.idle.set()
                    self._cond.wait(timeout=1.0)  # also notices freed pools
                    continue
            # One chunk of blocks per round for every layer, so that blocks are
            # resident in all layers in the order the block manager hands them out.
            step = max(1, self.chunk_bytes // max(p.block_bytes for p in behind))
            target = min(p.done for p in behind) + step
            for pool in behind:
                cache = pool.cache()
                if cache is None:
                    continue
                ok = self._populate(cache, pool, min(target, limit, pool.num_blocks))
                del cache
                if not ok:
                    logger.info("populating the KV pool ahead of use stopped: "
                                "madvise(MADV_POPULATE_WRITE) failed (it needs Linux "
                                "5.14+); its pages fault in on first use")
                    with self._cond:
                        self._pending.clear()
                    break
        with self._cond:
            self._thread = None
            self.idle.set()

    def _populate(self, cache: torch.Tensor, pool: _Pool, upto: int) -> bool:
        """Blocks ``[pool.done, upto)`` of both halves, a chunk per call."""
        size = pool.block_bytes
        base, half = cache.data_ptr(), pool.num_blocks * size
        step = max(1, self.chunk_bytes // size)
        while pool.done < upto and not self._stop.is_set():
            end = min(upto, pool.done + step)
            for offset in (0, half):  # keys, then values
                if not populate_write(base + offset + pool.done * size,
                                      (end - pool.done) * size):
                    return False
            pool.done = end
        return True


#: Every instance whose thread may be running, for :func:`_close_all` at exit.
_LIVE: weakref.WeakSet[BackgroundPrefault] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Join every prefault thread before the interpreter finalizes (module docstring)."""
    for prefault in list(_LIVE):
        prefault.close()


def _restore_priority(thread: threading.Thread) -> None:
    """Put ``thread`` back under the normal policy (Linux takes a thread id here)."""
    if thread.native_id is None:
        return
    try:
        os.sched_setscheduler(thread.native_id, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _lower_priority() -> None:
    """Run the calling thread only on CPU nobody else wants (``SCHED_IDLE``; else the
    lowest nice value)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
