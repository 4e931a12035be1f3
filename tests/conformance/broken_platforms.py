"""Deliberately broken platforms, each with one bug a conformance check must catch.

Each is the cpu platform with one part replaced. They live in a module of their own (not
in the test file) so that spawned ranks can import them by name.
"""

from __future__ import annotations

import dataclasses

import torch

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces.communicator import Communicator
from quire.interfaces.platform import Availability
from quire.ops.attention import ReferenceAttentionBackend, ReferenceAttentionMetadata
from quire.platforms.cpu.memory import CpuMemoryProfiler
from quire.platforms.cpu.platform import CpuPlatform

# -- attention backends: one bug each ------------------------------------------------------


class NoCausalMask(ReferenceAttentionBackend):
    """Lets a query see the step's later tokens (keeps only the sequence-end mask)."""

    def build_metadata(self, batch):
        md = super().build_metadata(batch)
        groups = tuple(
            dataclasses.replace(g, causal_mask=g.kv_valid[:, None, :, 0, 0].expand_as(
                g.causal_mask))
            for g in md.groups
        )
        return ReferenceAttentionMetadata(md.slot_mapping, groups)


class WrongKvHead(ReferenceAttentionBackend):
    """Query head h reads KV head (Hkv - 1 - h // G) instead of h // G."""

    def attend(self, query, kv_cache, metadata, **kwargs):
        return super().attend(query, kv_cache.flip(3), metadata, **kwargs)


class IgnoresWindow(ReferenceAttentionBackend):
    def attend(self, query, kv_cache, metadata, *, sliding_window=None, **kwargs):
        return super().attend(query, kv_cache, metadata, **kwargs)


class IgnoresSoftCap(ReferenceAttentionBackend):
    def attend(self, query, kv_cache, metadata, *, logits_soft_cap=None, **kwargs):
        return super().attend(query, kv_cache, metadata, **kwargs)


class ReadsUnwrittenSlots(ReferenceAttentionBackend):
    """Forgets that slots past a sequence's end hold garbage: weighs them by zero, and
    0 * NaN is NaN."""

    def build_metadata(self, batch):
        md = super().build_metadata(batch)
        groups = tuple(dataclasses.replace(g, kv_valid=torch.ones_like(g.kv_valid))
                       for g in md.groups)
        return ReferenceAttentionMetadata(md.slot_mapping, groups)


class ShiftedWrite(ReferenceAttentionBackend):
    """Writes every token one slot too far."""

    def write_kv(self, key, value, kv_cache, metadata):
        total = kv_cache.shape[1] * kv_cache.shape[2]
        shifted = dataclasses.replace(metadata, slot_mapping=(metadata.slot_mapping + 1) % total)
        super().write_kv(key, value, kv_cache, shifted)


class SwappedKeysAndValues(ReferenceAttentionBackend):
    def write_kv(self, key, value, kv_cache, metadata):
        super().write_kv(value, key, kv_cache, metadata)


class ClobberingWrite(ReferenceAttentionBackend):
    """Writes the right slots, and the next slot too."""

    def write_kv(self, key, value, kv_cache, metadata):
        total = kv_cache.shape[1] * kv_cache.shape[2]
        spill = dataclasses.replace(metadata, slot_mapping=(metadata.slot_mapping + 1) % total)
        super().write_kv(key, value, kv_cache, spill)
        super().write_kv(key, value, kv_cache, metadata)


class WithBackend(CpuPlatform):
    """The cpu platform with another backend class."""

    backend_cls: type[ReferenceAttentionBackend] = ReferenceAttentionBackend

    def make_attention_backend(self):
        return self.backend_cls()


def platform_with(backend_cls: type[ReferenceAttentionBackend]) -> CpuPlatform:
    return type(f"CpuWith{backend_cls.__name__}", (WithBackend,),
                {"backend_cls": backend_cls})()


# -- platform contract ---------------------------------------------------------------------


class ZeroBlockSize(CpuPlatform):
    default_block_size = 0


class AcceptsAnyDtype(CpuPlatform):
    def check_dtype(self, dtype):
        return None


class AvailabilityIsABool(CpuPlatform):
    def availability(self):
        return True


class Absent(CpuPlatform):
    """Never available: what a vendor platform looks like without its hardware."""

    name = "absent"

    def availability(self):
        return Availability.no("no absent device here")


