"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence as SequenceABC
from typing import Any, Union

from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.outputs import RequestOutput
from quire.plugins.registry import DISABLE_PLUGINS_ENV, PlatformRegistry, parse_plugin_names
from quire.sampling_params import SamplingParams

#: A prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
PromptType = Union[str, SequenceABC[int], Mapping[str, Any]]


class LLM:
    """Generate for a batch of prompts on one engine.

    Keyword arguments are the engine options of :class:`~quire.config.EngineConfig`
    (vLLM's names): ``device``, ``dtype``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
    ``max_model_len``, ``seed``, ``kv_cache_memory``.
    """

    def __init__(self, model: str, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(model, **engine_options)
        blocked = parse_plugin_names(os.environ.get(DISABLE_PLUGINS_ENV))
        self.engine = LLMEngine(config, PlatformRegistry(blocked=blocked))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built elsewhere (the CLI builds it with its own registry)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order.

        :raises ValueError: for an invalid prompt or parameters, before anything runs.
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        encoded = [self._encode(p) for p in batch]
        order: dict[str, int] = {}
        try:
            for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
                order[self.engine.add_request(ids, sp, prompt=text)] = i
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(batch)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[order[out.request_id]] = out
        return [r for r in results if r is not None]

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(str(prompt["prompt"]))
            raise ValueError(
                f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}"
            )
        return None, list(prompt)


def _is_token_list(value: object) -> bool:
    return isinstance(value, SequenceABC) and not isinstance(value, str) and bool(value) \
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, SequenceABC):
        batch = list(prompts)
        for p in batch:
            if not (isinstance(p, (str, Mapping)) or _is_token_list(p)):
                raise ValueError(
                    "each prompt must be a string, a non-empty list of token ids, or a dict "
                    f"with 'prompt_token_ids'; got {type(p).__name__}: {p!r:.80}"
                )
        return batch
    raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")


def _as_params_list(
    params: SamplingParams | SequenceABC[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts; give one or {n}")
    return params
