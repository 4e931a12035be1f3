"""The small records a plugin hands to the registry through its hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn

    from quire.interfaces.platform import Platform

#: The plugin API this core provides, "MAJOR.MINOR". A plugin built for MAJOR.m works when
#: MAJOR is equal and m <= MINOR; anything else is refused with both versions named. So a
#: MINOR release only adds, with a default for whatever a plugin built for an older MINOR
#: lacks; removing or changing anything is a new MAJOR.
#:
#: 1.0: Platform, AttentionBackend, Communicator (collectives), MemoryProfiler.
#: 1.1: Communicator.send and Communicator.recv, for pipeline parallelism; a 1.0
#:      communicator inherits defaults that raise NotImplementedError.
#: 1.2: Platform.auto_dtype (what ``dtype="auto"`` means per checkpoint),
#:      Platform.details (lines for ``quire plugins``), Platform.graph_capture with
#:      AttentionBackend.update_metadata (decode steps replayed from device graphs),
#:      Platform.child_environment (variables for the processes Quire starts); a 1.1
#:      platform inherits defaults (its first supported dtype; no lines; no graphs; no
#:      variables).
#: 1.3: quantised weights: Platform.quantizations (the ``quantization`` methods a
#:      platform runs) and the op set's ``quantized_linear`` (a product on a
#:      ``QuantizedTensor``, quire.quantization); a 1.2 platform inherits the
#:      reference op, which runs gguf, int8 and fp8 on any torch device, and is refused
#:      w8a8.
#:      Quantised KV pages: AttentionBackend.kv_cache_dtypes (the ``kv_cache_dtype``
#:      values a backend takes besides ``auto``) and AttentionBackend.kv_cache_bytes
#:      (what the KV pool is sized by); a 1.2 backend declares none, so it is refused
#:      anything but ``auto`` at start.
#: 1.4: AttentionBackend.releases_kv_memory and release_kv_pages (a KV pool's unused
#:      pages given back, for one memory budget shared by several models); a 1.3
#:      backend gives nothing back, so its models split that budget evenly.
#: 1.5: Platform.bf16_activations (weight-only quantised products on bfloat16-rounded
#:      activations in a float32 model, the op's ``bf16_activations`` keyword) and
#:      Platform.settle_options (host-dependent options made explicit for workers); a
#:      1.4 platform keeps its float products and its options as given.
#: 1.6: int8 KV pages hold each group of 16 in the Hadamard basis (quire.ops.kv_quant),
#:      which a backend says with AttentionBackend.kv_int8_hadamard; a 1.5 backend that
#:      declares int8 pages wrote the plain layout and is refused int8 at start (its fp8
#:      and float pages are unchanged).
PLUGIN_API_VERSION = "1.6"


@dataclass(frozen=True)
class PlatformSpec:
    """One platform a plugin provides."""

    #: The device name users pass to ``--device`` (lower-case).
    name: str
    #: The :data:`PLUGIN_API_VERSION` the plugin was built against.
    api_version: str
    #: Builds the platform. Must not import vendor libraries (see Platform's docs).
    factory: Callable[[], "Platform"]
    #: One line for ``quire plugins``.
    description: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """One model implementation, for a Hugging Face ``architectures`` entry."""

    #: e.g. "LlamaForCausalLM".
    architecture: str
    #: Imports and returns the ``nn.Module`` class (lazily, so listing stays cheap).
    load: Callable[[], "type[nn.Module]"]
