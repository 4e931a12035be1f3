"""Which model class runs a checkpoint: Hugging Face architecture name -> ``nn.Module`` class.

The core's own architectures are fixed here; plugins add others as
:class:`~quire.plugins.spec.ModelSpec` records, passed in explicitly (no process-wide
table to mutate). A plugin may add an architecture but never replace a core one: a
checkpoint's meaning must not depend on which plugins happen to be installed.

Lookup is by ``config.architectures[0]``; configs without ``architectures`` (those built
from GGUF metadata) fall back to ``config.model_type`` for the core families.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from quire.plugins.spec import ModelSpec


def _core(name: str, module: str = "llama") -> ModelSpec:
    """The spec of core class ``name`` in ``quire.models.<module>``."""
    def load() -> type[nn.Module]:
        # Imported on use, so listing architectures never imports model code.
        return getattr(importlib.import_module(f"quire.models.{module}"), name)

    return ModelSpec(architecture=name, load=load)


#: The architectures the core implements.
CORE_MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        name: _core(name)
        for name in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
        )
    }
    | {"BertModel": _core("BertModel", "bert")}
    | {name: _core(name, "moe") for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")}
    | {"Gemma3ForCausalLM": _core("Gemma3ForCausalLM", "gemma3")}
    | {"MiMoForCausalLM": _core("MiMoForCausalLM", "mimo")}
    | {"LlavaForConditionalGeneration": _core("LlavaForConditionalGeneration", "llava")}
    | {"Qwen2_5_VLForConditionalGeneration": _core("Qwen2_5_VLForConditionalGeneration",
                                                   "qwen2_5_vl")}
    | {"Idefics3ForConditionalGeneration": _core("Idefics3ForConditionalGeneration",
                                                 "idefics3")}
    | {"LlavaNextForConditionalGeneration": _core("LlavaNextForConditionalGeneration",
                                                  "llava_next")}
    | {"Gemma3ForConditionalGeneration": _core("Gemma3ForConditionalGeneration",
                                               "gemma3_mm")}
)

#: ``config.model_type`` -> core architecture, for configs that name no architecture.
MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "bert": "BertModel",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "mimo": "MiMoForCausalLM",
    }
)


class ModelRegistry:
    """The core architectures plus those of the given plugin specs. Immutable once built.

    :param extra: plugin-provided specs, each alone or as ``(spec, distribution name)``
        (what ``PluginRegistry.model_specs()`` returns), the name then used in errors.
    :raises ValueError: when a spec names a core architecture (naming both), or two
        specs name the same architecture.
    """

    def __init__(self, extra: Iterable[ModelSpec | tuple[ModelSpec, str]] = ()) -> None:
        specs = dict(CORE_MODELS)
        sources: dict[str, str] = {name: "quire (core)" for name in CORE_MODELS}
        for item in extra:
            spec, source = item if isinstance(item, tuple) else (item, _describe(item.load))
            name = spec.architecture
            if name in CORE_MODELS:
                raise ValueError(
                    f"plugin model {name!r} from {source} may not replace the core "
                    f"implementation quire.models.llama.{name}"
                )
            if name in specs:
                raise ValueError(
                    f"model {name!r} is provided twice: by {sources[name]} and by {source}"
                )
            specs[name], sources[name] = spec, source
        self._specs: Mapping[str, ModelSpec] = MappingProxyType(specs)

    def supported(self) -> list[str]:
        """Every architecture name this registry resolves, sorted."""
        return sorted(self._specs)

    def resolve(self, config: Any) -> type[nn.Module]:
        """The model class for ``config`` (a Hugging Face ``PretrainedConfig``).

        :raises ValueError: when neither ``architectures[0]`` nor (without architectures)
            ``model_type`` is supported; the message lists what is.
        """
        architectures = getattr(config, "architectures", None) or []
        model_type = getattr(config, "model_type", None)
        if architectures:
            name = architectures[0]
        else:
            name = MODEL_TYPES.get(model_type or "", "")
        spec = self._specs.get(name)
        if spec is None:
            asked = f"architecture {architectures[0]!r}" if architectures else "no architecture"
            raise ValueError(
                f"unsupported model: {asked} (model_type {model_type!r}); supported "
                f"architectures: {', '.join(self.supported())}; model types without an "
                f"architecture: {', '.join(sorted(MODEL_TYPES))}"
            )
        return spec.load()


def resolve_architecture(
    config: Any, extra: Iterable[ModelSpec | tuple[ModelSpec, str]] = ()
) -> type[nn.Module]:
    """Shorthand for ``ModelRegistry(extra).resolve(config)``."""
    return ModelRegistry(extra).resolve(config)


def _describe(load: Any) -> str:
    # A spec alone does not say which plugin it came from; its loader's module does.
    module = getattr(load, "__module__", None) or "?"
    return f"loader {module}.{getattr(load, '__qualname__', repr(load))}"
