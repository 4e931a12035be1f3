"""``AsyncEngine``: an ``LLMEngine`` driven by one background thread, fed from asyncio.

Ownership: the engine thread is the only thread that touches the ``LLMEngine`` (it is not
thread-safe). The asyncio side talks to it through one thread-safe command queue (add,
abort, abort all, call, stop) and hears back through one bounded sink per request, filled
with ``loop.call_soon_threadsafe``. Requests run as ``RequestOutputKind.DELTA``: a sink
holds only what its reader has not taken yet, and a reader that leaves more than
``max_stream_backlog`` outputs unread loses its request (aborted, logged). The
per-request sinks and the Prometheus metrics are owned by the engine thread (it observes
every output, aborted ones included, and renders the metrics for ``GET /metrics`` through
a call); the count of waiting requests is owned by the asyncio side.

A request added while others run joins the batch at the engine's next step; an abort is
applied before the next step, so its pages are free by the time that step runs.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import queue
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.core import Metric

from quire.engine import EngineStats, LLMEngine
from quire.engine.messages import ThinkingTokens
from quire.entrypoints.server.errors import ClientTooSlow
from quire.entrypoints.server.metrics import ServerMetrics, labelled, render_families
from quire.entrypoints.server.slo import SLOTargets
from quire.executor.abstract import WorkerDied
from quire.lora.request import LoRARequest
from quire.multimodal.inputs import MMItem
from quire.multimodal.media import MediaPolicy, media_policy
from quire.multimodal.processor import ImageInputs
from quire.outputs import EmbeddingRequestOutput, RequestOutput, RequestOutputKind
from quire.sampling_params import SamplingParams
from quire.structured.backend import GrammarBackend
from quire.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds the engine thread waits for a core process's outputs before it looks at its
#: commands again.
STEP_WAIT_S = 0.005


class Overloaded(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 503)."""


class EngineStopped(Exception):
    """The engine is shutting down or its thread died; no new requests are taken."""


class StreamBacklogExceeded(ClientTooSlow):
    """The reader left more outputs unread than the stream may hold; the request was
    aborted and its client is to be disconnected."""


# Commands the asyncio side puts on the queue; the engine thread runs them in order.
@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    loop: asyncio.AbstractEventLoop
    sink: _Sink
    accepted: asyncio.Future[None]
    thinking: ThinkingTokens | None = None
    #: An embedding request: the prompt's pooled vector, ``params`` unused.
    embed: bool = False
    lora_request: LoRARequest | None = None
    #: Its images, placeholders expanded in ``token_ids``.
    mm: list[MMItem] | None = None


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    """Abort every request, and refuse the adds that come after (the drain's end)."""


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future[Any]


class _Stop:
    pass


class _Sink:
    """One request's outputs on their way to its reader, at most ``cap`` of them.

    Lives on the event loop: ``offer`` runs there (the engine thread schedules it). Past
    the cap the sink drops what it holds, keeps only the error, and calls ``on_overflow``.
    """

    def __init__(self, cap: int, on_overflow: Callable[[], None]) -> None:
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._cap = cap
        self._on_overflow = on_overflow
        self._waiter: asyncio.Future[None] | None = None
        self.overflowed = False

    def offer(self, item: RequestOutput | BaseException) -> None:
        if self.overflowed:
            return
        if len(self._items) >= self._cap:
            self.overflowed = True
            self._items.clear()
            item = StreamBacklogExceeded(f"more than {self._cap} outputs were left unread")
            self._on_overflow()
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class RequestStream:
    """One accepted request's outputs, as an async iterator of ``DELTA`` outputs: each
    carries what is new since the previous one (``RequestOutput.add`` sums them up).

    The last output has ``finished=True``. Leaving the iteration early (a ``break``, an
    exception, a cancelled task) aborts the request, freeing its pages.
    """

    def __init__(self, owner: "AsyncEngine", request_id: str, sink: _Sink) -> None:
        self.request_id = request_id
        self._owner = owner
        self._sink = sink
        self._done = False
        self._started = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                item = await self._sink.get()
                if not self._started:
                    self._started = True
                    self._owner._left_waiting()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                self._done = item.finished
                yield item
        finally:
            self.abort()
            self._owner._in_flight.discard(self.request_id)

    def abort(self) -> None:
        """Stop the request if it still runs; safe to call more than once."""
        if not self._started:
            self._started = True
            self._owner._left_waiting()
        if not self._done:
            self._done = True
            self._owner._commands.put(_Abort(self.request_id))


