"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from typing import Any, Union

from quire.beam_search import BeamSearchOutput, BeamSearchParams, beam_output
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.lora.request import LoRARequest
from quire.multimodal.chat import image_parts, walks_parts
from quire.multimodal.inputs import MMItem
from quire.outputs import EmbeddingRequestOutput, RequestOutput
from quire.plugins.registry import (
    DISABLE_PLUGINS_ENV,
    PlatformRegistry,
    parse_plugin_names,
)
from quire.sampling_params import SamplingParams

#: A prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``;
#: an image-text model's ``{"prompt": "...", "multi_modal_data": {"image": images}}``.
PromptType = Union[str, SequenceABC[int], Mapping[str, Any]]


class LLM:
    """Generate for a batch of prompts on one engine.

    Keyword arguments are the engine options of :class:`~quire.config.EngineConfig`
    (vLLM's names): ``device``, ``dtype``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``enable_chunked_prefill``,
    ``max_model_len``, ``seed``, ``kv_cache_memory``, ``compile``, and the parallel
    ones: ``tensor_parallel_size`` (a process per rank), ``pipeline_parallel_size``,
    ``data_parallel_size``, ``distributed_executor_backend``.

    With worker processes, call :meth:`shutdown` (or use ``with LLM(...) as llm``) to
    stop them at once; otherwise they stop when this process exits.
    """

    def __init__(self, model: str, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(model, **engine_options)
        blocked = parse_plugin_names(os.environ.get(DISABLE_PLUGINS_ENV))
        self.engine = LLMEngine(config, PlatformRegistry(blocked=blocked))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (the CLI builds it with its own registry)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def shutdown(self) -> None:
        """Stop the engine's worker processes (none at world size 1)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order.

        :param use_tqdm: show a progress bar of finished requests.
        :param lora_request: the LoRA adapter every prompt runs with, or one per prompt
            (None: the base model); needs ``enable_lora=True``.
        :raises ValueError: for an invalid prompt, parameters or adapter, before anything
            runs.
        """
        return self._collect(self._add_requests(prompts, sampling_params, lora_request),
                             use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search on every prompt (vLLM's ``LLM.beam_search``): one output per
        prompt, in prompt order, each with ``beam_width`` beams, best first. The search
        runs in the engine core; beams share their prefix pages.

        :raises ValueError: for an invalid prompt or parameters, before anything runs.
        """
        sp = params.to_sampling_params()
        outs = self._collect(self._add_requests(prompts, sp, lora_request), use_tqdm)
        return [beam_output(out, params.length_penalty) for out in outs]

    def _collect(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Run the queued requests to completion; their outputs in ``order``."""
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(order)) if use_tqdm else None
        for out in self._run(order, final_only=True):
            if out.finished:
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]

    def embed(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        *,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One pooled vector per prompt, in prompt order (an embedding model: one started
        with ``task="embed"``, or an encoder or sentence-transformers directory).

        Prompts are text (tokenized with the model's special tokens, as
        sentence-transformers does), token ids, or dicts as for :meth:`generate`.

        :raises ValueError: for a model that generates, or an invalid prompt (empty,
            longer than ``max_model_len`` or the step's token budget), before anything runs.
        """
        batch = _as_prompt_list(prompts)
        encoded = [self._encode(p) for p in batch]
        if any(mm for _, _, mm in encoded):
            raise ValueError("embedding requests take text only")
        order: list[str] = []
        try:
            for text, ids, _ in encoded:
                order.append(self.engine.add_embed_request(ids, prompt=text))
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: dict[str, EmbeddingRequestOutput] = {}
        bar = _progress(len(order)) if use_tqdm else None
        for out in self._run(order, final_only=True):
            if isinstance(out, EmbeddingRequestOutput):
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]

    def stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output every time it changes (cumulative text and ids).

        The last output of a request has ``finished=True``. Text withheld while it might
        still begin a stop string arrives later, so each text extends the previous one.
        Leaving the loop early aborts what is still running.
        """
        yield from self._run(self._add_requests(prompts, sampling_params))

    def chat(
        self,
        messages: SequenceABC[Mapping[str, Any]] | SequenceABC[SequenceABC[Mapping[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Each conversation is rendered with the tokenizer's chat template (or
        ``chat_template``, a Jinja string) and tokenized as is: the template places any
        special tokens itself.

        :raises ValueError: when the model has no chat template and none is given.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) \
            else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; pass one with "
                "chat_template=\"...\" (a Jinja template)"
            )
        encoded: list[tuple[str | None, list[int], list[MMItem]]] = []
        for conversation in conversations:
            conversation, images = self._chat_images(
                list(conversation), chat_template or tokenizer.chat_template)
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt)
            if images:
                ids, mm = self.engine.image_inputs().process(text, images,
                                                             add_special_tokens=False)
            else:
                ids, mm = tokenizer.encode(text, add_special_tokens=False), []
            encoded.append((text, ids, mm))
        params = _as_params_list(sampling_params, len(encoded))
        return self._collect(self._queue(encoded, params, [None] * len(encoded)), use_tqdm)

    def _chat_images(self, conversation: list[Mapping[str, Any]], template: str | None
                     ) -> tuple[list[dict[str, Any]], list[Any]]:
        """A conversation's image parts (``image_url``: data, http(s) and allowed
        file URLs; ``image_pil``) loaded, and the parts made ready for the template."""
        if not any(isinstance(m.get("content"), list) and any(
                isinstance(p, Mapping) and p.get("type") in ("image_url", "image_pil")
                for p in m["content"]) for m in conversation):
            return [dict(m) for m in conversation], []
        from quire.multimodal.media import load_image, media_policy  # PIL, on use

        inputs = self.engine.image_inputs()
        policy = media_policy(self.engine.config.engine)

        def load(part: Mapping[str, Any], where: str) -> Any:
            if part.get("type") == "image_pil":
                return part["image_pil"].convert("RGB")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, Mapping) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}.image_url must be {{'url': ...}}")
            return load_image(url, f"{where}.image_url", policy)

        return image_parts(conversation, inputs.placeholder, walks_parts(template), load)

    def _add_requests(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Check and queue every prompt, all or none; returns the request ids in order."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(batch)
        else:
            loras = list(lora_request)
            if len(loras) != len(batch):
                raise ValueError(f"{len(loras)} lora_request for {len(batch)} prompts")
        return self._queue([self._encode(p) for p in batch], params, loras)

    def _queue(self, encoded: list[tuple[str | None, list[int], list[MMItem]]],
               params: list[SamplingParams], loras: list[LoRARequest | None]) -> list[str]:
        """Queue encoded prompts, all or none; returns the request ids in order."""
        order: list[str] = []
        try:
            for (text, ids, mm), sp, lora in zip(encoded, params, loras):
                order.append(self.engine.add_request(ids, sp, prompt=text,
                                                     lora_request=lora, mm=mm))
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return order

    def _run(self, request_ids: list[str], final_only: bool = False
             ) -> Iterator[RequestOutput | EmbeddingRequestOutput]:
        pending = set(request_ids)
        try:
            while pending:
                for out in self.engine.step(final_only=final_only):
                    if out.request_id not in pending:
                        continue  # another caller's request on the same engine
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            for rid in pending:  # the caller stopped early, or a step raised
                self.engine.abort_request(rid)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int], list[MMItem]]:
        """(text, token ids, images) of one prompt."""
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt), []
        if isinstance(prompt, Mapping):
            if prompt.get("multi_modal_data") is not None:
                return self._encode_images(prompt)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), []
            if "prompt" in prompt:
                return self._encode(str(prompt["prompt"]))
            raise ValueError(
                f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}"
            )
        return None, list(prompt), []

    def _encode_images(self, prompt: Mapping[str, Any]
                       ) -> tuple[str, list[int], list[MMItem]]:
        data = prompt["multi_modal_data"]
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            got = sorted(data) if isinstance(data, Mapping) else repr(data)
            raise ValueError("multi_modal_data takes {'image': an image or a list of "
                             f"images}}; got {got}")
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' "
                             "(the model's processor expands each image's placeholder)")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for image in images:
            if not hasattr(image, "convert"):
                raise ValueError(f"multi_modal_data images must be PIL images, got "
                                 f"{type(image).__name__}")
        text = prompt["prompt"]
        ids, mm = self.engine.image_inputs().process(
            text, [image.convert("RGB") for image in images])
        return text, ids, mm


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


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm  # transformers' own dependency

    return tqdm(total=total, desc="requests", unit="req")
