"""Row-wise argmax, the greedy pick and the exponential race's.

On the CPU, torch's ``argmax`` over a long row runs ~16x slower than ``amax``: it
tracks an index per element, unvectorised. For W1's decode steps (64 rows of
SmolLM2's 49152 logits) that was 3.6 ms a step against 0.23 ms for ``amax``.
:func:`row_argmax` takes each row's maximum per chunk with ``amax``, picks the first
chunk holding the row's maximum, and runs ``argmax`` on that chunk alone: the same
index as ``torch.argmax`` (the first occurrence of the maximum; a NaN counts as the
maximum, as there). A few float32 rows (a lone sequence's decode step) go to numpy's
``argmax`` instead: vectorised, single-threaded and one call, where the chunked pass is
several torch operators, each dispatched with caches the step's weights just flushed
(docs/bench.md, issue 29's W2 rows). numpy picks the same index (its first maximum, a
NaN first). Other devices keep ``torch.argmax``, which is
fast there.
"""

from __future__ import annotations

import numpy as np
import torch

#: Logits per chunk. Rows shorter than four chunks keep ``torch.argmax``. 512 rather
#: than 1024: the same ``amax`` pass, half the chunk read again (measured in docs/bench.md).
CHUNK = 512
#: Rows up to which float32 input takes numpy's argmax; above, the chunked pass's
#: threads win (they draw level at about 16 rows of a 49152-logit vocabulary).
NUMPY_ROWS = 8


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D ``x``: int64 ``[rows]``."""
    rows, width = x.shape
    if x.device.type != "cpu" or width < 4 * CHUNK or rows == 0:
        return x.argmax(dim=-1)
    if rows <= NUMPY_ROWS and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1))
    x = x.contiguous()
    full = width // CHUNK
    chunk_max = x[:, : full * CHUNK].view(rows, full, CHUNK).amax(dim=-1)
    if width % CHUNK:
        chunk_max = torch.cat((chunk_max, x[:, full * CHUNK:].amax(dim=-1, keepdim=True)), 1)
    # argmax over the chunk maxima: the first chunk holding the row's maximum (or NaN)
    start = chunk_max.argmax(dim=-1) * CHUNK
    cols = start[:, None] + torch.arange(CHUNK, device=x.device)
    picked = x.gather(1, cols.clamp_max(width - 1))
    # positions past the row's end (a short last chunk) repeat its last logit; past the
    # first copy of a value argmax never picks it, so no masking is needed
    return start + picked.argmax(dim=-1)
