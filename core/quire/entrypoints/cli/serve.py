"""``quire serve``: the OpenAI-compatible HTTP server (uvicorn) over one engine, or over
one engine per model when several are served (each its own core process, all under one
KV memory budget)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from quire.entrypoints.cli.common import (
    UsageError,
    open_registry,
    read_chat_template,
    resolve_device,
)
from quire.entrypoints.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
    engine_error,
)
from quire.entrypoints.cli.listener import bind_listener, check_port, url
from quire.entrypoints.cli.model_list import (
    ModelEntry,
    model_entries,
    model_items,
    served_names,
    single_model,
)
from quire.entrypoints.cli.serve_grpc import (
    add_grpc_options,
    check_grpc_flags,
    grpc_server,
    settle_grpc_port,
)
from quire.entrypoints.server.limits import (
    MIN_DEFAULT_PROMPT_BYTES,
    PROMPT_BYTES_PER_TOKEN,
    ServerLimits,
    flag,
)
from quire.entrypoints.server.slo import SLOTargets

if TYPE_CHECKING:
    from quire.config import EngineConfig
    from quire.engine.core_client import CoreClient
    from quire.engine.kv_budget import KVShareSpec
    from quire.entrypoints.grpc.server import GrpcServer
    from quire.entrypoints.server.async_engine import AsyncEngine
    from quire.plugins.registry import PlatformRegistry

#: ``--api-key`` when neither the flag nor ``--config`` gives one (vLLM reads VLLM_API_KEY):
#: a key in the environment is not shown by ``ps`` as a command line is.
API_KEY_ENV = "QUIRE_API_KEY"

#: The help of each ``ServerLimits`` field's flag; the flag's name and default come from
#: the field.
_LIMIT_HELP: dict[str, str] = {
    "max_body_bytes": "largest request body, in bytes; a larger one gets HTTP 413",
    "max_prompt_bytes": f"largest prompt text of one request, in UTF-8 bytes (default: "
                        f"{PROMPT_BYTES_PER_TOKEN} per token of the context, at least "
                        f"{MIN_DEFAULT_PROMPT_BYTES})",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string, in characters; streams hold back "
                             "that many",
    "max_sequences_per_request": "most sequences per request: prompts times n",
    "max_stream_backlog": "most outputs a stream may queue unread; beyond it the client "
                          "is disconnected and its request aborted",
    "header_timeout_s": "seconds a client may take to send a request's headers, from the "
                        "connection's opening or the request's first byte; then the "
                        "connection is closed",
    "body_timeout_s": "seconds a client may take to send a request's body, once its "
                      "headers are in",
    "stream_send_timeout_s": "seconds a stream may wait for the client to take one event "
                             "before it is cut",
}


def register(subparsers: "argparse._SubParsersAction[Any]") -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and friends.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 for every interface (default: "
                             "%(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to bind, 0-65535; 0: any free one, told in the start "
                             "line (default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                             f"${API_KEY_ENV}; prefer it or --config to this flag, which "
                             "'ps' shows to every user)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests queued beyond this get HTTP 503 (default: "
                             "%(default)s)")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model gives it (vLLM's 'serve MODEL')")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name clients use, one per --model when several "
                             "are served (default: --model)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT's format) served from the start, each "
                             "chosen by a request's model field: NAME=PATH or vLLM's JSON "
                             "'{\"name\": NAME, \"path\": PATH}'; needs --enable-lora")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file, for a model that has none (or "
                             "instead of its own) (default: the tokenizer's)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="for quire's and uvicorn's logs; 'info' writes one access "
                             "line per request (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight requests may run on "
                             "before they are aborted (default: %(default)s)")
    parser.add_argument("--limit-concurrency", type=int, default=512, metavar="N",
                        help="most open connections (or requests in progress) before new "
                             "requests get HTTP 503; 0: no cap. 512 holds the waiting queue, "
                             "the running batch and idle keep-alive clients, well within the "
                             "usual limit of 1024 open files (default: %(default)s)")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                        help="how long an idle keep-alive connection is kept open "
                             "(default: %(default)s)")
    from quire.entrypoints.server.reasoning_parsers import PARSERS as REASONING
    from quire.entrypoints.server.tool_parsers import PARSERS

    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="the model family's tool-call format, read for tool_choice "
                             "'auto': hermes (Hermes, Qwen 2.5/3), llama3_json (Llama 3.x), "
                             "mistral; without it only 'required' and named tool choices "
                             "work")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING),
                        help="put a reasoning model's thinking in reasoning_content, apart "
                             "from the answer: qwen3 (<think>...</think> first), "
                             "deepseek_r1 (thinking up to </think>)")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="API server processes sharing the port: each runs HTTP, "
                             "tokenization and detokenization, all feeding the same "
                             "engine core(s) (default: %(default)s)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine core in the API server's process (one "
                             "process fewer, but HTTP, detokenization and the model then "
                             "share one interpreter); one API server, no data parallelism")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                        help="count requests whose time to first token exceeds this in "
                             "quire:request_slo_missed_total{slo=\"ttft\"} (default: not "
                             "tracked)")
    parser.add_argument("--slo-e2e", type=float, default=None, metavar="SECONDS",
                        help="count requests whose end-to-end latency exceeds this in "
                             "quire:request_slo_missed_total{slo=\"e2e\"} (default: not "
                             "tracked)")
    _add_limit_options(parser)
    add_grpc_options(parser)
    add_engine_options(parser, many_models=True)
    parser.set_defaults(run=run)


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServerLimits`` field, its default the field's."""
    defaults = ServerLimits()
    for field in dataclasses.fields(ServerLimits):
        default = getattr(defaults, field.name)
        seconds = field.name.endswith("_s")
        shown = "" if default is None else " (default: %(default)s)"
        parser.add_argument(flag(field.name), type=float if seconds else int, default=default,
                            metavar="SECONDS" if seconds else "N",
                            help=_LIMIT_HELP[field.name] + shown)


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """:raises UsageError: naming the flag whose value ``ServerLimits`` rejected."""
    values = {f.name: getattr(args, _dest(f.name)) for f in dataclasses.fields(ServerLimits)}
    try:
        return ServerLimits(**values)
    except ValueError as exc:
        name, _, reason = str(exc).partition(" ")  # its messages begin with the field
        if name in values:
            raise UsageError(f"{flag(name)}: {reason}") from exc
        raise UsageError(str(exc)) from exc


