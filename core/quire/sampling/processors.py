"""Per-request logits processors (the offline API's ``logits_processors``, as vLLM's
per-request processors): user callables that rewrite one row of logits before anything
else adjusts it. They run in the engine core's process, row by row, on float32 rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from quire.sampling_params import logits_processor_arity


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
    """Run each row owner's processors on its row, in order, writing the result back.

    :param rows: ``(row, owner)``; ``owner`` has ``params.logits_processors``,
        ``prompt_token_ids`` and ``output_token_ids`` (processors get copies of both).
    :raises ValueError: a processor returned something other than a row of the same
        shape."""
    for row, owner in rows:
        x = logits[row]
        for proc in owner.params.logits_processors:
            output = list(owner.output_token_ids)
            if logits_processor_arity(proc) == 3:
                x = proc(list(owner.prompt_token_ids), output, x)
            else:
                x = proc(output, x)
            if not isinstance(x, torch.Tensor) or x.shape != logits[row].shape:
                raise ValueError(f"logits processor {proc!r} must return a tensor of shape "
                                 f"{list(logits[row].shape)}, got {x!r:.80}")
        logits[row] = x
