"""Which checks run, in which mode, and turning their findings into one report.

Modes (decided once per run):

- **full**: the platform is available; every check runs on ``platform.device(0)``.
- **kernels-only** (asked for): the attention backend runs on host tensors (device
  "cpu"), for platforms whose kernels can (Triton under ``TRITON_INTERPRET=1``). The
  checks that need the device (memory, communicator, end-to-end) are reported
  "not run: kernels-only mode", never as passed.
- **unavailable**: the platform says it cannot run here. Every check that needs it is
  reported "not available: <the platform's reason>" and the run does not fail (unless
  the caller requires availability: :meth:`Report.exit_code`). The platform-contract
  check still runs, since it needs no device.
- **broken**: "full", except that ``platform.device(0)`` raised; every check that needs
  the device fails with that error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from quire.conformance.checks import (
    check_kv_write,
    check_memory_profiler,
    check_paged_attention,
    check_platform_contract,
)
from quire.conformance.collectives import check_communicator
from quire.conformance.context import CheckContext, FromRegistry, SamePlatform
from quire.conformance.embedding_ops import check_embedding_ops
from quire.conformance.end_to_end import check_end_to_end
from quire.conformance.kv_quant_ops import check_quantized_kv
from quire.conformance.layer_ops import check_layer_ops
from quire.conformance.lora_ops import check_lora_linear
from quire.conformance.moe_ops import check_moe_ops
from quire.conformance.quant_ops import check_quantized_linear
from quire.conformance.report import CheckResult, Outcome, Report
from quire.interfaces.platform import Availability, Platform
from quire.plugins.registry import PlatformRegistry

#: What a check needs before it can run.
NEEDS_NOTHING, NEEDS_BACKEND, NEEDS_DEVICE = "nothing", "backend", "device"


@dataclass(frozen=True)
class Check:
    #: Short name for ``--check`` and pytest ids.
    id: str
    #: The name shown in the table.
    title: str
    run: Callable[[CheckContext], list[CheckResult]]
    needs: str


#: Every check, in the order the table lists them.
CHECKS: tuple[Check, ...] = (
    Check("platform", "platform contract", check_platform_contract, NEEDS_NOTHING),
    Check("kv-write", "kv write", check_kv_write, NEEDS_BACKEND),
    Check("attention", "paged attention", check_paged_attention, NEEDS_BACKEND),
    Check("layer-ops", "layer ops", check_layer_ops, NEEDS_BACKEND),
    Check("moe", "moe ops", check_moe_ops, NEEDS_BACKEND),
    Check("embedding", "embedding ops", check_embedding_ops, NEEDS_BACKEND),
    Check("quant-linear", "quantized linear", check_quantized_linear, NEEDS_BACKEND),
    Check("kv-quant", "quantised kv", check_quantized_kv, NEEDS_BACKEND),
    Check("lora", "lora linear", check_lora_linear, NEEDS_BACKEND),
    Check("memory", "memory profiler", check_memory_profiler, NEEDS_DEVICE),
    Check("communicator", "communicator", check_communicator, NEEDS_DEVICE),
    Check("end-to-end", "end-to-end", check_end_to_end, NEEDS_DEVICE),
)
CHECK_IDS: tuple[str, ...] = tuple(c.id for c in CHECKS)


@dataclass(frozen=True)
class ConformanceOptions:
    """How to run the suite. Checked on creation; raises ``ValueError``."""

    kernels_only: bool = False
    #: dtypes to test; None: every dtype the platform declares.
    dtypes: tuple[torch.dtype, ...] | None = None
    #: Block sizes to test; None: the platform's default, then 16 (or 32 when that is the
    #: default), then 3. The first one given must work; a backend may refuse the others.
    block_sizes: tuple[int, ...] | None = None
    #: Check ids to run (see :data:`CHECK_IDS`); None: all.
    checks: tuple[str, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.checks or ()) - set(CHECK_IDS))
        if unknown:
            raise ValueError(f"unknown check(s) {', '.join(unknown)}; "
                             f"known: {', '.join(CHECK_IDS)}")
        if self.block_sizes is not None and (
            not self.block_sizes or any(type(b) is not int or b < 1 for b in self.block_sizes)
        ):
            raise ValueError(f"block sizes must be integers >= 1, got {self.block_sizes}")
        if self.dtypes is not None and not self.dtypes:
            raise ValueError("give at least one dtype, or None for the platform's")


def run_conformance(
    platform: Platform,
    options: ConformanceOptions = ConformanceOptions(),
    *,
    expected_name: str | None = None,
    spawn_platform: Callable[[], Platform] | None = None,
) -> Report:
    """Run the suite against ``platform``.

    :param expected_name: the name the platform was asked for (default: its own).
    :param spawn_platform: rebuilds the platform in a child process for the world-size-2
        communicator check (picklable); default: the platform object itself, pickled.
    :raises ValueError: when ``options.dtypes`` names a dtype the platform does not
        declare.
    """
    availability = _probe(platform)
    dtypes = _dtypes(platform, options.dtypes)
    mode, device = "unavailable", torch.device("cpu")  # cpu: used by the contract check only
    if options.kernels_only:
        mode = "kernels-only"
    elif availability:
        mode = "full"
        try:
            device = platform.device(0)
        except Exception as exc:  # the contract check names it; nothing else can run
            availability = Availability.no(f"device(0) raised {type(exc).__name__}: {exc}")
            mode = "broken"
    ctx = CheckContext(
        platform=platform,
        device=device,
        dtypes=dtypes,
        block_sizes=options.block_sizes or _default_block_sizes(platform),
        seed=options.seed,
        kernels_only=options.kernels_only,
        expected_name=expected_name or platform.name,
        spawn_platform=spawn_platform or SamePlatform(platform),
    )
    results: list[CheckResult] = []
    for check in _selected(options.checks):
        results += _run_one(check, ctx, mode, availability)
    return Report(platform.name, mode, str(device) if mode != "unavailable" else "-",
                  tuple(results), availability.reason if mode == "unavailable" else "")


def run_by_name(
    registry: PlatformRegistry, name: str, options: ConformanceOptions = ConformanceOptions()
) -> Report:
    """Run the suite against the platform ``name`` of ``registry``.

    A platform whose factory fails is unavailable with that failure as the reason, as in
    ``quire plugins``; then no check can run at all.

    :raises ValueError: ``name`` is unknown or refused (the message says why), or an
        option does not suit the platform.
    """
    availability = registry.availability(name)
    try:
        platform = registry.create(name)
    except RuntimeError:  # the factory failed; availability() carries the message
        rows = tuple(CheckResult(c.title, Outcome.NOT_AVAILABLE, reason=availability.reason)
                     for c in _selected(options.checks))
        return Report(name, "unavailable", "-", rows, availability.reason)
    return run_conformance(platform, options, expected_name=name,
                           spawn_platform=FromRegistry(name, registry.blocked))


def _run_one(check: Check, ctx: CheckContext, mode: str,
             availability: Availability) -> list[CheckResult]:
    if check.needs != NEEDS_NOTHING and mode in ("unavailable", "broken"):
        outcome = Outcome.NOT_AVAILABLE if mode == "unavailable" else Outcome.FAIL
        return [CheckResult(check.title, outcome, reason=availability.reason)]
    if check.needs == NEEDS_DEVICE and mode == "kernels-only":
        return [CheckResult(check.title, Outcome.NOT_RUN, reason="kernels-only mode")]
    try:
        return check.run(ctx)
    except Exception as exc:  # a contract breach the check did not foresee is still a FAIL
        return [CheckResult(check.title, Outcome.FAIL, reason=f"raised {type(exc).__name__}: "
                            f"{exc}")]


def _probe(platform: Platform) -> Availability:
    try:
        result = platform.availability()
    except Exception as exc:  # the contract check reports this as a breach
        return Availability.no(f"availability() raised {type(exc).__name__}: {exc}")
    if not isinstance(result, Availability):
        return Availability.no(f"availability() returned {result!r}")
    return result


def _dtypes(platform: Platform, asked: tuple[torch.dtype, ...] | None) -> tuple[torch.dtype, ...]:
    declared = tuple(getattr(platform, "supported_dtypes", ()))
    if asked is None:
        return declared
    for dtype in asked:
        if dtype not in declared:
            names = ", ".join(str(d).removeprefix("torch.") for d in declared)
            raise ValueError(f"platform '{platform.name}' does not declare "
                             f"{str(dtype).removeprefix('torch.')}; it declares {names}")
    return tuple(asked)


def _default_block_sizes(platform: Platform) -> tuple[int, ...]:
    default = getattr(platform, "default_block_size", None)
    if type(default) is not int or default < 1:  # the contract check reports it
        default = 16
    other = 32 if default == 16 else 16
    return tuple(dict.fromkeys((default, other, 3)))


def _selected(ids: Iterable[str] | None) -> list[Check]:
    wanted = set(ids) if ids is not None else set(CHECK_IDS)
    return [c for c in CHECKS if c.id in wanted]
