"""How a front reaches its engine core(s): a method call in this process
(:class:`InprocCoreClient`), or messages to core processes
(:class:`~quire.engine.core_proc.ProcCoreClient`). Both take the same
:mod:`~quire.engine.messages` and give the same :class:`CoreOutputs`."""

from __future__ import annotations

from abc import ABC, abstractmethod

from quire.engine.core import EngineCore
from quire.engine.messages import CoreInfo, CoreOutputs, CoreRequest, EngineStats


class CoreClient(ABC):
    """The front's handle on one or more engine cores (data-parallel replicas)."""

    #: What the cores said when they were ready (replicas are identical).
    info: CoreInfo
    #: True when the cores run in this process (then :attr:`core` is the one core).
    in_process: bool = False

    @abstractmethod
    def add_request(self, request: CoreRequest) -> None:
        """Queue a request on one core. :raises ValueError: the core refused it."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests and free their pages; unknown ids are ignored."""

    @abstractmethod
    def stop_sequence(self, request_id: str, index: int) -> None:
        """Finish sample ``index`` of a request (a stop string was found in its text)."""

    @abstractmethod
    def get_outputs(self, timeout: float) -> list[CoreOutputs]:
        """What the cores produced since the last call, waiting at most ``timeout``
        seconds for something. An in-process core runs one step here.

        :raises WorkerDied: a core or one of its workers died.
        """

    @abstractmethod
    def stats(self) -> list[EngineStats]:
        """The latest stats of each core, in replica order."""

    def live_cores(self) -> int:
        """Core processes running (0 when the core runs in this process)."""
        return 0

    def check_health(self) -> None:
        """:raises WorkerDied: a core died (called while idle, when no output is awaited)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the cores and their workers; safe to call more than once."""


class InprocCoreClient(CoreClient):
    """The core lives in this process: every call is a method call."""

    in_process = True

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = core.info

    def add_request(self, request: CoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def stop_sequence(self, request_id: str, index: int) -> None:
        self.core.stop_sequence(request_id, index)

    def check_health(self) -> None:
        self.core.executor.check_health()

    def get_outputs(self, timeout: float) -> list[CoreOutputs]:
        if not self.core.has_unfinished_requests():
            self.core.tend_kv_share()  # a shared budget may want its cached pages
            return []
        return [self.core.step()]

    def stats(self) -> list[EngineStats]:
        return [self.core.stats()]

    def shutdown(self) -> None:
        self.core.shutdown()
