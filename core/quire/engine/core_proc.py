"""The engine core as its own process, and the client a front uses to reach it.

A core process builds one :class:`~quire.engine.core.EngineCore` (and through its
executor the worker processes, if any), then runs a busy loop: take every command that
came (add, abort, stop a sequence, a new front saying hello), run a step if there is work,
send each front the updates of its own requests with the stats. It never waits for a front.

Sockets (ZeroMQ, messages msgpack-encoded by msgspec; no pickle): each core binds one
``PULL`` inbox; each front binds one ``PULL`` inbox and tells every core its address in a
:class:`Hello`, and the core answers there, first with :class:`Ready` (its
:class:`CoreInfo`, or why it failed to start). Several fronts (``--api-server-count``)
may share a core; a front may drive several cores (``--data-parallel-size``), placing each
request with :class:`~quire.engine.placement.Placement`.

Faults: a front polls its cores' liveness while it waits, so a core killed with
``kill -9`` raises :class:`EngineCoreDied` within a poll period. A core exits when the
process that started it dies (``PR_SET_PDEATHSIG`` and a check while idle), and its
executor's workers exit with it, so nothing outlives the server.
"""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING

import msgspec
import zmq

from quire.config import EngineConfig
from quire.engine.core_client import CoreClient
from quire.engine.kv_budget import KVShareSpec
from quire.engine.messages import (
    Abort,
    AddRequest,
    Command,
    CoreInfo,
    CoreOutputs,
    CoreRequest,
    EngineStats,
    Hello,
    Shutdown,
    StopSequence,
)
from quire.engine.placement import Placement
from quire.executor.abstract import WorkerDied
from quire.executor.multiproc import cores_of, die_with_parent, reap
from quire.plugins.registry import PlatformRegistry

if TYPE_CHECKING:  # the core imports the model code: only the core process loads it
    from quire.engine.core import EngineCore

logger = logging.getLogger(__name__)

#: Seconds between liveness checks while waiting (the front's on its cores, a core's on
#: its parent).
POLL_S = 0.1
#: Idle polls between two checks of the executor's workers (a Ray ping costs more).
HEALTH_EVERY = 5
#: Seconds a core may take to load its model and start its workers.
START_TIMEOUT_S = 900.0
#: Seconds the cores get to exit after being told to, before they are killed.
STOP_TIMEOUT_S = 15.0


class EngineCoreDied(WorkerDied):
    """An engine core process died or failed; the requests it held are lost."""


class Ready(msgspec.Struct, tag=True):
    """A core's first message to a front: what it is, or why it could not start."""

    engine: int
    info: CoreInfo | None = None
    error: str | None = None
    #: The error is the engine options' fault (a ValueError or RuntimeError at build,
    #: as in-process): its message is the whole story.
    usage_error: bool = False


class Outputs(msgspec.Struct, tag=True):
    outputs: CoreOutputs


class Failed(msgspec.Struct, tag=True):
    """A core's last message: why it stops (a worker died, a bug)."""

    engine: int
    error: str


_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_reply_decoder = msgspec.msgpack.Decoder(Ready | Outputs | Failed)


def core_address(workdir: str, engine: int) -> str:
    return f"ipc://{workdir}/core{engine}"


def client_address(workdir: str, client: int) -> str:
    return f"ipc://{workdir}/client{client}"


