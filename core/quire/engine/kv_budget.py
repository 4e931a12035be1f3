"""One KV memory budget shared by the engines of several models (``quire serve`` with
more than one ``--model``), each engine core in its own process.

The budget is a number of bytes in a small ledger file that every core maps
(:class:`KVLedger`): per model, the bytes its page pool holds and the bytes it wants.
Each core keeps its pool's usable part (``BlockManager.limit``) within what the ledger
grants it (:class:`KVShare`), a step at a time and while idle; the memory of pages given
up goes back to the OS (``Executor.release_kv_pages``), so the models' resident KV memory
together stays within the one budget.

How the share is decided (:func:`decide`): every model may grow into budget nobody holds.
When a model wants more than is free and holds less than its *fair share*, the others
give back what they hold beyond theirs. The fair share is max-min fair over the wants
(:func:`fair_shares`): models that want less than an equal split get what they want, the
rest is split equally among the others. A model's want is its used pages plus what its
queues need next (a page per running sequence, each waiting prompt's pages), so a model
with no traffic wants nothing: under pressure its cached prefixes, which it holds beyond
its want, are the first pages given back. Pages held by running sequences are never
taken: a model above its share shrinks as its sequences finish (no preemption across
models), so a shift of traffic moves the memory within about one request's lifetime.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from quire.engine.block_manager import BlockManager

_MAGIC = b"QKVB"
_HEADER = struct.Struct("<4sqq")   # magic, budget bytes (0: not set yet), slots
_SLOT = struct.Struct("<qqq")      # held bytes, wanted bytes, alive (1) or gone (0)


class KVShareSpec(msgspec.Struct, frozen=True):
    """Where an engine core finds its share: the ledger file and its slot in it."""

    path: str
    slot: int


@dataclass
class SlotState:
    """One slot of the ledger: bytes held and wanted, and whether its engine runs."""

    held: int
    want: int
    alive: bool


class KVLedger:
    """The shared ledger: a budget and, per slot, the bytes held and wanted.

    Every read-modify-write is done under :meth:`locked` (an ``flock`` on the file), so
    several processes may use it; a slot is written only by its own engine.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        self._map = mmap.mmap(self._fd, size)
        magic, _, self.num_slots = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC:
            raise ValueError(f"{path} is not a KV budget ledger")

    @classmethod
    def create(cls, path: str, num_slots: int, budget: int = 0) -> KVLedger:
        """A new ledger for ``num_slots`` engines; ``budget`` 0 leaves the budget to the
        first engine that starts (:meth:`settle_budget`)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        with open(path, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, budget, num_slots))
            f.write(_SLOT.pack(0, 0, 0) * num_slots)
        return cls(path)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def budget(self) -> int:
        return int(_HEADER.unpack_from(self._map, 0)[1])

    def settle_budget(self, proposed: int) -> int:
        """The budget: the one set already, else ``proposed`` (which it becomes)."""
        with self.locked():
            if self.budget <= 0:
                _HEADER.pack_into(self._map, 0, _MAGIC, proposed, self.num_slots)
            return self.budget

    def slots(self) -> list[SlotState]:
        """Every slot as it stands (call under :meth:`locked` to act on it)."""
        out = []
        for i in range(self.num_slots):
            held, want, alive = _SLOT.unpack_from(self._map, _HEADER.size + i * _SLOT.size)
            out.append(SlotState(held, want, bool(alive)))
        return out

    def write(self, slot: int, held: int, want: int, alive: bool = True) -> None:
        _SLOT.pack_into(self._map, _HEADER.size + slot * _SLOT.size, held, want, int(alive))


def fair_shares(budget: int, wants: list[int]) -> list[int]:
    """Max-min fair split of ``budget`` over ``wants`` (water filling): a want below an
    equal split of what is left is met whole, the rest is split equally among the
    others. A want of 0 gets 0."""
    shares = [0] * len(wants)
    left = budget
    open_ = sorted((w, i) for i, w in enumerate(wants) if w > 0)
    while open_:
        equal = left // len(open_)
        want, i = open_[0]
        if want > equal:
            for _, j in open_:
                shares[j] = equal
            break
        shares[i] = want
        left -= want
        open_.pop(0)
    return shares


def decide(budget: int, slot: int, states: list[SlotState], quantum: int) -> int:
    """The bytes slot ``slot``'s pool may use next (its limit), given every slot's state
    (its own want and what it holds included).

    - When another model below its fair share wants more than is free, a model above
      its own share gives back its excess over it (the shortfall's worth at most).
    - Else, below its want, it grows into free budget, by at least ``quantum`` where that
      much is free (fewer ledger rounds as a queue fills).
    - Else it keeps what it holds: its cached prefixes stay until someone needs the room.
    """
    live = [s if s.alive else SlotState(0, 0, False) for s in states]
    held, want = live[slot].held, live[slot].want
    free = budget - sum(s.held for s in live)
    shares = fair_shares(budget, [s.want for s in live])
    short = sum(max(0, min(s.want, share) - s.held)
                for i, (s, share) in enumerate(zip(live, shares)) if i != slot)
    deficit = short - max(0, free)
    if deficit > 0 and held > shares[slot]:
        return held - min(held - shares[slot], deficit)
    if want > held and free > 0:
        return held + min(free, max(want - held, quantum))
    return held


class KVShare:
    """An engine core's side of the ledger: its page pool's usable part kept within
    what :func:`decide` grants it.

    :param bytes_per_block: what one of this engine's pages costs (every layer, every
        rank of the engine on this host), the unit its pages are counted in.
    """

    #: Growth is asked for in steps of at least this share of the budget.
    QUANTUM = 1 / 32

    def __init__(self, spec: KVShareSpec, bytes_per_block: int) -> None:
        self.ledger = KVLedger(spec.path)
        self.slot = spec.slot
        self.bytes_per_block = bytes_per_block

    def budget_bytes(self, proposed: int) -> int:
        """The shared budget: the first engine's ``proposed`` sets it for all."""
        return self.ledger.settle_budget(proposed)

    def tend(self, pool: BlockManager, want_blocks: int) -> tuple[int, int] | None:
        """Record this engine's want, move its pool's limit to its share, and return
        the pages ``[start, stop)`` whose memory the workers should give back, if any.
        Cached pages above a lowered limit are evicted (:meth:`BlockManager.set_limit`)."""
        bpb = self.bytes_per_block
        with self.ledger.locked():
            states = self.ledger.slots()
            held = max(pool.limit, pool.extent) * bpb
            states[self.slot] = SlotState(held, want_blocks * bpb, True)
            budget = self.ledger.budget
            target = decide(budget, self.slot, states, max(bpb, int(budget * self.QUANTUM)))
            pool.set_limit(min(pool.num_blocks, target // bpb))
            released = pool.release_top()
            self.ledger.write(self.slot, max(pool.limit, pool.extent) * bpb,
                              want_blocks * bpb)
        return released

    def close(self) -> None:
        """This engine is gone: its slot holds nothing."""
        with self.ledger.locked():
            self.ledger.write(self.slot, 0, 0, alive=False)
        self.ledger.close()
