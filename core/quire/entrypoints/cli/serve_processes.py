"""``quire serve --api-server-count N``: N API server processes on one port, in front of
the engine core processes, and this process watching them all.

This process starts the cores (one per data-parallel replica) and hands the listening
socket (bound before anything loaded: :mod:`quire.entrypoints.cli.listener`) to N API
server processes (each a fresh interpreter running
:func:`quire.entrypoints.cli.serve.serve` on that socket, connected to every core as
front ``i``); the kernel spreads connections over them. It then only watches: a signal is
passed on to the API servers (each drains its requests), after which the cores are told
to stop. If any process dies, the others are stopped and the exit status is 1, so that a
supervisor restarts the whole server. Every child dies with this process
(``PR_SET_PDEATHSIG``). With ``--grpc-port`` each API server also serves gRPC on that
port (settled here first), all bound together with ``SO_REUSEPORT``; with ``--no-http``
there is no HTTP socket to hand over.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from quire.config import EngineConfig
from quire.engine.core_proc import CoreProcesses
from quire.entrypoints.cli.common import UsageError
from quire.entrypoints.cli.listener import url
from quire.entrypoints.server.metrics import MULTIPROC_DIR_ENV
from quire.executor.multiproc import die_with_parent, reap

logger = logging.getLogger("quire.serve")

#: Seconds between checks of the children.
POLL_S = 0.2
#: Seconds the API servers get to stop on their own once a core died, before they are
#: killed (they notice within a poll period and fail their requests first).
FAIL_GRACE_S = 10.0


def run_api_servers(args: argparse.Namespace, config: EngineConfig,
                    blocked: frozenset[str], listener: socket.socket | None) -> int:
    """Run the cores and ``args.api_server_count`` API servers on ``listener`` (bound and
    listening; closed here at the end) until a signal or a death."""
    address = url(args.host, listener) if listener is not None \
        else f"gRPC port {args.grpc_port}"
    fds = () if listener is None else (listener.fileno(),)
    try:
        cores = CoreProcesses(config, blocked)
    except (ValueError, RuntimeError) as exc:  # the device or its options, refused here
        if listener is not None:
            listener.close()
        raise UsageError(str(exc)) from exc
    # the API servers' request metrics, summed by whichever of them answers /metrics
    metrics_dir = tempfile.mkdtemp(prefix="quire-metrics-")
    env = {**os.environ, MULTIPROC_DIR_ENV: metrics_dir}
    ready_r, ready_w = os.pipe()
    servers: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(sig: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for proc in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(args.api_server_count):
            servers.append(subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP.format(args=(
                    args.argv, index,
                    fds[0] if fds else -1, ready_w, cores.workdir, cores.pids,
                    os.getpid()))],
                pass_fds=(*fds, ready_w), env=env))
        os.close(ready_w)
        status = _watch(servers, cores, ready_r, args.api_server_count, address,
                        lambda: stopping)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proc in cores.procs:
            if proc.poll() is None:
                proc.terminate()  # no front is left to say Shutdown
        cores.stop()
        if listener is not None:
            listener.close()
        os.close(ready_r)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def _watch(servers: list[subprocess.Popen[bytes]], cores: CoreProcesses, ready_r: int,
           count: int, address: str, stopping: object) -> int:
    """Wait for the API servers to be ready, then for any child to exit."""
    ready = 0
    os.set_blocking(ready_r, False)
    while True:
        if ready < count:
            try:
                ready += len(os.read(ready_r, 64))
            except BlockingIOError:
                pass
            if ready >= count:
                logger.info("%d API servers running on %s (Press CTRL+C to quit)", count,
                            address)
        dead_core = cores.dead()
        if dead_core is not None:
            logger.error("%s; stopping the API servers", dead_core)
            reap(servers, FAIL_GRACE_S)
            return 1
        for index, proc in enumerate(servers):
            code = proc.poll()
            if code is None:
                continue
            if stopping():  # type: ignore[operator]
                if all(p.poll() is not None for p in servers):
                    return 0 if all(p.returncode == 0 for p in servers) else 1
                break
            logger.error("API server %d (pid %d) exited with status %s; stopping the rest",
                         index, proc.pid, code)
            for other in servers:
                if other.poll() is None:
                    other.send_signal(signal.SIGTERM)
            reap(servers, FAIL_GRACE_S)
            return 1
        time.sleep(POLL_S)


def api_server_main(argv: list[str], index: int, fd: int, ready_fd: int, workdir: str,
                    core_pids: list[int], parent_pid: int) -> None:
    """API server ``index``: parse the same command line, serve on ``fd`` as front
    ``index`` of the cores in ``workdir``."""
    die_with_parent()
    if os.getppid() != parent_pid:
        return
    from quire.engine.core_proc import ProcCoreClient
    from quire.entrypoints.cli import build_parser, parse_args
    from quire.entrypoints.cli.common import open_registry, read_chat_template
    from quire.entrypoints.cli.engine_options import engine_config_from_args
    from quire.entrypoints.cli.model_list import single_model
    from quire.entrypoints.cli.serve import _configure_logging, limits_from_args, serve

    args = parse_args(build_parser(), argv)
    _configure_logging(args.log_level)
    single_model(args)
    config = engine_config_from_args(args)
    client = ProcCoreClient(workdir=workdir, core_pids=core_pids, client=index,
                            block_size=config.block_size)

    def ready() -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    # its family and type read from the descriptor; -1: --no-http
    listener = socket.socket(fileno=fd) if fd >= 0 else None
    status = serve(args, limits_from_args(args), config, open_registry(args), listener,
                   chat_template=read_chat_template(args.chat_template), client=client,
                   on_started=ready)
    raise SystemExit(status)


_BOOTSTRAP = """
from quire.entrypoints.launch import imported
imported('quire.entrypoints.cli.serve_processes', 'api_server_main')(*{args})
"""