# -- starting and stopping core processes (the serve command's parent, or a front) ---------
class CoreProcesses:
    """``data_parallel_size`` core processes on this node, and their private directory.

    The cores share this process's CPUs: each gets every ``n``-th one (``n`` replicas),
    set before torch loads, as the ``mp`` executor does for its ranks.
    """

    def __init__(self, config: EngineConfig, blocked: frozenset[str] = frozenset(),
                 kv_share: KVShareSpec | None = None) -> None:
        """:param blocked: plugin entry points to skip (``--disable-plugins``).
        :param kv_share: the core's slot in a KV budget shared with other models' cores.
        :raises ValueError, RuntimeError: the device cannot run, or its options are bad
            (before any process starts)."""
        # what the platform's libraries read once, when a core imports torch (cpu: how
        # OpenMP threads wait); this process may have torch already, the cores not yet
        platform = PlatformRegistry(blocked=blocked).resolve(config.device)
        env = {**os.environ, **platform.child_environment(config.platform_options or {},
                                                          os.environ)}
        self.count = config.data_parallel_size
        self.workdir = tempfile.mkdtemp(prefix="quire-core-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self._release = weakref.finalize(self, _release, self.procs, self.workdir)
        with open(os.path.join(self.workdir, "config.json"), "wb") as f:
            f.write(msgspec.json.encode(config))
        if kv_share is not None:
            with open(os.path.join(self.workdir, "kv_share.json"), "wb") as f:
                f.write(msgspec.json.encode(kv_share))
        cpu = platform.device_type == "cpu"  # also what device=auto resolved to
        if kv_share is not None:
            # one of several models' cores on this host: its OpenMP threads sleep when
            # idle, so a busy model gets every CPU the others leave (spinning threads of
            # two cores slowed both 2.5x; figures in docs/bench.md); the user's wins
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for engine in range(self.count):
            cores = cores_of(engine, self.count) if cpu and self.count > 1 else None
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP.format(
                    cores=cores, args=(self.workdir, engine, os.getpid(), sorted(blocked),
                                       logging.getLogger("quire").getEffectiveLevel()))],
                env=env))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> str | None:
        """How the first dead core died, or None while all run."""
        for engine, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                return f"engine core {engine} (pid {proc.pid}) died ({how})"
        return None

    def stop(self) -> None:
        """Wait for the cores to exit (once told to), kill the late ones, clean up."""
        reap(self.procs, STOP_TIMEOUT_S)
        self._release()


def _release(procs: list[subprocess.Popen[bytes]], workdir: str) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (not a zombie): works for processes we did not start."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


