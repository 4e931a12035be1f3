"""Optional ``torch.compile`` of a loaded model (``EngineConfig.compile``).

Inductor fuses the elementwise work between the matmuls (norms, rotary, SiLU, residual
adds), so a step runs far fewer kernels. Attention stays eager: the backend's per-step
metadata is Python data that would make every step a new graph, so a model calls
:meth:`~quire.models.context.ForwardContext.attention` from a method marked
``torch.compiler.disable`` that also reads the layer's index (an int read in traced code
would give each layer its own graph). Each layer is then a graph before attention and
one after it, the same two for every layer.

Shapes are left to Dynamo's automatic dynamism: the first step compiles for its exact
token count, the first differing one recompiles with a symbolic count, and no later
step compiles again.

Measured on the cpu platform (2-core AMD EPYC, SmolLM2-135M float32, 1 thread, a shared
host): no gain. Single-stream decode 67 ms/token against 59-63 eager, offline batch
132 against 159 tokens/s (eager uses packed linears, which Inductor cannot lower, so a
compiled model keeps ``F.linear``); a cold ``quire generate`` 54 s with an empty
Inductor cache, 20 s with a warm one, against 12 s eager. Off by default.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def compile_model(model: nn.Module) -> nn.Module:
    """Compile ``model.forward`` in place; the same object is returned.

    Only ``forward`` is compiled (``compute_logits`` is one matmul, and the model's
    other attributes stay as they are). Compilation itself happens at the first steps.
    """
    model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    logger.info("model forward will be compiled by torch.compile (Inductor)")
    return model
