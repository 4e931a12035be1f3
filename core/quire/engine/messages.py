"""What crosses between the engine's front (tokens to text) and its core (tokens to
tokens): typed msgspec structs, the same whether the core runs in this process or in its
own (then encoded as msgpack; never pickle).

The front sends :class:`CoreRequest` and the commands below; the core answers each step
with one :class:`CoreOutputs`: the new tokens of every sequence that got one (with raw
logprobs: ids and floats, no text), finishes decided by token rules, prompt logprobs, and
an :class:`EngineStats` snapshot, so that nobody reads the core's attributes.
"""

from __future__ import annotations

import msgspec

from quire.lora.request import LoRARequest
from quire.multimodal.inputs import MMItem
from quire.sampling.logprobs import TokenLogprobs
from quire.sampling_params import SamplingParams


class EngineStats(msgspec.Struct, frozen=True):
    """What the core reports of its state between two steps: the one message the server
    (metrics, health, placement across replicas, tests) reads instead of the scheduler's
    attributes."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    has_unfinished: bool
    #: Requests the core took since it started.
    num_requests: int = 0
    #: Speculative decoding since the core started: verifications of drafts, drafts
    #: proposed, drafts accepted, and drafts accepted at each position of a proposal.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    #: The most KV pages held at once since the core started.
    peak_used_blocks: int = 0
    #: KV pages held by the running sequences of each prompt-length band
    #: (:mod:`quire.engine.prompt_bands`; ``prompt_len_bands`` are the bands' upper
    #: bounds): a page shared by sequences of several bands counts in each.
    prompt_len_bands: list[int] = msgspec.field(default_factory=list)
    kv_blocks_by_prompt_len: list[int] = msgspec.field(default_factory=list)


class ThinkingTokens(msgspec.Struct, frozen=True):
    """Where a reasoning model's thinking is, so that a grammar holds only the answer
    after it: between ``start`` and ``end`` nothing is masked. ``start`` None: the
    thinking begins with the output (its template opened it); otherwise the model may
    open it with its first token, or answer at once."""

    end: int
    start: int | None = None


class CoreRequest(msgspec.Struct, frozen=True):
    """A request as the core takes it: token ids and parameters, already checked by the
    front (the core checks again)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: ``time.monotonic()`` when the front accepted it (one clock per host).
    arrival_time: float
    #: Lower is admitted first; sample ``i`` gets ``priority + i``.
    priority: int = 0
    #: Which front (API server) reads its outputs, when several share a core.
    client: int = 0
    #: With a grammar: the thinking it does not hold (None: it holds the whole output).
    thinking: ThinkingTokens | None = None
    #: The LoRA adapter it runs with (None: the base model).
    lora: LoRARequest | None = None
    #: Its images (an image-text model), their placeholders already in the prompt.
    mm: list[MMItem] = msgspec.field(default_factory=list)


class SeqUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news from one step."""

    request_id: str
    #: The sample (0 .. n-1) of the request.
    index: int
    token_id: int = -1
    #: The sampled token's raw logprob, rank and top alternatives, when asked for.
    logprobs: TokenLogprobs | None = None
    #: Set when a token rule (EOS, stop token, max_tokens, context) or an abort ended it.
    finish_reason: str | None = None
    #: The stop token id that ended it.
    stop_reason: int | None = None
    #: Prompt tokens served from the prefix cache (sample 0).
    num_cached_tokens: int = 0
    #: ``time.monotonic()`` when the sequence first left the waiting queue.
    first_scheduled_time: float | None = None
    #: An embedding request's pooled vector: little-endian float32 bytes (compact and
    #: exact across a process boundary), sent with its finish.
    embedding: bytes | None = None


class BeamHypothesis(msgspec.Struct, array_like=True):
    """One finished beam of a beam search request."""

    token_ids: list[int]
    cum_logprob: float
    #: ``cum_logprob / len(token_ids) ** length_penalty``.
    score: float
    finish_reason: str


class BeamResult(msgspec.Struct, array_like=True):
    """A beam search request's outcome, sent once when it finishes: its best ``n``
    hypotheses, best first (no per-token updates come before it)."""

    request_id: str
    hypotheses: list[BeamHypothesis]
    first_scheduled_time: float | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Raw logprobs of prompt tokens ``first + 1 ...`` of a request, from one step."""

    request_id: str
    first: int
    entries: list[TokenLogprobs]


class CoreOutputs(msgspec.Struct, omit_defaults=True):
    """One step's results (or, when idle, just the stats after a command)."""

    #: ``time.monotonic()`` when the step's tokens existed.
    time: float = 0.0
    updates: list[SeqUpdate] = msgspec.field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)
    #: Beam search requests that finished this step, with their hypotheses.
    beams: list[BeamResult] = msgspec.field(default_factory=list)
    #: Requests that ended in the core since its previous output (every sample finished).
    finished: list[str] = msgspec.field(default_factory=list)
    #: (request id, why) for requests the core refused after the front accepted them.
    refused: list[tuple[str, str]] = msgspec.field(default_factory=list)
    stats: EngineStats | None = None
    #: The step failed (a bug): every request of this core was aborted.
    error: str | None = None
    #: Which data-parallel replica sent it.
    engine: int = 0


class CoreInfo(msgspec.Struct, frozen=True):
    """What a core tells its front once it is ready: enough to settle the same
    ``ResolvedConfig`` and to check requests before sending them."""

    platform_name: str
    device_type: str
    #: The platform's defaults and the model's context, as ``EngineConfig.resolve`` takes them.
    platform_block_size: int
    platform_dtype: str
    model_max_len: int
    vocab_size: int
    num_blocks: int
    eos_token_ids: list[int]
    world_size: int
    #: Worker processes of its executor (0 when the core runs the model itself).
    worker_processes: int = 0
    #: What the core serves: ``generate`` or ``embed``.
    task: str = "generate"


# -- commands from a front to a core process (the in-process core takes method calls) --
class AddRequest(msgspec.Struct, tag=True):
    request: CoreRequest


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class StopSequence(msgspec.Struct, tag=True):
    """The front found a stop string in sample ``index``: finish it (reason "stop")."""

    request_id: str
    index: int


class Hello(msgspec.Struct, tag=True):
    """A front introduces itself: where the core sends its outputs."""

    client: int
    address: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = AddRequest | Abort | StopSequence | Hello | Shutdown
