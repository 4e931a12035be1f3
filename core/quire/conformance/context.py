"""What every check receives: the platform under test and the run's choices."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quire.interfaces.platform import Platform


@dataclass(frozen=True)
class CheckContext:
    """One run's settings, shared read-only by every check."""

    platform: Platform
    #: Where the checks put tensors: the platform's device 0, or cpu in kernels-only mode.
    device: torch.device
    #: dtypes to test, each one the platform declares.
    dtypes: tuple[torch.dtype, ...]
    #: Block sizes to test; the first (the platform's default) must work, a backend may
    #: refuse the others with ``ValueError``.
    block_sizes: tuple[int, ...]
    seed: int
    kernels_only: bool
    #: The name the platform was asked for (``--device``); it must report this name.
    expected_name: str
    #: Rebuilds the platform inside a spawned process (picklable), for the checks that
    #: need several ranks; None when that is not possible.
    spawn_platform: Callable[[], Platform] | None


@dataclass(frozen=True)
class SamePlatform:
    """Sends the platform object itself to a child process (it must pickle)."""

    platform: Platform

    def __call__(self) -> Platform:
        return self.platform


@dataclass(frozen=True)
class FromRegistry:
    """Rebuilds a platform by name in a child process, as the parent's registry did."""

    name: str
    blocked: frozenset[str] = frozenset()

    def __call__(self) -> Platform:
        from quire.plugins.registry import PlatformRegistry

        return PlatformRegistry(blocked=self.blocked).create(self.name)
