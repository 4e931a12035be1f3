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
turned off, since they would skip the hooks.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch import nn

from quire.lora.adapter import LoRAAdapter, expected_modules, load_adapter

#: Our fused modules and the Hugging Face modules they hold, in output order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
          "gate_up_proj": ("gate_proj", "up_proj")}


class _Site:
    """One of our linear modules: the Hugging Face modules whose outputs it holds, each
    with its output columns and its stacked slot weights."""

    def __init__(self, names: list[str], widths: list[int], in_features: int,
                 max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.names = names
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.widths = widths
        self.a = torch.zeros(max_loras, len(names), max_rank, in_features, device=device,
                             dtype=dtype)
        self.b = [torch.zeros(max_loras, w, max_rank, device=device, dtype=dtype)
                  for w in widths]
        self.out_features = sum(widths)


class LoRAManager:
    """Adapters in device slots for one model runner's steps; not thread-safe."""

    def __init__(self, model: nn.Module, config: object, max_loras: int, max_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.expected = expected_modules(config)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._paths: dict[int, str] = {}
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # id->slot
        self._sites: dict[str, _Site] = {}  # by the Hugging Face name of each module held
        #: This step's (slot, token rows) per adapter present; empty: base model only.
        self._groups: list[tuple[int, torch.Tensor]] = []
        for name, module in model.named_modules():
            if hasattr(module, "fusion_spec"):  # a whole-layer kernel would skip the hooks
                module.kernel = None
            site = self._site_of(name, module, device, dtype)
            if site is not None:
                module.register_forward_hook(self._hook(site))

    def _site_of(self, name: str, module: nn.Module, device: torch.device,
                 dtype: torch.dtype) -> _Site | None:
        prefix, _, own = name.rpartition(".")
        names = [f"{prefix}.{n}" for n in _FUSED.get(own, (own,))]
        if not all(n in self.expected for n in names):
            return None
        widths = [self.expected[n][1] for n in names]
        site = _Site(names, widths, self.expected[names[0]][0], self.max_loras,
                     self.max_rank, device, dtype)
        for n in names:
            self._sites[n] = site
        return site

    def _hook(self, site: _Site):
        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...],
                     y: torch.Tensor) -> torch.Tensor:
            if not self._groups:
                return y
            x = inputs[0]
            for slot, rows in self._groups:
                xs = x.index_select(0, rows)
                delta = y.new_zeros(len(rows), site.out_features)
                for i, (offset, width) in enumerate(zip(site.offsets, site.widths)):
                    shrunk = xs @ site.a[slot, i].T  # [n, r]
                    delta[:, offset : offset + width] = shrunk @ site.b[i][slot].T
                y = y.index_add(0, rows, delta)
            return y
        return add_lora

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
        self._groups = []
        if not present:
            return
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        for lid in present:
            rows = [r for i, item_lora in enumerate(lora_ids) if item_lora == lid
                    for r in range(starts[i], starts[i + 1])]
            self._groups.append((slots[lid], torch.tensor(rows, dtype=torch.int64,
                                                          device=device)))

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
            site.a[slot].zero_()
            for b in site.b:
                b[slot].zero_()
        for name, weights in adapter.modules.items():
            site = self._sites[name]
            i = site.names.index(name)
            r = weights.a.shape[0]
            site.a[slot, i, :r].copy_(weights.a)
            site.b[i][slot, :, :r].copy_(weights.b * weights.scaling)

    def forget(self, lora_id: int) -> None:
        """Drop an adapter (unloaded): its slot and host copy go, its path too."""
        self._paths.pop(lora_id, None)
        self._host.pop(lora_id, None)
        self._slots.pop(lora_id, None)
