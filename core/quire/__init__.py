"""Quire: an LLM inference and serving engine with a paged KV cache and pluggable backends."""

from quire.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from quire.lora.request import LoRARequest
from quire.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from quire.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "CompletionOutput", "EmbeddingRequestOutput", "LoRARequest",
           "RequestMetrics", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # LLM pulls in transformers and the model code; importing it lazily keeps
    # `import quire` (and the CLI's start) fast for commands that never load a model.
    if name == "LLM":
        from quire.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'quire' has no attribute {name!r}")