# -- the front's side ------------------------------------------------------------------------
class ProcCoreClient(CoreClient):
    """Drives core processes over ZeroMQ.

    :param owned: the cores this client started (it stops them on shutdown and polls
        their exit codes); None when another process started them (``workdir`` and
        ``core_pids`` then say where they are).
    """

    def __init__(self, *, workdir: str, core_pids: list[int], client: int = 0,
                 owned: CoreProcesses | None = None, block_size: int | None = None) -> None:
        self.workdir = workdir
        self.client = client
        self._prefix = f"{client}/"
        self._pids = core_pids
        self._owned = owned
        self._closed = False
        self._zmq = zmq.Context()
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(client_address(workdir, client))
        self._outboxes: list[zmq.Socket] = []
        for engine in range(len(core_pids)):
            sock = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(core_address(workdir, engine))
            self._outboxes.append(sock)
        self._release = weakref.finalize(self, _close, self._outboxes + [self._inbox],
                                         self._zmq)
        try:
            hello = _encoder.encode(Hello(client, client_address(workdir, client)))
            for sock in self._outboxes:
                sock.send(hello)
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._stats: list[EngineStats | None] = [None] * len(core_pids)
        self._received: list[CoreOutputs] = []  # taken from the socket, not yet returned
        self.placement = Placement(len(core_pids), block_size or self.info.platform_block_size)
        self._where: dict[str, int] = {}

    @classmethod
    def start(cls, config: EngineConfig, blocked: frozenset[str] = frozenset(),
              kv_share: KVShareSpec | None = None) -> ProcCoreClient:
        """Start ``config.data_parallel_size`` core processes and connect to them.

        :param kv_share: a slot in a KV budget shared with other models' cores (one
            core: data parallelism is refused with it)."""
        if kv_share is not None and config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 cannot share one KV budget with other "
                             "models")
        procs = CoreProcesses(config, blocked, kv_share)
        try:
            return cls(workdir=procs.workdir, core_pids=procs.pids, owned=procs,
                       block_size=config.block_size)
        except BaseException:
            procs.stop()
            raise

    def _wait_ready(self) -> CoreInfo:
        infos: dict[int, CoreInfo] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(infos) < len(self._pids):
            if self._inbox.poll(POLL_S * 1000):
                msg = _reply_decoder.decode(self._inbox.recv())
                if isinstance(msg, Ready):
                    if msg.error is not None and msg.usage_error:
                        raise ValueError(msg.error)
                    if msg.error is not None:
                        raise EngineCoreDied(f"engine core {msg.engine} failed to start:\n"
                                             f"{msg.error}")
                    infos[msg.engine] = msg.info
                continue
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineCoreDied(f"the engine cores did not start within "
                                     f"{START_TIMEOUT_S:g}s")
        return infos[0]

    def check_health(self) -> None:
        self._check_alive()

    def live_cores(self) -> int:
        if self._closed:
            return 0
        if self._owned is not None:
            return sum(p.poll() is None for p in self._owned.procs)
        return sum(_pid_alive(pid) for pid in self._pids)

    def _check_alive(self) -> None:
        if self._owned is not None:
            why = self._owned.dead()
        else:
            why = next((f"engine core {e} (pid {pid}) died"
                        for e, pid in enumerate(self._pids) if not _pid_alive(pid)), None)
        if why is not None:
            raise EngineCoreDied(why)

    def _send(self, engine: int, command: Command) -> None:
        if self._closed:
            raise EngineCoreDied("the engine cores were shut down")
        self._outboxes[engine].send(_encoder.encode(command), copy=False)

    # -- CoreClient ----------------------------------------------------------------------
    # Request ids are the front's own; in a core they are prefixed with the front's
    # number, since several fronts may share it.
    def add_request(self, request: CoreRequest) -> None:
        engine = self.placement.place(request.prompt_token_ids, self._stats)
        logger.debug("front %d: request %s to engine core %d (loads %s)", self.client,
                     request.request_id, engine,
                     [self.placement.load(e, self._stats) for e in range(len(self._pids))])
        rid = request.request_id
        self._send(engine, AddRequest(msgspec.structs.replace(
            request, request_id=self._prefix + rid, client=self.client)))
        self._where[rid] = engine

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._where.pop(rid, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(self._prefix + rid)
        for engine, rids in by_engine.items():
            self._send(engine, Abort(rids))

    def stop_sequence(self, request_id: str, index: int) -> None:
        engine = self._where.get(request_id)
        if engine is not None:
            self._send(engine, StopSequence(self._prefix + request_id, index))

    def get_outputs(self, timeout: float) -> list[CoreOutputs]:
        if self._closed:
            raise EngineCoreDied("the engine cores were shut down")
        self._receive()
        deadline = time.monotonic() + timeout
        while not self._received:
            wait = min(POLL_S, max(0.0, deadline - time.monotonic()))
            if not self._inbox.poll(wait * 1000):
                self._check_alive()
                if time.monotonic() >= deadline:
                    break
                continue
            self._receive()
        result, self._received = self._received, []
        return result

    def _receive(self) -> None:
        """Take every message waiting: stats are current from here, outputs are kept
        for :meth:`get_outputs`."""
        while True:
            try:
                payload = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = _reply_decoder.decode(payload)
            if isinstance(msg, Failed):
                raise EngineCoreDied(f"engine core {msg.engine} failed: {msg.error}")
            if isinstance(msg, Outputs):
                out = msg.outputs
                if out.stats is not None:
                    self._stats[out.engine] = out.stats
                    self.placement.saw_stats(out.engine)
                self._strip(out)
                for rid in out.finished:
                    self._where.pop(rid, None)
                if out.updates or out.beams or out.prompt_logprobs or out.refused \
                        or out.error:
                    self._received.append(out)

    def _strip(self, out: CoreOutputs) -> None:
        """Back to the front's own request ids."""
        cut = len(self._prefix)
        for update in out.updates:
            update.request_id = update.request_id[cut:]
        for entry in out.prompt_logprobs:
            entry.request_id = entry.request_id[cut:]
        for result in out.beams:
            result.request_id = result.request_id[cut:]
        out.finished = [rid[cut:] for rid in out.finished]
        out.refused = [(rid[cut:], why) for rid, why in out.refused]

    def stats(self) -> list[EngineStats]:
        """The latest stats of each core (what waits on the socket is taken first, so
        that an idle front, which reads no outputs, still reports current figures)."""
        if not self._closed:
            self._receive()
        empty = EngineStats(0, 0, 0.0, 0, self.info.num_blocks, 0, 0, 0, False)
        return [s if s is not None else empty for s in self._stats]

    def shutdown(self) -> None:
        if self._closed:
            return
        if self._owned is not None:
            for engine, proc in enumerate(self._owned.procs):
                if proc.poll() is None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._outboxes[engine].send(_encoder.encode(Shutdown()), zmq.NOBLOCK)
        self._closed = True
        if self._owned is not None:
            self._owned.stop()
        self._release()


def _close(sockets: list[zmq.Socket], context: zmq.Context) -> None:
    for sock in sockets:
        sock.close(linger=0)
    context.term()


# -- the core's side -------------------------------------------------------------------------
def _core_main(workdir: str, engine: int, parent_pid: int, blocked: list[str],
               log_level: int = logging.INFO) -> None:
    """A core process: bind the inbox, build the core, serve fronts until told to stop."""
    die_with_parent()
    if os.getppid() != parent_pid:
        return
    # Ctrl-C reaches the whole process group; the server drains and stops us itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # at the level of the process that started it (quire serve's --log-level)
    logging.basicConfig(level=log_level, format=f"%(asctime)s core{engine} %(levelname)s "
                        "%(name)s: %(message)s")
    with open(os.path.join(workdir, "config.json"), "rb") as f:
        config = msgspec.json.decode(f.read(), type=EngineConfig)
    kv_share = None
    with contextlib.suppress(FileNotFoundError), \
            open(os.path.join(workdir, "kv_share.json"), "rb") as f:
        kv_share = msgspec.json.decode(f.read(), type=KVShareSpec)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(core_address(workdir, engine))
    loop = _CoreLoop(engine, inbox, context, parent_pid)
    try:
        from quire.engine.core import EngineCore
        from quire.plugins.registry import PlatformRegistry

        core = EngineCore(config, PlatformRegistry(blocked=blocked), kv_share=kv_share)
    except (ValueError, RuntimeError) as exc:  # the options' fault: one line says it
        loop.fail_start(str(exc), usage_error=True)
        raise SystemExit(1) from None
    except Exception:
        loop.fail_start(traceback.format_exc(limit=12))
        raise SystemExit(1) from None
    try:
        loop.run(core)
    except Exception as exc:  # a dead worker, or a bug outside a step
        logger.exception("engine core %d failed", engine)
        loop.fail(str(exc))
        raise SystemExit(1) from None
    finally:
        core.shutdown()
        loop.close()


class _CoreLoop:
    """The busy loop of one core process and the fronts it answers."""

    def __init__(self, engine: int, inbox: zmq.Socket, context: zmq.Context,
                 parent_pid: int) -> None:
        self.engine = engine
        self.inbox = inbox
        self.context = context
        self.parent_pid = parent_pid
        self.fronts: dict[int, zmq.Socket] = {}
        self.owner: dict[str, int] = {}  # request id -> front
        self.info: CoreInfo | None = None

    def _connect(self, hello: Hello) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(hello.address)
        self.fronts[hello.client] = sock
        return sock

    def fail_start(self, error: str, usage_error: bool = False) -> None:
        """Tell every front that said hello (waiting a little for the first) why."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and self.inbox.poll(100):
            msg = _command_decoder.decode(self.inbox.recv())
            if isinstance(msg, Hello):
                self._connect(msg).send(_encoder.encode(Ready(self.engine, error=error,
                                                               usage_error=usage_error)))
                break
        self.close()

    def close(self) -> None:
        for sock in self.fronts.values():
            sock.close(linger=1000)
        self.inbox.close(linger=0)
        self.context.term()

    def run(self, core: EngineCore) -> None:
        self.info = core.info
        idle = 0
        while True:
            busy = core.has_unfinished_requests()
            if not busy and not self.inbox.poll(POLL_S * 1000):
                if os.getppid() != self.parent_pid:
                    return  # the server is gone
                core.tend_kv_share()  # a shared budget may want our cached pages
                idle += 1
                if idle % HEALTH_EVERY == 0:
                    core.executor.check_health()  # a dead worker ends the core now
                continue
            idle = 0
            refused: dict[int, list[tuple[str, str]]] = {}
            handled = False
            while True:
                try:
                    payload = self.inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                cmd = _command_decoder.decode(payload)
                if isinstance(cmd, Shutdown):
                    return
                handled = True
                self._apply(core, cmd, refused)
            if core.has_unfinished_requests():
                self._send(self._step(core), refused)
            elif handled:
                out = CoreOutputs(time=time.monotonic(), stats=core.stats(),
                                  finished=core.take_finished())
                self._send(out, refused)

    def _step(self, core: EngineCore) -> CoreOutputs:
        """One step; a failure that is not a dead worker (a bug) aborts this core's
        requests and is reported to every front, and the core serves on, as the
        in-process engine does. A dead worker ends the core (:class:`Failed`)."""
        try:
            return core.step()
        except WorkerDied:
            raise
        except Exception as exc:
            logger.exception("engine core %d: a step failed; aborting its requests",
                             self.engine)
            core.abort_all()
            self.owner.clear()
            return CoreOutputs(time=time.monotonic(), stats=core.stats(),
                               error=f"{type(exc).__name__}: {exc}")

    def fail(self, error: str) -> None:
        """Tell every front why this core is about to exit."""
        for sock in self.fronts.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.send(_encoder.encode(Failed(self.engine, error)))

    def _apply(self, core: EngineCore, cmd: Command,
               refused: dict[int, list[tuple[str, str]]]) -> None:
        if isinstance(cmd, AddRequest):
            req = cmd.request
            try:
                core.add_request(req)
            except ValueError as exc:
                refused.setdefault(req.client, []).append((req.request_id, str(exc)))
                return
            self.owner[req.request_id] = req.client
        elif isinstance(cmd, Abort):
            core.abort_requests(cmd.request_ids)
            for rid in cmd.request_ids:
                self.owner.pop(rid, None)
        elif isinstance(cmd, StopSequence):
            core.stop_sequence(cmd.request_id, cmd.index)
        elif isinstance(cmd, Hello):
            self._connect(cmd).send(_encoder.encode(Ready(self.engine, info=self.info)))

    def _send(self, out: CoreOutputs, refused: dict[int, list[tuple[str, str]]]) -> None:
        """Each front gets the news of its own requests, and the stats."""
        out.engine = self.engine
        if len(self.fronts) == 1:
            [(client, sock)] = self.fronts.items()
            for rid in out.finished:
                self.owner.pop(rid, None)
            out.refused = refused.get(client, [])
            sock.send(_encoder.encode(Outputs(out)), copy=False)
            return
        per_front: dict[int, CoreOutputs] = {
            c: CoreOutputs(time=out.time, stats=out.stats, engine=self.engine,
                           refused=refused.get(c, [])) for c in self.fronts}
        for update in out.updates:
            front = per_front.get(self.owner.get(update.request_id, -1))
            if front is not None:
                front.updates.append(update)
        for entry in out.prompt_logprobs:
            front = per_front.get(self.owner.get(entry.request_id, -1))
            if front is not None:
                front.prompt_logprobs.append(entry)
        for result in out.beams:
            front = per_front.get(self.owner.get(result.request_id, -1))
            if front is not None:
                front.beams.append(result)
        for rid in out.finished:
            front = per_front.get(self.owner.pop(rid, -1))
            if front is not None:
                front.finished.append(rid)
        for client, front in per_front.items():
            self.fronts[client].send(_encoder.encode(Outputs(front)), copy=False)


#: A core's first lines: its CPUs are set before torch loads (OpenMP sizes its thread
#: team from the affinity it finds then).
_BOOTSTRAP = """
import os
cores = {cores}
if cores:
    os.sched_setaffinity(0, cores)
from quire.entrypoints.launch import imported
imported('quire.engine.core_proc', '_core_main')(*{args})
"""