# -- memory --------------------------------------------------------------------------------


class FreeAboveTotal(CpuMemoryProfiler):
    def free_memory(self):
        return self.total_memory() + 1


class FlatPeak(CpuMemoryProfiler):
    def peak_memory(self):
        return 1 << 30


class OverGrantsFraction(CpuMemoryProfiler):
    """Treats every fraction as 0.9: off by far more than free memory moves."""

    def kv_budget(self, kv_cache_memory, activation_peak=0):
        if isinstance(kv_cache_memory, float):
            kv_cache_memory = 0.9
        return super().kv_budget(kv_cache_memory, activation_peak)


class JitteryFree(CpuMemoryProfiler):
    """Not a bug: free memory that swings by ~30 KiB between readings, as on a busy host
    (each reading alternates higher and lower, so the one inside a call can be the top)."""

    def __init__(self):
        super().__init__()
        self._calls = 0

    def free_memory(self):
        self._calls += 1
        return super().free_memory() + (30 << 10) * (self._calls % 2)


class WithProfiler(CpuPlatform):
    profiler_cls: type[CpuMemoryProfiler] = CpuMemoryProfiler

    def make_memory_profiler(self, device_index=0):
        return self.profiler_cls()


class FreeAboveTotalPlatform(WithProfiler):
    profiler_cls = FreeAboveTotal


class FlatPeakPlatform(WithProfiler):
    profiler_cls = FlatPeak


class OverGrantsFractionPlatform(WithProfiler):
    profiler_cls = OverGrantsFraction


class JitteryFreePlatform(WithProfiler):
    profiler_cls = JitteryFree


# -- communicator --------------------------------------------------------------------------


class DoublingAllReduce(TorchDistributedCommunicator):
    def all_reduce(self, tensor):
        return super().all_reduce(tensor) * 2


class ReversedAllGather(TorchDistributedCommunicator):
    def all_gather(self, tensor, dim=-1):
        gathered = super().all_gather(tensor, dim)
        return torch.cat(list(reversed(gathered.chunk(self.world_size, dim))), dim)


class DoublingAllReducePlatform(CpuPlatform):
    def make_communicator(self, rank=0, world_size=1):
        return DoublingAllReduce(self.distributed_backend, rank, world_size)


class ReversedAllGatherPlatform(CpuPlatform):
    def make_communicator(self, rank=0, world_size=1):
        return ReversedAllGather(self.distributed_backend, rank, world_size)


class CorruptingSend(TorchDistributedCommunicator):
    """Sends every tensor plus one: invisible at world size 1, where nothing is sent."""

    def send(self, tensor, dst):
        super().send(tensor + 1, dst)


class SendsWithoutPeer(TorchDistributedCommunicator):
    """At world size 1, send and recv return instead of refusing."""

    def send(self, tensor, dst):
        if self.world_size > 1:
            super().send(tensor, dst)

    def recv(self, like, src):
        return super().recv(like, src) if self.world_size > 1 else like.clone()


class CollectivesOnly(Communicator):
    """A communicator written for plugin API 1.0: no send/recv of its own."""

    def __init__(self, backend: str, rank: int = 0, world_size: int = 1) -> None:
        self._inner = TorchDistributedCommunicator(backend, rank, world_size)

    rank = property(lambda self: self._inner.rank)
    world_size = property(lambda self: self._inner.world_size)

    def all_reduce(self, tensor):
        return self._inner.all_reduce(tensor)

    def all_gather(self, tensor, dim=-1):
        return self._inner.all_gather(tensor, dim)

    def broadcast(self, tensor, src=0):
        return self._inner.broadcast(tensor, src)

    def barrier(self):
        self._inner.barrier()


class CorruptingSendPlatform(CpuPlatform):
    def make_communicator(self, rank=0, world_size=1):
        return CorruptingSend(self.distributed_backend, rank, world_size)


class SendsWithoutPeerPlatform(CpuPlatform):
    def make_communicator(self, rank=0, world_size=1):
        return SendsWithoutPeer(self.distributed_backend, rank, world_size)


class CollectivesOnlyPlatform(CpuPlatform):
    def make_communicator(self, rank=0, world_size=1):
        return CollectivesOnly(self.distributed_backend, rank, world_size)
