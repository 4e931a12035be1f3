"""What a hardware plugin implements. Each module is one contract, documented where defined."""

from quire.interfaces.attention import AttentionBackend, AttentionBatch
from quire.interfaces.communicator import Communicator
from quire.interfaces.memory import MemoryProfiler
from quire.interfaces.platform import Availability, Platform

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "Availability",
    "Communicator",
    "MemoryProfiler",
    "Platform",
]
