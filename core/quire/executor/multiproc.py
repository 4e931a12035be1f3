"""``mp``: one worker process per rank on this node, fed over ZeroMQ.

The engine binds one ``PAIR`` socket per rank on an IPC path in a private directory and
sends every rank the same msgspec-encoded request (a step, or a control call); each rank
answers, rank 0 with the logits. Ranks join their ``torch.distributed`` group through a
rendezvous file in the same directory, over the platform's own backend (gloo on cpu).
Workers are fresh interpreters (``python -c`` with a short bootstrap, :data:`_BOOTSTRAP`)
reading the engine config as JSON: unlike multiprocessing's spawn, that never re-runs the
user's ``__main__``, and unlike fork it is safe beside the server's threads.

Faults: while it waits, the engine polls every process's exit code, so a worker killed
with ``kill -9`` is reported within a poll period (``WorkerDied`` naming the rank and its
exit code) and the others are stopped. A worker whose engine died exits too: the kernel
signals it (``PR_SET_PDEATHSIG`` on Linux) and it also checks its parent while idle, so
no worker outlives its engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from datetime import timedelta

import msgspec
import zmq

from quire.config import EngineConfig
from quire.executor.abstract import WorkerDied
from quire.executor.messages import (
    Array,
    Call,
    Reply,
    Request,
    Step,
    StepOutput,
)
from quire.executor.remote import RemoteExecutor
from quire.executor.worker import Worker
from quire.interfaces.platform import Platform

logger = logging.getLogger(__name__)

#: Seconds between checks of the workers' (or the engine's) liveness while waiting.
POLL_S = 0.1
#: Seconds a worker may take to load its shard before the engine gives up on it.
START_TIMEOUT_S = 600.0
#: Seconds the workers get to exit after being told to, before they are killed.
STOP_TIMEOUT_S = 10.0

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_SHUTDOWN = _encoder.encode(Call("shutdown", []))


class MultiprocExecutor(RemoteExecutor):
    """``world_size`` worker processes on this node, one per rank."""

    def __init__(self, config: EngineConfig, world_size: int, platform: Platform) -> None:
        """:param platform: the engine's, resolved from ``config.device``: its device type
            and the environment its workers need (:meth:`Platform.child_environment`)."""
        device_type = platform.device_type
        self.world_size = world_size
        self.max_in_flight = config.pipeline_parallel_size
        self._workdir = tempfile.mkdtemp(prefix="quire-mp-")
        self._zmq = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        # an engine nobody shut down still leaves no worker, socket or directory behind
        # once it is collected or the interpreter exits
        self._release = weakref.finalize(self, _release, self._procs, self._sockets,
                                         self._zmq, self._workdir)
        with open(os.path.join(self._workdir, "config.json"), "wb") as f:
            f.write(msgspec.json.encode(config))
        # what the platform's libraries read once, when a worker imports torch (cpu: how
        # OpenMP threads wait)
        env = {**os.environ, **platform.child_environment(config.platform_options or {},
                                                          os.environ)}
        try:
            for rank in range(world_size):
                sock = self._zmq.socket(zmq.PAIR)
                sock.bind(_address(self._workdir, rank))
                self._sockets.append(sock)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP.format(
                        cores=cores_of(rank, world_size) if device_type == "cpu" else None,
                        args=(self._workdir, rank, world_size, os.getpid()))], env=env))
            started = self._gather(timeout=START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._started(started)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock, proc in zip(self._sockets, self._procs):
            if proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(_SHUTDOWN, zmq.NOBLOCK)
        reap(self._procs, STOP_TIMEOUT_S)
        self._release()

    def check_health(self) -> None:
        if not self._closed:
            self._check_alive({})

    # -- messaging -------------------------------------------------------------------------
    def _send_all(self, request: Call | Step) -> object:
        if self._closed:
            raise WorkerDied("the executor was shut down")
        payload = _encoder.encode(request)
        for rank, sock in enumerate(self._sockets):
            self._send(rank, sock, payload)
        return None  # each rank answers in order: the oldest reply is the handle's

    def _receive(self, handle: object) -> list[Reply]:
        return self._gather()

    def _send(self, rank: int, sock: zmq.Socket, payload: bytes) -> None:
        """Send without blocking on a dead peer (a ``PAIR`` socket would wait forever)."""
        while True:
            try:
                sock.send(payload, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self._check_alive({})
                sock.poll(POLL_S * 1000, zmq.POLLOUT)

    def _gather(self, timeout: float | None = None) -> list[Reply]:
        """One reply per rank, in rank order; a worker's death or error raises."""
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        replies: dict[int, Reply] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            ready = dict(poller.poll(POLL_S * 1000))
            for rank, sock in enumerate(self._sockets):
                # one reply per rank: a rank ahead in the pipeline may have sent the
                # next step's already
                if sock in ready and rank not in replies:
                    replies[rank] = _reply_decoder.decode(sock.recv())
                    poller.unregister(sock)
            self._check_alive(replies)
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise WorkerDied(f"the workers did not start within {timeout:g}s")
        for rank in range(self.world_size):
            if replies[rank].error is not None:
                self.shutdown()
                raise WorkerDied(f"worker rank {rank} failed: {replies[rank].error}")
        return [replies[r] for r in range(self.world_size)]

    def _check_alive(self, replies: dict[int, Reply]) -> None:
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if rank not in replies and code is not None:
                self.shutdown()
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                raise WorkerDied(f"worker rank {rank} (pid {proc.pid}) died ({how})")


