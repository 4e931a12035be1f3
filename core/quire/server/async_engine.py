"""``AsyncEngine``: an ``LLMEngine`` driven by one background thread, fed from asyncio.

Ownership: the engine thread is the only thread that touches the ``LLMEngine`` (it is not
thread-safe). The asyncio side talks to it through one thread-safe command queue (add,
abort, call, stop) and hears back through one ``asyncio.Queue`` per request, filled with
``loop.call_soon_threadsafe``. The per-request sinks and the Prometheus metrics are owned
by the engine thread (it observes every output, aborted ones included, and renders the
metrics for ``GET /metrics`` through a call); the count of waiting requests is owned by
the asyncio side.

A request added while others run joins the batch at the engine's next step; an abort is
applied before the next step, so its pages are free by the time that step runs.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from quire.engine import LLMEngine
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams
from quire.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Overloaded(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 503)."""


class EngineStopped(Exception):
    """The engine is shutting down or its thread died; no new requests are taken."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken on the engine thread between two steps."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    has_unfinished: bool


# Commands the asyncio side puts on the queue; the engine thread runs them in order.
@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestOutput | BaseException]
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future[Any]


class _Stop:
    pass


class RequestStream:
    """One accepted request's outputs, as an async iterator of cumulative outputs.

    The last output has ``finished=True``. Leaving the iteration early (a ``break``, an
    exception, a cancelled task) aborts the request, freeing its pages.
    """

    def __init__(self, owner: "AsyncEngine", request_id: str,
                 sink: asyncio.Queue[RequestOutput | BaseException]) -> None:
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
    """

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self._engine = engine
        self.max_waiting_requests = max_waiting_requests
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
        self._metrics = ServerMetrics(self.max_model_len)  # engine thread only
        self._thread = threading.Thread(target=self._run, name="quire-engine", daemon=True)

    # -- lifecycle (asyncio side) ----------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call it from the event loop that will use it."""
        #: The event loop this engine serves (for callers on other threads).
        self.loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._accepting

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, give in-flight ones ``timeout`` seconds to finish, then
        abort the rest: their streams end normally, with finish reason "abort"."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while self._in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._in_flight):
            self._commands.put(_Abort(rid))

    async def shutdown(self, drain_timeout: float = 5.0, join_timeout: float = 10.0) -> None:
        """:meth:`drain`, then stop and join the engine thread."""
        await self.drain(drain_timeout)
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, join_timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.1fs", join_timeout)

    # -- requests (asyncio side) -----------------------------------------------------------
    async def add_request(self, token_ids: list[int], params: SamplingParams, *,
                          prompt: str | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request; returns once the engine has checked and accepted it.

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
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: asyncio.Future[None] = loop.create_future()
        self._num_waiting += 1
        self._commands.put(_Add(request_id, token_ids, params, prompt, loop, sink, accepted))
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
        return await self.call(_read_stats)

    async def render_metrics(self, timeout: float = 10.0) -> str:
        """The Prometheus exposition text, rendered on the engine thread between steps.

        :raises EngineStopped: when the engine thread is not running.
        :raises TimeoutError: when no step boundary came within ``timeout`` seconds.
        """
        render = self.call(lambda engine: self._metrics.render(_read_stats(engine)))
        try:
            return await asyncio.wait_for(render, timeout)
        except asyncio.TimeoutError as exc:  # not the builtin one before Python 3.11
            raise TimeoutError(f"the engine thread did not answer within {timeout}s") from exc

    def num_waiting(self) -> int:
        """Requests accepted here that have not produced output yet (asyncio side)."""
        return self._num_waiting

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        sinks: dict[str, _Add] = {}
        while True:
            # Block only when there is nothing to step; otherwise just drain what came.
            block = not self._engine.has_unfinished_requests()
            try:
                if not self._drain(sinks, block):
                    break
                if self._engine.has_unfinished_requests():
                    self._step(sinks)
            except Exception as exc:  # a bug in a step: fail every request, keep serving
                logger.exception("engine step failed; failing %d requests", len(sinks))
                for rid, add in list(sinks.items()):
                    self._abort(rid)
                    _deliver(add, RuntimeError(f"the engine failed: {exc}"))
                sinks.clear()
        for rid, add in sinks.items():
            self._abort(rid)
            _deliver(add, EngineStopped("the server is shutting down"))
        self._refuse_pending()

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

    def _abort(self, request_id: str) -> RequestOutput | None:
        out = self._engine.abort_request(request_id)
        if out is not None:
            self._metrics.observe(out)
        return out

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
                add = sinks.pop(cmd.request_id, None)
                out = self._abort(cmd.request_id)
                if add is not None and out is not None:
                    _deliver(add, out)
            elif isinstance(cmd, _Call):
                try:
                    _resolve(cmd.loop, cmd.result, cmd.fn(self._engine), None)
                except Exception as exc:
                    _resolve(cmd.loop, cmd.result, None, exc)

    def _add(self, sinks: dict[str, _Add], cmd: _Add) -> None:
        try:
            self._engine.add_request(cmd.token_ids, cmd.params, prompt=cmd.prompt,
                                     request_id=cmd.request_id)
        except ValueError as exc:
            _resolve(cmd.loop, cmd.accepted, None, exc)
            return
        sinks[cmd.request_id] = cmd
        _resolve(cmd.loop, cmd.accepted, None, None)

    def _step(self, sinks: dict[str, _Add]) -> None:
        for out in self._engine.step():
            self._metrics.observe(out)
            add = sinks.get(out.request_id)
            if add is None:
                continue
            if out.finished:
                del sinks[out.request_id]
            _deliver(add, out)


def _read_stats(engine: LLMEngine) -> EngineStats:
    sched, bm = engine.scheduler, engine.block_manager
    return EngineStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_usage=bm.usage, num_used_blocks=bm.num_used_blocks, num_blocks=bm.num_blocks,
        num_preemptions=sched.stats.num_preemptions, prefix_queries=sched.stats.prefix_queries,
        prefix_hits=sched.stats.prefix_hits, has_unfinished=engine.has_unfinished_requests(),
    )


def _deliver(add: _Add, item: RequestOutput | BaseException) -> None:
    try:
        add.loop.call_soon_threadsafe(add.sink.put_nowait, item)
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