def slo_from_args(args: argparse.Namespace) -> SLOTargets:
    """``--slo-ttft``/``--slo-e2e`` as :class:`SLOTargets`.

    :raises UsageError: naming the flag whose value is refused."""
    for name, value in (("--slo-ttft", args.slo_ttft), ("--slo-e2e", args.slo_e2e)):
        if value is not None and not (0 < value < float("inf")):
            raise UsageError(f"{name}: must be a number of seconds > 0, got {value}")
    return SLOTargets(args.slo_ttft, args.slo_e2e)


def fetch_model_once(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """``config`` once a Hub model is in the cache (:func:`quire.hub.fetch_model`), here,
    before any core or API server starts; the API servers parse ``args.argv`` again, so
    it gets the commit fetched as ``--revision`` too.

    :raises UsageError: the one line that says why the model cannot be had.
    """
    from quire.hub import fetch_model

    try:
        fetched = fetch_model(config)
    except ValueError as exc:
        raise engine_error(exc) from exc
    if fetched.revision != config.revision:
        args.argv = [*args.argv, "--revision", fetched.revision]
    return fetched


def api_key_from(args: argparse.Namespace,
                 environ: Mapping[str, str] | None = None) -> str | None:
    """``--api-key`` (from the command line or ``--config``), else ``$QUIRE_API_KEY``."""
    if args.api_key is not None:
        return str(args.api_key)
    environ = os.environ if environ is None else environ
    return environ.get(API_KEY_ENV) or None


def connection_options(args: argparse.Namespace, limits: ServerLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` options that bound connections: the header deadline, the
    cap on connections, the keep-alive time."""
    from quire.entrypoints.server.http_protocol import http_protocol_class

    return {"http": http_protocol_class(limits.header_timeout_s),
            "limit_concurrency": args.limit_concurrency or None,
            "timeout_keep_alive": args.timeout_keep_alive}


def _dest(name: str) -> str:
    """The ``args`` attribute of limit ``name``'s flag."""
    return flag(name)[2:].replace("-", "_")


def run(args: argparse.Namespace) -> int:
    """Check every flag, bind the port, then fetch the model and serve it.

    Whatever the command line alone can refute is refused before the model is fetched or
    loaded (a minute, for a large one), each in one line naming its flag; the listening
    socket is bound then too, so a port in use is told at once.
    """
    check_server_flags(args)
    limits = limits_from_args(args)
    slo_from_args(args)
    if len(model_items(args)) > 1:
        return _run_models(args, limits)
    single_model(args)
    config = engine_config_from_args(args)
    template = read_chat_template(args.chat_template)
    _configure_logging(args.log_level)
    registry = open_registry(args)
    resolve_device(registry, config.device)
    listener = _bind_http(args)
    try:
        settle_grpc_port(args)
        config = fetch_model_once(args, config)
        if args.api_server_count > 1:
            from quire.entrypoints.cli.serve_processes import run_api_servers

            return run_api_servers(args, config, registry.blocked, listener)
        return serve(args, limits, config, registry, listener, chat_template=template,
                     on_started=lambda: _announce(args, listener))
    finally:
        if listener is not None:
            listener.close()


def _bind_http(args: argparse.Namespace) -> socket.socket | None:
    """The HTTP port's listening socket; None with ``--no-http``."""
    return None if args.no_http else bind_listener(args.host, args.port)


def check_server_flags(args: argparse.Namespace) -> None:
    """The checks of serve's own flags that need no model.

    :raises UsageError: naming the first flag whose value is refused.
    """
    check_port(args.port)
    if args.shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout: must be >= 0")
    if args.max_waiting_requests < 1:
        raise UsageError("--max-waiting-requests: must be >= 1")
    if args.limit_concurrency < 0:
        raise UsageError("--limit-concurrency: must be >= 0 (0: no cap)")
    if not args.timeout_keep_alive > 0:
        raise UsageError("--timeout-keep-alive: must be > 0")
    if any(not name.strip() for name in served_names(args)):
        raise UsageError("--served-model-name: must not be empty")
    if args.api_key is not None and not str(args.api_key).strip():
        raise UsageError("--api-key: must not be empty")
    if args.api_server_count < 1:
        raise UsageError("--api-server-count: must be >= 1")
    if args.engine_in_process and (args.data_parallel_size > 1
                                   or args.api_server_count > 1):
        raise UsageError("--engine-in-process: runs one engine core in one API server; "
                         "drop it to use --data-parallel-size or --api-server-count")
    check_grpc_flags(args)


def _announce(args: argparse.Namespace, listener: socket.socket | None) -> None:
    """uvicorn's start line, which it writes only for a socket it bound itself (none
    with ``--no-http``; the gRPC server writes its own)."""
    if listener is not None:
        logging.getLogger("uvicorn.error").info(
            "Uvicorn running on %s (Press CTRL+C to quit)", url(args.host, listener))


def serve(args: argparse.Namespace, limits: ServerLimits, config: EngineConfig,
          registry: PlatformRegistry, listener: socket.socket | None, *,
          chat_template: str | None = None, client: CoreClient | None = None,
          on_started: Callable[[], None] | None = None) -> int:
    """One API server on ``listener``: its engine front, the app, uvicorn until a signal
    or a failure.

    :param listener: the bound, listening socket (shared with the other API servers
        under ``--api-server-count``; None with ``--no-http``); uvicorn closes it when it
        stops. With ``--grpc-port`` the gRPC server runs beside it on the same loop.
    :param chat_template: the Jinja text of ``--chat-template``.
    :param client: the engine cores to use (another process started them); by default
        they are started here (or built in this process with ``--engine-in-process``).
    :param on_started: called once uvicorn (and gRPC) serve.
    """
    try:  # the flag's form and --enable-lora first: no engine start for a typo
        parse_lora_modules(args.lora_modules)
        if args.lora_modules and not config.enable_lora:
            raise ValueError("LoRA modules given, but LoRA is disabled: add --enable-lora")
    except ValueError as exc:
        raise UsageError(f"--lora-modules: {exc}") from None
    async_engine = _start_engine(args, limits, config, registry, client)
    try:
        app = _create_app(args, limits, async_engine, chat_template)
    except BaseException:
        async_engine.close_unstarted()  # its cores and workers, before the error goes up
        raise
    return _run_uvicorn(args, limits, app, _Engines([async_engine]), listener, on_started)


def _run_uvicorn(args: argparse.Namespace, limits: ServerLimits, app: Any,
                 engines: _Engines, listener: socket.socket | None,
                 on_started: Callable[[], None] | None) -> int:
    """Serve ``app`` on ``listener`` (and gRPC on ``--grpc-port``) until a signal or an
    engine's failure; the exit status (1: an engine or the gRPC server failed). Without
    a listener (``--no-http``) uvicorn binds nothing and only runs the app's lifespan,
    the signals and the drain."""
    import uvicorn

    # On SIGINT/SIGTERM uvicorn stops accepting, waits for connections to close, runs
    # the app's lifespan shutdown (which joins the engine threads) and returns; its own
    # timeout is only a backstop, as the drain ends every stream first. Our AccessLog
    # middleware writes the access lines (with request id and tokens), so uvicorn's own
    # access log is off.
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                               timeout_graceful_shutdown=args.shutdown_timeout + 5,
                               **connection_options(args, limits))
    server = _graceful_server_class()(uv_config, engines, args.shutdown_timeout,
                                      on_started,
                                      grpc_server(args, limits, app, api_key_from(args)))
    server.run(sockets=[] if listener is None else [listener])
    failure = engines.failure or server.grpc_failure
    if failure is not None:  # a supervisor should restart us
        logging.getLogger("quire").error("exiting: %s", failure)
        return 1
    return 0


class _Engines:
    """The engines of one server, as its graceful stop sees them."""

    def __init__(self, engines: list[AsyncEngine]) -> None:
        self.engines = engines

    @property
    def failure(self) -> BaseException | None:
        """Why the first engine that stopped on its own did, or None."""
        return next((e.failure for e in self.engines if e.failure is not None), None)

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(e.drain(timeout) for e in self.engines))


def _run_models(args: argparse.Namespace, limits: ServerLimits) -> int:
    """Serve several models from one API server, each model's engine core its own
    process, all under one KV memory budget (:mod:`quire.engine.kv_budget`)."""
    if args.api_server_count > 1:
        raise UsageError("--api-server-count: several models are served by one API server")
    if args.engine_in_process:
        raise UsageError("--engine-in-process: several models run each in its own engine "
                         "core process")
    if args.data_parallel_size > 1:
        raise UsageError("--data-parallel-size: several models share one KV budget on one "
                         "replica each")
    entries = model_entries(args)
    templates = []
    for entry in entries:
        try:
            parse_lora_modules(entry.options["lora_modules"])
            if entry.options["lora_modules"] and not entry.config.enable_lora:
                raise ValueError("LoRA modules given, but LoRA is disabled: add "
                                 "--enable-lora")
        except ValueError as exc:
            raise UsageError(f"--lora-modules: {entry.name}: {exc}") from None
        templates.append(read_chat_template(entry.options["chat_template"]))
    _configure_logging(args.log_level)
    registry = open_registry(args)
    for entry in entries:
        resolve_device(registry, entry.config.device)
    from quire.hub import fetch_model

    listener = _bind_http(args)
    try:
        settle_grpc_port(args)
        fetched = []
        for entry in entries:
            try:
                fetched.append(dataclasses.replace(entry, config=fetch_model(entry.config)))
            except ValueError as exc:
                raise engine_error(exc) from exc
        return serve_models(args, limits, fetched, templates, registry, listener,
                            on_started=lambda: _announce(args, listener))
    finally:
        if listener is not None:
            listener.close()


def serve_models(args: argparse.Namespace, limits: ServerLimits, entries: list[ModelEntry],
                 templates: list[str | None], registry: PlatformRegistry,
                 listener: socket.socket | None,
                 on_started: Callable[[], None] | None = None) -> int:
    """One API server over one engine core process per model; the cores start in
    order, and the first sets the shared KV budget from what it measured."""
    import shutil
    import tempfile

    from quire.engine.kv_budget import KVLedger, KVShareSpec
    from quire.entrypoints.server.app import ServedModel, create_models_app

    workdir = tempfile.mkdtemp(prefix="quire-kv-")
    ledger = os.path.join(workdir, "ledger")
    KVLedger.create(ledger, len(entries)).close()
    engines: list[AsyncEngine] = []
    try:
        for slot, entry in enumerate(entries):
            engines.append(_start_engine(args, limits, entry.config, registry, None,
                                         KVShareSpec(ledger, slot)))
        try:
            app = create_models_app(
                [ServedModel(e.name, engine, template, e.options["tool_call_parser"],
                             e.options["reasoning_parser"],
                             parse_lora_modules(e.options["lora_modules"]))
                 for e, engine, template in zip(entries, engines, templates)],
                api_key=api_key_from(args), limits=limits, kv_ledger=ledger)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    except BaseException:
        for engine in engines:
            engine.close_unstarted()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        return _run_uvicorn(args, limits, app, _Engines(engines), listener, on_started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _start_engine(args: argparse.Namespace, limits: ServerLimits, config: EngineConfig,
                  registry: PlatformRegistry, client: CoreClient | None,
                  kv_share: KVShareSpec | None = None) -> AsyncEngine:
    """The engine front over ``client`` (or cores started here, or one in this process).

    :param kv_share: the cores' slot in a KV budget shared with other models.
    :raises UsageError: the device or the checkpoint refused, in one line.
    """
    from quire.engine import LLMEngine
    from quire.entrypoints.server.async_engine import AsyncEngine

    try:
        if client is None and not args.engine_in_process:
            from quire.engine.core_proc import ProcCoreClient

            client = ProcCoreClient.start(config, registry.blocked, kv_share)
        engine = LLMEngine(config, registry, client=client)
    except (ValueError, RuntimeError) as exc:
        if client is not None:
            client.shutdown()
        raise engine_error(exc) from exc
    return AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests,
                       max_stream_backlog=limits.max_stream_backlog,
                       api_servers=args.api_server_count, slo=slo_from_args(args))


def _create_app(args: argparse.Namespace, limits: ServerLimits, async_engine: AsyncEngine,
                chat_template: str | None) -> Any:
    from quire.entrypoints.server.app import create_app

    try:
        return create_app(async_engine, served_names(args)[0] if served_names(args)
                          else args.model,
                          api_key=api_key_from(args), limits=limits,
                          chat_template=chat_template,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          lora_modules=parse_lora_modules(args.lora_modules))
    except ValueError as exc:
        raise UsageError(f"--lora-modules: {exc}") from None


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """``NAME=PATH`` or ``{"name": ..., "path": ...}`` items as (name, path).

    :raises ValueError: naming the item that is neither."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                modules.append((str(item["name"]), str(item["path"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{value!r} is not a JSON object with name and path") \
                    from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{value!r} is not NAME=PATH")
        modules.append((name, path))
    return modules


def _graceful_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server with Quire's stop on SIGTERM/SIGINT.

        On the first signal the engine is drained (new requests refused, in-flight ones
        given ``drain_s`` to finish, the rest aborted so that their streams end with
        finish reason "abort" rather than a cut connection); uvicorn then closes the
        idle connections and runs the app's shutdown. A gRPC server, if any, starts once
        the app's lifespan started the engines, says NOT_SERVING when the drain begins,
        and stops before the engines do. The process exits with status 0:
        uvicorn would re-raise the signal after its shutdown, so that the process dies
        "of" it, while an orderly stop is a success.
        """

        def __init__(self, config: Any, engine: _Engines, drain_s: float,
                     on_started: Callable[[], None] | None = None,
                     grpc: GrpcServer | None = None) -> None:
            super().__init__(config)
            self.on_started = on_started
            self.grpc = grpc
            #: Why the gRPC server could not start, or None.
            self.grpc_failure: BaseException | None = None
            self.engine = engine
            self.drain_s = drain_s
            self.loop: asyncio.AbstractEventLoop | None = None
            self.draining: asyncio.Future[None] | None = None

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.grpc is not None and self.started:
                try:
                    port = await self.grpc.start()
                except RuntimeError as exc:  # the stop runs through on_tick
                    logging.getLogger("quire").error("--grpc-port: %s", exc)
                    self.grpc_failure = exc
                    return
                logging.getLogger("quire").info(
                    "gRPC running on %s (quire.v1.Generation%s)",
                    dataclasses.replace(self.grpc.options, port=port).address,
                    ", TLS" if self.grpc.options.tls_cert else "")
            if self.on_started is not None and self.started:
                self.on_started()

        async def on_tick(self, counter: int) -> bool:
            """Stop serving once the engine stopped on its own (a worker died), or the
            gRPC server could not start."""
            if self.engine.failure is not None or self.grpc_failure is not None:
                return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: Any = None) -> None:
            if self.grpc is not None:
                await self.grpc.stop(self.drain_s + 5)
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining is None and self.loop is not None:
                self.loop.call_soon_threadsafe(self._start_drain)
            super().handle_exit(sig, frame)

        def _start_drain(self) -> None:
            if self.draining is None:
                self.draining = asyncio.ensure_future(self.engine.drain(self.drain_s))
                if self.grpc is not None:
                    asyncio.ensure_future(self.grpc.draining())

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            saved = {sig: signal.signal(sig, self.handle_exit)
                     for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _configure_logging(level: str) -> None:
    """quire's loggers (engine, access lines) at ``level`` on stderr, uvicorn's style."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("quire")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
