"""``ray``: one Ray actor per rank, placed by a placement group, on any node of a cluster.

The engine joins the cluster named by ``RAY_ADDRESS`` (or one ``ray.init`` already made in
this process), or starts a local one. One bundle per rank (a CPU, and a ``GPU`` for
accelerator platforms: Ray's generic accelerator count) is reserved, ``PACK`` strategy,
so ranks fill a node before spilling to the next. Ranks meet over TCP at rank 0's
address; steps and replies travel as the same msgspec bytes as the ``mp`` executor's
(Ray passes ``bytes`` through as they are), so no request data is pickled.

A dead actor surfaces as Ray's ``RayActorError`` from ``ray.get``, reported as
:class:`WorkerDied`; :meth:`shutdown` kills the actors and frees the placement group.

The actors start with the platform's :meth:`~quire.interfaces.platform.Platform.child_environment`
in their Ray runtime environment (Ray sets it before the worker process starts, so
before torch loads), as ``mp`` workers get it. It is decided here, on the engine's node
(the cpu platform: from this host's load); an actor on another node cannot decide for
itself, since its process has loaded torch before any of its code runs.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec

from quire.config import EngineConfig
from quire.executor.abstract import WorkerDied
from quire.executor.messages import Call, Reply, Step
from quire.executor.remote import RemoteExecutor
from quire.interfaces.platform import Platform

#: Seconds to wait for the placement group and the workers' start.
START_TIMEOUT_S = 600.0

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def import_ray() -> Any:
    """:raises ValueError: in one line, when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                         "'ray>=2.9' (or use 'mp' on one node)") from None
    return ray


class RayExecutor(RemoteExecutor):
    """``world_size`` Ray actors, one per rank, anywhere in the cluster."""

    def __init__(self, config: EngineConfig, world_size: int, platform: Platform) -> None:
        """:param platform: the engine's, resolved from ``config.device``: its device type
            and the environment its workers need."""
        ray = import_ray()
        device_type = platform.device_type
        env = platform.child_environment(config.platform_options or {}, os.environ)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        self.max_in_flight = config.pipeline_parallel_size
        self._ray = ray
        self._remove_group = remove_placement_group
        self._started_ray = not ray.is_initialized()
        if self._started_ray:  # RAY_ADDRESS, if set, names the cluster to join
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=True)
        bundle = {"CPU": 1} if device_type == "cpu" else {"CPU": 1, "GPU": 1}
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        self._actors: list[Any] = []
        try:
            ray.get(self._group.ready(), timeout=START_TIMEOUT_S)
            remote = ray.remote(_RayWorker)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank)
                self._actors.append(remote.options(
                    scheduling_strategy=strategy, num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    runtime_env={"env_vars": env} if env else None).remote())
            master = ray.get(self._actors[0].address.remote(), timeout=START_TIMEOUT_S)
            #: The Ray node of each rank.
            self.node_ids: list[str] = ray.get([a.node_id.remote() for a in self._actors],
                                               timeout=START_TIMEOUT_S)
            nodes = self.node_ids
            config_json = msgspec.json.encode(config)
            started = self._get([
                a.start.remote(config_json, rank, world_size, master,
                               nodes[:rank].count(nodes[rank]), nodes.count(nodes[rank]))
                for rank, a in enumerate(self._actors)], timeout=START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._started(started)

    def shutdown(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
        if self._group is not None:
            try:
                self._remove_group(self._group)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
            self._group = None
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def check_health(self) -> None:
        """A ping to every actor (a dead one raises, through :meth:`_get`)."""
        if self._actors:
            self._get([a.node_id.remote() for a in self._actors], timeout=30, raw=True)

    def _send_all(self, request: Call | Step) -> object:
        if not self._actors:
            raise WorkerDied("the executor was shut down")
        payload = _encoder.encode(request)
        # an actor runs one caller's calls in the order they were made
        return [a.handle.remote(payload) for a in self._actors]

    def _receive(self, handle: object) -> list[Reply]:
        assert isinstance(handle, list)
        return self._get(handle)

    def _get(self, refs: list[Any], timeout: float | None = None,
             raw: bool = False) -> list[Any]:
        """The replies in rank order (``raw``: the values as they came); a dead actor or
        a worker's error raises."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            values = self._ray.get(refs, timeout=timeout)
        except RayActorError as exc:
            self.shutdown()
            raise WorkerDied(f"a Ray worker died: {exc}") from exc
        except GetTimeoutError as exc:
            self.shutdown()
            raise WorkerDied(f"the Ray workers did not answer within {timeout:g}s") from exc
        if raw:
            return list(values)
        replies = [_reply_decoder.decode(r) for r in values]
        for rank, reply in enumerate(replies):
            if reply.error is not None:
                self.shutdown()
                raise WorkerDied(f"worker rank {rank} failed: {reply.error}")
        return replies


class _RayWorker:
    """The actor: a :class:`Worker` behind the same request/reply bytes as ``mp``'s."""

    def __init__(self) -> None:
        self._worker: Any = None

    def address(self) -> str:
        """``tcp://ip:port`` on this node for the group's rendezvous (rank 0 only)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{_node_ip()}:{port}"

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def start(self, config_json: bytes, rank: int, world_size: int, master: str,
              local_rank: int, ranks_on_host: int) -> bytes:
        from quire.executor.multiproc import start_worker

        try:
            config = msgspec.json.decode(config_json, type=EngineConfig)
            self._worker = start_worker(config, rank, world_size, master, local_rank,
                                        ranks_on_host)
        except Exception as exc:  # noqa: BLE001 - reported to the engine
            return _encoder.encode(Reply(error=f"{type(exc).__name__}: {exc}"))
        spec = self._worker.kv_spec
        return _encoder.encode(Reply(values=[
            spec.num_layers, spec.num_kv_heads, spec.head_size,
            self._worker.bytes_per_block(), int(self._worker.backend.releases_kv_memory)]))

    def handle(self, payload: bytes) -> bytes:
        from quire.executor.multiproc import handle_request

        return _encoder.encode(handle_request(self._worker, payload))


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())