class AsyncEngine:
    """Runs an ``LLMEngine`` in a background thread; every public method is called from
    one asyncio event loop.

    :param max_waiting_requests: most requests accepted but not yet producing output;
        beyond it :meth:`add_request` raises :class:`Overloaded`.
    :param max_stream_backlog: most outputs a request's reader may leave unread; past it
        the request is aborted and its stream raises :class:`StreamBacklogExceeded`.
    :param api_servers: API server processes serving alongside (shown in the metrics).
    :param slo: the latency objectives whose misses the metrics count.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 256,
                 max_stream_backlog: int = 1024, api_servers: int = 1,
                 slo: SLOTargets | None = None) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        if max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be >= 1, got {max_stream_backlog}")
        self._engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_stream_backlog = max_stream_backlog
        #: API server processes of this server (for the metrics).
        self.api_servers = api_servers
        # The API side's own tokenizer: fast tokenizers may fail ("Already borrowed")
        # when two threads use one instance, and the engine thread detokenizes.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len: int = engine.config.max_model_len
        self.model_path: str = engine.config.engine.model
        self._commands: queue.Queue[_Add | _Abort | _Call | _Stop] = queue.Queue()
        self._num_waiting = 0  # asyncio side only
        self._accepting = False
        self._in_flight: set[str] = set()  # asyncio side only, for shutdown
        self._next_id = 0
        # ids unique across the API servers of one deployment (each has its own counter)
        self._id_prefix = f"req-{secrets.token_hex(4)}-"
        self._metrics = ServerMetrics(self.max_model_len, slo)  # engine thread only
        self._grammars: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        #: Why the engine thread stopped on its own (a worker died), or None.
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="quire-engine", daemon=True)

    # -- lifecycle (asyncio side) ----------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call it from the event loop that will use it."""
        #: The event loop this engine serves (for callers on other threads).
        self.loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread.start()

    @property
    def task(self) -> str:
        """``generate`` or ``embed``: which routes this model answers (set when the
        engine was built, so reading it from the event loop is safe)."""
        return self._engine.task

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, give in-flight ones ``timeout`` seconds to finish, then
        abort the rest: their streams end normally, with finish reason "abort".

        The abort is one command to the engine thread, which knows every request it
        added, including those whose add was still queued when the drain began; adds
        queued after it are refused."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while self._in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._commands.put(_AbortAll())

    async def shutdown(self, drain_timeout: float = 5.0, join_timeout: float = 10.0) -> None:
        """:meth:`drain`, then stop and join the engine thread."""
        await self.drain(drain_timeout)
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, join_timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.1fs", join_timeout)

    # -- requests (asyncio side) -----------------------------------------------------------
    def close_unstarted(self) -> None:
        """Shut the engine down when the server never started (its app failed to build):
        no thread runs yet, so its cores and workers stop here."""
        if not self.is_running:
            self._engine.shutdown()

    @property
    def enable_lora(self) -> bool:
        """Whether the engine serves LoRA adapters."""
        return self._engine.config.engine.enable_lora

    def check_lora_adapter(self, path: str) -> None:
        """Refuse a path that is not an adapter this engine can run (called off the event
        loop: it reads the adapter's files).

        :raises ValueError: one line naming the problem (as ``LLMEngine.check_lora``)."""
        self._engine.check_adapter(path)

    def image_inputs(self) -> ImageInputs:
        """The model's image preprocessing, for the server's tokenizer threads (the
        engine builds it once, under a lock, and it is thread-safe).

        :raises ValueError: for a model that takes text only."""
        return self._engine.image_inputs()

    def media_policy(self) -> MediaPolicy:
        """Where request images may come from, as the engine's options say.

        :raises ValueError: for an ``allowed_local_media_path`` that is no directory."""
        return media_policy(self._engine.config.engine)

    async def add_request(self, token_ids: list[int], params: SamplingParams, *,
                          prompt: str | None = None, request_id: str | None = None,
                          on_overflow: Callable[[], None] | None = None,
                          max_backlog: int | None = None,
                          priority: int = 0,
                          thinking: ThinkingTokens | None = None,
                          embed: bool = False,
                          lora_request: LoRARequest | None = None,
                          mm: list[MMItem] | None = None) -> RequestStream:
        """Queue a request; returns once the engine has checked and accepted it.

        Its outputs are ``DELTA`` outputs, whatever ``params.output_kind`` says; with
        ``embed`` (an embedding model's request, ``params`` unused) one
        ``EmbeddingRequestOutput``.

        :param on_overflow: called (on the event loop) when the reader fell more than
            ``max_backlog`` outputs behind and the request was aborted for it.
        :param max_backlog: this request's cap on unread outputs (default:
            ``max_stream_backlog``).
        :param priority: the engine's admission priority (lower first).
        :param thinking: a reasoning model's thinking markers: the request's grammar then
            holds only the answer after its thinking.
        :param lora_request: the LoRA adapter it runs with (None: the base model).
        :param mm: its images, from :meth:`image_inputs` (placeholders expanded in
            ``token_ids``).

        :raises Overloaded: ``max_waiting_requests`` requests are already waiting.
        :raises EngineStopped: after :meth:`shutdown` began, or if the thread died.
        :raises ValueError: the engine refused the request (the message names why).
        """
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        if self._num_waiting >= self.max_waiting_requests:
            raise Overloaded(f"{self._num_waiting} requests are waiting "
                             f"(max_waiting_requests={self.max_waiting_requests})")
        if request_id is None:
            request_id = f"{self._id_prefix}{self._next_id}"
            self._next_id += 1
        if params.output_kind is not RequestOutputKind.DELTA:
            params = copy.copy(params)  # already checked; only the kind changes
            params.output_kind = RequestOutputKind.DELTA
        loop = asyncio.get_running_loop()
        rid = request_id
        cap = max_backlog or self.max_stream_backlog

        def overflowed() -> None:
            logger.warning("request %s aborted: its client left more than %d outputs "
                           "unread (--max-stream-backlog)", rid, cap)
            self._commands.put(_Abort(rid))
            if on_overflow is not None:
                on_overflow()

        sink = _Sink(cap, overflowed)
        accepted: asyncio.Future[None] = loop.create_future()
        self._num_waiting += 1
        self._commands.put(_Add(request_id, token_ids, params, prompt, priority, loop, sink,
                                accepted, thinking, embed, lora_request, mm))
        try:
            await accepted
        except BaseException:
            self._num_waiting -= 1
            if not accepted.done() or accepted.cancelled():  # we were cancelled meanwhile
                self._commands.put(_Abort(request_id))
            raise
        self._in_flight.add(request_id)
        stream = RequestStream(self, request_id, sink)
        return stream

    def check_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar (cached by its text), on the calling thread: the
        server calls it on its tokenizer threads, so that a new schema costs the engine
        thread nothing and a bad one is the client's 400 before anything is queued.

        :raises ValueError: naming why the grammar cannot be used.
        """
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = self._engine.grammars()
        self._grammars.check(spec)

    def _left_waiting(self) -> None:
        self._num_waiting -= 1

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        if not self._thread.is_alive():
            raise EngineStopped("the engine thread is not running")
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Call(fn, loop, result))
        return await result

    async def stats(self) -> EngineStats:
        """Scheduler and KV-cache figures, read on the engine thread."""
        return await self.call(lambda engine: engine.stats())

    async def render_metrics(self, timeout: float = 10.0) -> str:
        """The Prometheus exposition text of :meth:`metric_families`."""
        return render_families(await self.metric_families(timeout))

    async def metric_families(self, timeout: float = 10.0, **labels: str) -> list[Metric]:
        """The metric families, collected on the engine thread between steps, with
        ``labels`` on every sample.

        :raises EngineStopped: when the engine thread is not running.
        :raises TimeoutError: when no step boundary came within ``timeout`` seconds.
        """
        def collect(engine: LLMEngine) -> list[Metric]:
            processes = {"api_server": self.api_servers, **engine.process_counts()}
            return self._metrics.collect(engine.replica_stats(), processes)

        try:
            families = await asyncio.wait_for(self.call(collect), timeout)
        except asyncio.TimeoutError as exc:  # not the builtin one before Python 3.11
            raise TimeoutError(f"the engine thread did not answer within {timeout}s") from exc
        return labelled(families, **labels) if labels else families

    def num_waiting(self) -> int:
        """Requests accepted here that have not produced output yet (asyncio side)."""
        return self._num_waiting

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        sinks: dict[str, _Add] = {}
        self._closed = False  # engine thread only: set by _AbortAll
        while True:
            # Block only when there is nothing to step; otherwise just drain what came.
            block = not self._engine.has_unfinished_requests()
            try:
                if not self._drain(sinks, block):
                    break
                if self._engine.has_unfinished_requests():
                    self._step(sinks)
                elif block:
                    self._engine.check_health()  # a dead core is noticed while idle too
            except WorkerDied as exc:  # the model is gone: fail everything and stop
                logger.error("engine stopped: %s; failing %d requests", exc, len(sinks))
                self.failure = exc
                self._fail(sinks, RuntimeError(f"the engine failed: {exc}"))
                break
            except Exception as exc:  # a bug in a step: fail every request, keep serving
                logger.exception("engine step failed; failing %d requests", len(sinks))
                self._fail(sinks, RuntimeError(f"the engine failed: {exc}"))
        self._fail(sinks, EngineStopped("the server is shutting down"))
        self._refuse_pending()
        self._engine.shutdown()

    def _fail(self, sinks: dict[str, _Add], error: BaseException) -> None:
        for rid, add in list(sinks.items()):
            self._abort(rid)  # bookkeeping only: no step runs
            _deliver(add, error)
        sinks.clear()

    def _refuse_pending(self) -> None:
        """Answer commands that came after the stop, so that no caller waits forever."""
        stopped = EngineStopped("the engine thread has stopped")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _resolve(cmd.loop, cmd.accepted, None, stopped)
            elif isinstance(cmd, _Call):
                _resolve(cmd.loop, cmd.result, None, stopped)

    def _abort(self, request_id: str) -> RequestOutput | EmbeddingRequestOutput | None:
        out = self._engine.abort_request(request_id)
        self._observe(out)
        return out

    def _observe(self, out: RequestOutput | EmbeddingRequestOutput | None) -> None:
        if isinstance(out, RequestOutput):
            self._metrics.observe(out)
        elif isinstance(out, EmbeddingRequestOutput):
            self._metrics.observe_embedding(out)

    def _drain(self, sinks: dict[str, _Add], block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(sinks, cmd)
            elif isinstance(cmd, _Abort):
                self._abort_one(sinks, cmd.request_id)
            elif isinstance(cmd, _AbortAll):
                self._closed = True
                for rid in list(sinks):
                    self._abort_one(sinks, rid)
            elif isinstance(cmd, _Call):
                try:
                    _resolve(cmd.loop, cmd.result, cmd.fn(self._engine), None)
                except Exception as exc:
                    _resolve(cmd.loop, cmd.result, None, exc)

    def _abort_one(self, sinks: dict[str, _Add], request_id: str) -> None:
        add = sinks.pop(request_id, None)
        out = self._abort(request_id)
        if add is not None and out is not None:
            _deliver(add, out)

    def _add(self, sinks: dict[str, _Add], cmd: _Add) -> None:
        if self._closed:
            _resolve(cmd.loop, cmd.accepted, None,
                     EngineStopped("the server is shutting down"))
            return
        try:
            if cmd.embed:
                self._engine.add_embed_request(cmd.token_ids, prompt=cmd.prompt,
                                               request_id=cmd.request_id,
                                               priority=cmd.priority)
            else:
                self._engine.add_request(cmd.token_ids, cmd.params, prompt=cmd.prompt,
                                         request_id=cmd.request_id, priority=cmd.priority,
                                         thinking=cmd.thinking,
                                         lora_request=cmd.lora_request, mm=cmd.mm)
        except ValueError as exc:
            _resolve(cmd.loop, cmd.accepted, None, exc)
            return
        sinks[cmd.request_id] = cmd
        _resolve(cmd.loop, cmd.accepted, None, None)

    def _step(self, sinks: dict[str, _Add]) -> None:
        # A core in another process: wait for its outputs only briefly, so that adds and
        # aborts queued meanwhile reach it without waiting for a step to end.
        for out in self._engine.step(timeout=STEP_WAIT_S):
            self._observe(out)
            add = sinks.get(out.request_id)
            if add is None:
                continue
            if out.finished:
                del sinks[out.request_id]
            _deliver(add, out)


def _deliver(add: _Add, item: RequestOutput | BaseException) -> None:
    try:
        add.loop.call_soon_threadsafe(add.sink.offer, item)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any,
             exc: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():  # the waiter was cancelled
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop is closed
        pass
