"""Collectives between model-parallel ranks, implemented once over ``torch.distributed``.

Platforms pass their own backend name; none is named here (see torch_communicator).
"""

from quire.distributed.torch_communicator import TorchDistributedCommunicator

__all__ = ["TorchDistributedCommunicator"]