def reap(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for ``procs`` to exit; kill the late ones."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _release(procs: list[subprocess.Popen[bytes]], sockets: list[zmq.Socket],
             context: zmq.Context, workdir: str) -> None:
    """Kill what still runs, close the sockets, remove the directory; safe to repeat."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for sock in sockets:
        sock.close(linger=0)
    context.term()
    shutil.rmtree(workdir, ignore_errors=True)


def _address(workdir: str, rank: int) -> str:
    return f"ipc://{workdir}/rank{rank}"


# -- the worker process -------------------------------------------------------------------
def _worker_main(workdir: str, rank: int, world_size: int, parent_pid: int) -> None:
    """A rank's process: join the group, load the shard, answer until told to stop."""
    die_with_parent()
    if os.getppid() != parent_pid:
        return  # the engine died before the kernel could be asked to signal us
    # Ctrl-C reaches the whole process group; the engine drains and stops us itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(workdir, "config.json"), "rb") as f:
        config = msgspec.json.decode(f.read(), type=EngineConfig)
    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.connect(_address(workdir, rank))
    try:
        worker = start_worker(config, rank, world_size, f"file://{workdir}/rendezvous")
    except Exception:
        sock.send(_encoder.encode(Reply(error=traceback.format_exc(limit=8))))
        return
    spec = worker.kv_spec
    sock.send(_encoder.encode(Reply(values=[
        spec.num_layers, spec.num_kv_heads, spec.head_size, worker.bytes_per_block(),
        int(worker.backend.releases_kv_memory)])))
    try:
        _serve(worker, sock, parent_pid)
    finally:
        sock.close(linger=0)
        context.term()
        _leave_group()


def start_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
                 local_rank: int | None = None, ranks_on_host: int | None = None) -> Worker:
    """Join the group at ``init_method`` and load this rank's shard (any executor's
    worker process calls it)."""
    import torch.distributed as dist

    from quire.plugins.registry import PlatformRegistry

    local_rank = rank if local_rank is None else local_rank
    ranks_on_host = world_size if ranks_on_host is None else ranks_on_host
    registry = PlatformRegistry()
    platform = registry.resolve(config.device)
    device = platform.device(local_rank)
    dist.init_process_group(platform.distributed_backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=START_TIMEOUT_S),
                            device_id=None if device.type == "cpu" else device)
    return Worker(config, rank, world_size, registry, ranks_on_host=ranks_on_host)


def _serve(worker: Worker, sock: zmq.Socket, parent_pid: int) -> None:
    while True:
        if not sock.poll(POLL_S * 1000):
            if os.getppid() != parent_pid:
                return  # the engine is gone
            continue
        payload = sock.recv()
        if payload == _SHUTDOWN:
            return
        sock.send(_encoder.encode(handle_request(worker, payload)))


def handle_request(worker: Worker, payload: bytes) -> Reply:
    """The reply to one encoded request; a failure becomes the reply's error."""
    try:
        return _handle(worker, _request_decoder.decode(payload))
    except Exception:
        return Reply(error=traceback.format_exc(limit=8))


def _handle(worker: Worker, request: Call | Step) -> Reply:
    if isinstance(request, Step):
        result = worker.execute(request.plan.items, request.plan.released,
                                free_pages=request.plan.free_pages)
        if worker.returns_drafts:  # a first stage's proposals, for the last stage's logits
            assert result.drafts is not None
            return Reply(output=StepOutput(None, [], [],
                                           drafts=[list(d) for d in result.drafts]))
        if not worker.returns_logits:
            return Reply()
        return Reply(output=StepOutput(
            Array.of(result.logits), list(result.sample_items),
            [(i, first, Array.of(logits)) for i, first, logits in result.prompt_logits],
            None if result.pooled is None else Array.of(result.pooled),
            None if result.drafts is None else [list(d) for d in result.drafts]))
    if request.method == "num_kv_blocks":
        return Reply(value=worker.num_kv_blocks())
    if request.method == "init_cache":
        worker.init_cache(request.args[0])
        return Reply()
    raise ValueError(f"unknown call {request.method!r}")


def cores_of(rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s share of this process's cores: every ``world_size``-th one (at
    least one), so ranks on one host do not oversubscribe it."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank::world_size] or [cores[rank % len(cores)]]


#: A worker's first lines: its cores are set before torch loads, since OpenMP sizes its
#: thread team from the affinity it finds then (set later, it leaves more threads than
#: cores, spinning; figures in docs/bench.md).
_BOOTSTRAP = """
import os
cores = {cores}
if cores:
    os.sched_setaffinity(0, cores)
from quire.entrypoints.launch import imported
imported('quire.executor.multiproc', '_worker_main')(*{args})
"""


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

