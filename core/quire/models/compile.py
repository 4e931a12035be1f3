"""Optional ``torch.compile`` of a loaded model (``EngineConfig.compile``).

Inductor fuses the elementwise work between the matmuls (norms, rotary, SiLU, residual
adds), so a step runs far fewer kernels. Attention stays eager: the backend's per-step
metadata is Python data that would make every step a new graph, so a model calls
:meth:`~quire.models.context.ForwardContext.attention` from a method marked
:func:`never_traced` (``torch.compiler.disable`` once compiling) that also reads the
layer's index (an int read in traced code would give each layer its own graph). Each
layer is then a graph before attention and one after it, the same two for every layer.

Shapes are left to Dynamo's automatic dynamism: the first step compiles for its exact
token count, the first differing one recompiles with a symbolic count, and no later
step compiles again.

Measured on the cpu platform (2-core AMD EPYC, SmolLM2-135M float32): a loss, so off by
default. The platform's C kernels (panel products, whole decode layers) are ``ctypes``
calls and packed weights, which Inductor cannot trace, so a compiled model runs
``F.linear`` and torch operators instead. On 2026-11-30 (commit ``2b54b11``,
``docs/results/2026-11-30-d/``): ``quire bench latency --workload W2 --compile true``
ITL p50 52.5 ms against 9.3 ms eager; ``quire bench throughput --workload W1 --compile
true --repeats 1`` 298 total tokens/s against ~498 eager; ``quire generate --compile
true`` 15.0 s wall with a warm Inductor cache, against 8.6-9.3 s eager. (Before the C
kernels, with oneDNN products: 67 against 59-63 ms/token, 132 against 159 tokens/s.)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from quire.models.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


_NEVER_TRACED = "_quire_never_traced"

Method = TypeVar("Method", bound=Callable[..., Any])


def never_traced(method: Method) -> Method:
    """Mark a module method that ``torch.compile`` must run eagerly (a graph break).

    :func:`compile_model` wraps the marked methods in ``torch.compiler.disable`` when it
    compiles. Decorating with ``torch.compiler.disable`` at class definition imports
    Dynamo, a large share of every start, compiled or not (docs/bench.md, "Start-up").
    """
    setattr(method, _NEVER_TRACED, True)
    return method


def _disable_marked(model: nn.Module) -> int:
    """Give every module of ``model`` its marked methods wrapped in
    ``torch.compiler.disable`` (instance attributes); how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        names = {name for klass in type(module).__mro__ for name, attr in vars(klass).items()
                 if getattr(attr, _NEVER_TRACED, False)}
        for name in names:
            object.__setattr__(module, name, torch.compiler.disable(getattr(module, name)))
            wrapped += 1
    return wrapped


def compile_model(model: nn.Module) -> nn.Module:
    """Compile ``model.forward`` in place; the same object is returned.

    Only ``forward`` is compiled (``compute_logits`` is one matmul, and the model's
    other attributes stay as they are); methods marked :func:`never_traced` run eagerly.
    Compilation itself happens at the first steps.
    """
    _disable_marked(model)
    # a whole table: a traced step then never reads a position back to fill one
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover(module.max_position)
    model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    logger.info("model forward will be compiled by torch.compile (Inductor)")
    return model
