"""The communicator check: collectives at world size 1, and at 2 in spawned processes.

Every rank draws every rank's input from the same seeds, so each one can compute the
expected results alone (the reference: sums and concatenations in float32 on the host)
and report only its verdict. At world size 2 the ranks rendezvous through a file in a
temporary directory (no TCP port to collide on), each on ``platform.device(rank)``, over
the platform's ``distributed_backend``; a cpu platform runs two gloo ranks on the host.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.interfaces.communicator import Communicator
from quire.interfaces.platform import Platform

COMMUNICATOR = "communicator"
#: Seconds the two ranks get to start, meet and finish before they are stopped.
RANK_TIMEOUT_S = 180.0


def check_communicator(ctx: CheckContext) -> list[CheckResult]:
    """World size 1 in this process; world size 2 where two devices (or the host) allow."""
    return [_world_size_1(ctx), _world_size_2(ctx)]


def exercise(comm: object, rank: int, world_size: int, device: torch.device,
             seed: int) -> list[str]:
    """Run every collective once on ``comm``; return what was wrong (empty when nothing).

    Every rank must call this with the same ``seed`` (collectives go in one order).
    """
    if not isinstance(comm, Communicator):
        return [f"make_communicator returned {type(comm).__name__}, not a Communicator"]
    problems = []
    if (comm.rank, comm.world_size) != (rank, world_size):
        problems.append(f"reports rank {comm.rank} of {comm.world_size}, "
                        f"expected {rank} of {world_size}")
    inputs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(seed + r))
              for r in range(world_size)]
    mine = inputs[rank].to(device)
    kept = mine.clone()
    last = world_size - 1
    results = {
        "all_reduce": (comm.all_reduce(mine), sum(inputs[1:], inputs[0])),
        "all_gather(dim=0)": (comm.all_gather(mine, dim=0), torch.cat(inputs, 0)),
        "all_gather(dim=-1)": (comm.all_gather(mine, dim=-1), torch.cat(inputs, -1)),
        f"broadcast(src={last})": (comm.broadcast(mine, src=last), inputs[last]),
    }
    comm.barrier()
    for name, (got, expected) in results.items():
        got = got.detach().cpu().float()
        if got.shape != expected.shape:
            problems.append(f"{name} returned shape {tuple(got.shape)}, "
                            f"expected {tuple(expected.shape)}")
        elif not torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
            err = (got - expected).abs().max().item()
            problems.append(f"{name} differs from the reference by up to {err:.2e}")
    if not torch.equal(mine, kept):
        problems.append("a collective changed its input in place")
    return problems


def _world_size_1(ctx: CheckContext) -> CheckResult:
    case = "world size 1"
    problems = exercise(ctx.platform.make_communicator(0, 1), 0, 1, ctx.device, ctx.seed)
    if problems:
        return CheckResult(COMMUNICATOR, Outcome.FAIL, case, "; ".join(problems))
    return CheckResult(COMMUNICATOR, Outcome.PASS, case,
                       figure="all_reduce, all_gather x2, broadcast, barrier")


def _world_size_2(ctx: CheckContext) -> CheckResult:
    case = "world size 2"
    if ctx.spawn_platform is None:
        return CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case,
                           "no way to rebuild the platform in a child process was given")
    try:
        pickle.dumps(ctx.spawn_platform)
    except Exception as exc:  # e.g. a platform defined inside a function
        return CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case,
                           f"the platform cannot be sent to a child process ({exc}); "
                           "run the suite by platform name instead")
    count = device_count(ctx.platform)
    if count is None:
        return CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case,
                           f"cannot count '{ctx.platform.device_type}' devices: torch."
                           "accelerator does not report them")
    if count < 2:
        return CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case,
                           f"needs 2 '{ctx.platform.device_type}' devices, found {count}")
    problems = _spawn_ranks(ctx.spawn_platform, 2, ctx.seed)
    if problems:
        return CheckResult(COMMUNICATOR, Outcome.FAIL, case, "; ".join(problems))
    return CheckResult(COMMUNICATOR, Outcome.PASS, case,
                       figure=f"2 ranks over '{ctx.platform.distributed_backend}'")


def device_count(platform: Platform) -> int | None:
    """Local devices of the platform's type; None when torch cannot tell.

    Host ranks share the host, so a cpu platform always has room for two. Otherwise this
    asks ``torch.accelerator``, which knows only the accelerator torch itself selected.
    """
    if platform.device_type == "cpu":
        return 2
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return None
    current = accelerator.current_accelerator()
    if current is None or current.type != platform.device_type:
        return None
    return int(accelerator.device_count())


def _spawn_ranks(source: Callable[[], Platform], world_size: int, seed: int) -> list[str]:
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="quire-conformance-") as workdir:
        ranks = [spawn.Process(target=rank_main, args=(source, r, world_size, workdir, seed),
                               daemon=True) for r in range(world_size)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(RANK_TIMEOUT_S)
        problems = []
        for r, process in enumerate(ranks):
            if process.is_alive():  # stuck in a collective: stop it, report it
                process.kill()
                process.join()
                problems.append(f"rank {r} did not finish within {RANK_TIMEOUT_S:.0f} s")
                continue
            result = Path(workdir) / f"rank{r}.json"
            if not result.exists():
                problems.append(f"rank {r} exited with status {process.exitcode} "
                                "without a result")
                continue
            problems += json.loads(result.read_text())
    return problems


def rank_main(source: Callable[[], Platform], rank: int, world_size: int, workdir: str,
              seed: int) -> None:
    """One spawned rank: rebuild the platform, join the group, exercise, write the verdict."""
    import torch.distributed as dist

    try:
        platform = source()
        platform.availability()  # loads vendor libraries; some register their backend so
        device = platform.device(rank)
        dist.init_process_group(
            platform.distributed_backend,
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=RANK_TIMEOUT_S / 2),
            device_id=None if device.type == "cpu" else device,  # binds NCCL-like groups
        )
        try:
            comm = platform.make_communicator(rank, world_size)
            problems = [f"rank {rank}: {p}" for p in exercise(comm, rank, world_size, device,
                                                               seed)]
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # the parent reports it; a traceback here would be lost
        problems = [f"rank {rank} raised {type(exc).__name__}: {exc}"]
    (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(problems))
