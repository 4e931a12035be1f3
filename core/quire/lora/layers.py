"""LoRA in the forward: each targeted product of the base model gets
``scaling * B (A x)`` added for the tokens of the adapter their sequence runs with, a
step's tokens segmented by adapter (the Punica/SGMV shape: one shrink and one expand
per adapter present, over its tokens only).

:class:`LoRAManager` (one per model runner) owns the device slots: ``max_loras``
adapters stacked per product, zero-padded to ``max_lora_rank`` with the scaling folded
into ``B``, filled least recently used first; loaded adapters wait in host memory up to
``max_cpu_loras`` (least recently used go first), and any adapter is read again from
its path when needed. Products are reached through forward hooks on the linear
modules, so model code knows nothing of LoRA; the platform's whole-layer kernels are
turned off, since they would skip the hooks. The updates themselves are the platform's
``lora_linear`` op (:mod:`quire.ops.lora`).

With tensor parallelism each rank holds its layers' part of every adapter, cut as the
layer's weight is: a column-parallel product (q/k/v, gate/up) keeps its rows of ``B``
(each key/value head's rows where the heads are replicated), a row-parallel one (o,
down) its columns of ``A``; its update is then a partial sum like its product, summed
over the ranks with one ``all_reduce`` of the update (the layer's own reduce happened
inside its forward, before the hook).

The token embedding and the LM head take adapters too, where PEFT puts them: an
embedding row gains ``scaling * B A[:, token]`` (a gather and a small product, per
adapter present); the LM head, which runs on the rows the step samples only
(:meth:`LoRAManager.select_rows`), is a product like the others. Both see whole rows on
every rank (their layers gather or reduce inside), so every rank holds their whole
update.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch import nn

from quire.lora.adapter import LoRAAdapter, expected_modules, load_adapter
from quire.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from quire.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from quire.ops import OpSet, reference_ops
from quire.ops.lora import Segments, segments_of

#: Our fused modules and the Hugging Face modules they hold, in output order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
          "gate_up_proj": ("gate_proj", "up_proj")}


class _Site:
    """One of our linear modules: the Hugging Face modules whose outputs it holds, each
    with this rank's output columns, and the stacked slot weights
    (:mod:`quire.ops.lora`'s layout)."""

    def __init__(self, module: nn.Module, names: list[str], widths: list[int],
                 in_features: int, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.module = module
        self.names = names
        self.offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
        self.widths = widths
        ranks = getattr(getattr(module, "comm", None), "world_size", 1)
        #: Row-parallel over several ranks: its input, so its update, is a partial sum.
        self.partial = isinstance(module, RowParallelLinear) and ranks > 1
        self.a = torch.zeros(max_loras, len(names), max_rank, in_features, device=device,
                             dtype=dtype)
        self.b = torch.zeros(max_loras, sum(widths), max_rank, device=device, dtype=dtype)
        #: Slots whose adapter targets this module (the others' updates are zero).
        self.filled = [False] * max_loras

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.filled[slot] = False

    def write(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice ``i``'s update in ``slot``: this rank's part of the full ``a`` [r, in]
        and ``b`` [out, r] (scaling folded in), cut as the module's weight is."""
        r = a.shape[0]
        module = self.module
        self.filled[slot] = True
        if isinstance(module, (ParallelLMHead, VocabParallelEmbedding)):  # whole rows
            self.a[slot, i, :r].copy_(a)
            self.b[slot, :, :r].copy_(b)
            return
        if isinstance(module, RowParallelLinear):
            n = module.input_size_per_rank
            self.a[slot, i, :r].copy_(a[:, module.comm.rank * n:(module.comm.rank + 1) * n])
            self.b[slot, :, :r].copy_(b)
            return
        self.a[slot, i, :r].copy_(a)
        if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            shard = "qkv"[i] if isinstance(module, QKVParallelLinear) else i
            module.weight_loader(self.b[slot, :, :r], b, shard)  # its rows, its way
            return
        rows = self.widths[i]  # a plain column-parallel product: its rows of each slice
        rank = getattr(getattr(module, "comm", None), "rank", 0)
        cols = slice(self.offsets[i], self.offsets[i] + rows)
        self.b[slot, cols, :r].copy_(b[rank * rows:(rank + 1) * rows])


class LoRAManager:
    """Adapters in device slots for one model runner's steps; not thread-safe."""

    def __init__(self, model: nn.Module, config: object, max_loras: int, max_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype,
                 ops: OpSet | None = None) -> None:
        """:param ops: whose ``lora_linear`` adds the updates (the reference when None)."""
        self.ops = ops if ops is not None else reference_ops()
        self.expected = expected_modules(config)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._paths: dict[int, str] = {}
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # id->slot
        self._sites: dict[str, _Site] = {}  # by the Hugging Face name of each module held
        #: This step's slot per token (-1: the base model) and their grouping; None: no
        #: adapter in it.
        self._token_slots: torch.Tensor | None = None
        self._segments: Segments | None = None
        #: The slots this step's adapters are in.
        self._step_slots: list[int] = []
        #: The slots of the rows the LM head runs on next, and their grouping.
        self._row_slots: tuple[torch.Tensor, Segments] | None = None
        for name, module in model.named_modules():
            if hasattr(module, "fusion_spec"):  # a whole-layer kernel would skip the hooks
                module.kernel = None
            if hasattr(module, "layers_kernel"):  # as would one for all the layers
                module.layers_kernel = None
            site = self._site_of(name, module, device, dtype)
            if site is not None:
                module.register_forward_hook(self._hook(site))

    def _site_of(self, name: str, module: nn.Module, device: torch.device,
                 dtype: torch.dtype) -> _Site | None:
        prefix, _, own = name.rpartition(".")
        names = [f"{prefix}.{n}" if prefix else n for n in _FUSED.get(own, (own,))]
        if not all(n in self.expected for n in names):
            return None
        ws = getattr(getattr(module, "comm", None), "world_size", 1)
        in_features = self.expected[names[0]][0]
        if isinstance(module, (ParallelLMHead, VocabParallelEmbedding)):  # whole rows
            widths = [self.expected[names[0]][1]]
        elif isinstance(module, RowParallelLinear):  # its input columns are split
            widths, in_features = [self.expected[names[0]][1]], in_features // ws
        elif isinstance(module, QKVParallelLinear):  # kv heads may be replicated
            widths = [module.q_size, module.kv_size, module.kv_size]
        else:
            widths = [self.expected[n][1] // ws for n in names]
        site = _Site(module, names, widths, in_features, self.max_loras, self.max_rank,
                     device, dtype)
        for n in names:
            self._sites[n] = site
        return site

    def _hook(self, site: _Site):
        if isinstance(site.module, VocabParallelEmbedding):
            return self._embedding_hook(site)
        head = isinstance(site.module, ParallelLMHead)

        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...],
                     y: torch.Tensor) -> torch.Tensor:
            slots = self._token_slots
            if slots is None or not any(site.filled[s] for s in self._step_slots):
                return y
            if head:  # the rows the step samples, not its tokens
                assert self._row_slots is not None, "select_rows before the LM head"
                slots, segments = self._row_slots
                return self.ops.lora_linear(y, inputs[0], site.a, site.b, site.offsets,
                                            slots, segments)
            if site.partial:  # this rank's share of the update, summed like the product
                delta = self.ops.lora_linear(torch.zeros_like(y), inputs[0], site.a,
                                             site.b, site.offsets, slots, self._segments)
                return y + site.module.comm.all_reduce(delta)
            return self.ops.lora_linear(y, inputs[0], site.a, site.b, site.offsets, slots,
                                        self._segments)
        return add_lora

    def _embedding_hook(self, site: _Site):
        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...],
                     y: torch.Tensor) -> torch.Tensor:
            if self._token_slots is None or not any(site.filled[s]
                                                    for s in self._step_slots):
                return y
            order, bounds = self._segments  # type: ignore[misc]
            ids = inputs[0].index_select(0, order)
            delta = torch.zeros(len(order), y.shape[-1], dtype=site.a.dtype,
                                device=y.device)
            for slot, start, end in bounds:  # A's columns of the tokens, then B
                delta[start:end] = site.a[slot, 0, :, ids[start:end]].T @ site.b[slot].T
            return y.index_add(0, order, delta.to(y.dtype))
        return add_lora

    def select_rows(self, rows: torch.Tensor | slice | list[int]) -> None:
        """The rows of this step's tokens the LM head runs on next (the sampled ones,
        or a prompt's for its logprobs): their adapters' updates of the head."""
        if self._token_slots is None:
            self._row_slots = None
            return
        slots = self._token_slots[rows]
        self._row_slots = (slots, segments_of(slots))

    # -- per step --------------------------------------------------------------------------
    def prepare(self, lora_ids: Sequence[int], lengths: Sequence[int],
                paths: dict[int, str], device: torch.device) -> None:
        """Set the step's adapters: item ``i``'s ``lengths[i]`` tokens run with adapter
        ``lora_ids[i]`` (0: the base model). ``paths`` names adapters first seen."""
        self._paths.update(paths)
        present = sorted({i for i in lora_ids if i})
        if len(present) > self.max_loras:
            raise ValueError(f"a step holds {len(present)} adapters, more than "
                             f"max_loras={self.max_loras}")
        slots = {lid: self._slot(lid, present) for lid in present}
        self._step_slots = sorted(slots.values())
        if not present:
            self._token_slots = self._segments = None
            return
        per_item = torch.tensor([slots.get(lid, -1) for lid in lora_ids], dtype=torch.int64)
        self._token_slots = per_item.repeat_interleave(
            torch.tensor(lengths, dtype=torch.int64)).to(device)
        self._segments = segments_of(self._token_slots)  # once per step, for every product

    def _slot(self, lora_id: int, keep: list[int]) -> int:
        """``lora_id``'s device slot, loading it into the least recently used slot not
        in ``keep`` when it holds none."""
        slot = self._slots.get(lora_id)
        if slot is not None:
            self._slots.move_to_end(lora_id)
            return slot
        used = set(self._slots.values())
        if len(used) < self.max_loras:
            slot = next(s for s in range(self.max_loras) if s not in used)
        else:
            victim = next(v for v in self._slots if v not in keep)
            slot = self._slots.pop(victim)
        self._write(slot, self._adapter(lora_id))
        self._slots[lora_id] = slot
        return slot

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_id)
        if adapter is None:
            path = self._paths.get(lora_id)
            if path is None:
                raise ValueError(f"adapter {lora_id} has no known path")
            adapter = load_adapter(path, self.expected, self.max_rank)
            self._host[lora_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora_id)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for site in set(self._sites.values()):
            site.clear(slot)
        for name, weights in adapter.modules.items():
            site = self._sites.get(name)
            if site is not None:  # (a pipeline stage holds some layers only)
                site.write(slot, site.names.index(name), weights.a,
                           weights.b * weights.scaling)
