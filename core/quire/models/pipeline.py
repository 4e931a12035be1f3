"""Pipeline stages: which layers a rank holds, and how hidden states cross to the next.

A model split into ``count`` stages gives stage ``index`` a contiguous run of decoder
layers (the first stages take one more when the split is uneven); the first stage also
holds the embedding, the last the final norm and the LM head. Between stages travel the
hidden states and the residual stream, by the communicator's ``send``/``recv``; with an
EAGLE (EAGLE-3) or MTP head, which runs on the last stage and keeps a copy of the
embedding there, its proposals travel back, from the last stage to the first, before the
first's forward, and an EAGLE-3 head's layer inputs travel forward with the hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quire.interfaces.communicator import Communicator


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of ``count``: decoder layers ``start .. end - 1``."""

    index: int
    count: int
    start: int
    end: int
    #: The stage holds the token embedding though it is not the first (the last stage,
    #: for an EAGLE or MTP head that shares it).
    keeps_embedding: bool = False

    @classmethod
    def of(cls, index: int, count: int, num_layers: int,
           keeps_embedding: bool = False) -> "PipelineStage":
        """:raises ValueError: when there are fewer layers than stages."""
        if not 0 <= index < count or count > num_layers:
            raise ValueError(f"stage {index} of {count} over {num_layers} layers: every "
                             f"stage needs at least one layer")
        base, extra = divmod(num_layers, count)
        start = index * base + min(index, extra)
        return cls(index, count, start, start + base + (index < extra), keeps_embedding)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def embeds(self) -> bool:
        """The stage holds the token embedding."""
        return self.is_first or self.keeps_embedding

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end


class LayerGap(nn.Module):
    """Stands for a decoder layer another stage holds: no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this layer belongs to another pipeline stage")


class PipelineLink:
    """A stage's neighbours: hidden states and residual from the previous stage, to the
    next, in the model's dtype on its device; with an EAGLE-3 head, also the inputs of
    the target layers it reads that earlier stages kept."""

    def __init__(self, comm: Communicator, stage: PipelineStage, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, aux_width: int = 0) -> None:
        """:param aux_width: the width of those kept inputs (``3 * hidden_size`` with an
            EAGLE-3 head), 0 when none travel."""
        self.comm = comm
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.aux_width = aux_width

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """(hidden, residual), and the kept inputs when ``aux_width`` is not 0."""
        like = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        src = self.stage.index - 1
        received = (self.comm.recv(like, src), self.comm.recv(like, src))
        if not self.aux_width:
            return received
        aux = torch.empty(num_tokens, self.aux_width, dtype=self.dtype, device=self.device)
        return (*received, self.comm.recv(aux, src))

    def send(self, hidden: torch.Tensor, residual: torch.Tensor, *aux: torch.Tensor) -> None:
        """What :meth:`recv` takes on the next stage."""
        dst = self.stage.index + 1
        for tensor in (hidden, residual, *aux):
            self.comm.send(tensor, dst)

    def send_proposals(self, tokens: torch.Tensor) -> None:
        """On the last stage: a step's draft proposals (int64 [N]) to the first stage,
        before this stage receives the step's hidden states (so no two stages both send
        first)."""
        self.comm.send(tokens, 0)

    def recv_proposals(self, count: int) -> torch.Tensor:
        """On the first stage: the ``count`` proposals the last stage sends, int64."""
        like = torch.empty(count, dtype=torch.int64, device=self.device)
        return self.comm.recv(like, self.stage.count - 1)
