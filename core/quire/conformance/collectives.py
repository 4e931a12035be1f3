"""The communicator check: collectives and send/recv at world size 1 in this process, and
at 2 and 4 in spawned processes.

Every rank draws every rank's input from the same seeds, so each one can compute the
expected results alone (the reference: sums and concatenations in float32 on the host;
for send/recv, the very tensor the peer drew) and report only its verdict. The spawned
ranks rendezvous through a file in a temporary directory (no TCP port to collide on),
each on ``platform.device(rank)``, over the platform's ``distributed_backend``; a cpu
platform runs its ranks as gloo processes on the host.

Each world size gives two rows: its collectives, and its send/recv (``", send/recv"``).
A communicator that inherits :class:`Communicator`'s default send/recv (one written for
plugin API 1.0) has its send/recv rows "not run", never passed or failed.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.interfaces.communicator import POINT_TO_POINT_API, Communicator
from quire.interfaces.platform import Platform

COMMUNICATOR = "communicator"
#: Seconds the spawned ranks of one world size get to start, meet and finish.
RANK_TIMEOUT_S = 180.0
#: Group sizes run in spawned processes, each where that many devices are visible.
SPAWNED_WORLD_SIZES = (2, 4)
#: The ring's tensor, and one pipeline step's hidden states ``[tokens, hidden]``.
RING_SHAPE = (5, 33)
STEP_SHAPE = (7, 96)
#: Verdict keys a rank writes: collectives' problems, send/recv's (None: not implemented).
COLLECTIVES, P2P = "collectives", "send/recv"

Verdict = dict[str, list[str] | None]


def check_communicator(ctx: CheckContext) -> list[CheckResult]:
    """World size 1 here; 2 and 4 where the devices (or the host) allow."""
    rows = _world_size_1(ctx)
    for world_size in SPAWNED_WORLD_SIZES:
        rows += _spawned(ctx, world_size)
    return rows


# -- what every rank runs


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


def implements_point_to_point(comm: Communicator) -> bool:
    """Whether ``comm`` overrides both of :class:`Communicator`'s default send/recv."""
    cls = type(comm)
    return cls.send is not Communicator.send and cls.recv is not Communicator.recv


def exercise_point_to_point(comm: Communicator, rank: int, world_size: int,
                            device: torch.device, seed: int,
                            dtypes: tuple[torch.dtype, ...]) -> list[str]:
    """Refusals, a ring per dtype, then a pipeline's hand-over; return what was wrong.

    Every rank of the group must call this with the same arguments but ``rank``. At
    world size 1 only the refusals run.
    """
    bad_peers = [rank, world_size, -1] if world_size > 1 else [0, 1]
    problems = _refusals(comm, torch.zeros(2, device=device), bad_peers)
    if world_size == 1:
        return problems
    for dtype in dtypes:
        problems += _ring(comm, rank, world_size, device, seed, dtype)
    if dtypes:  # in the preferred dtype, the one a pipeline would run in
        problems += _pipeline_pair(comm, rank, world_size, device, seed, dtypes[0])
    comm.barrier()  # nobody tears the group down while a peer still receives
    return problems


def _refusals(comm: Communicator, tensor: torch.Tensor, peers: list[int]) -> list[str]:
    """send and recv with a peer that is not one must raise ValueError, and move nothing."""
    here = f"rank {comm.rank} of {comm.world_size}"
    problems = []
    for peer in peers:
        for name, operation in ((f"send(dst={peer})", comm.send),
                                (f"recv(src={peer})", comm.recv)):
            try:
                operation(tensor, peer)
            except ValueError:
                continue
            except Exception as exc:  # the wrong error is a finding, not a crash
                problems.append(f"{name} on {here} raised {type(exc).__name__}, "
                                "expected ValueError")
            else:
                problems.append(f"{name} on {here} returned, expected ValueError")
    return problems


def _ring(comm: Communicator, rank: int, world_size: int, device: torch.device,
          seed: int, dtype: torch.dtype) -> list[str]:
    """Each rank sends its tensor to rank+1 and receives rank-1's, compared bit for bit.

    Even ranks send first and odd ranks receive first, so no backend that waits for the
    matching recv can deadlock (the order the contract asks of callers).
    """
    name = f"ring in {str(dtype).removeprefix('torch.')}"
    mine = _seeded(RING_SHAPE, dtype, seed, rank).to(device)
    kept = mine.clone()
    like = torch.full(RING_SHAPE, -1.0, dtype=dtype, device=device)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    if rank % 2 == 0:
        comm.send(mine, nxt)
        got = comm.recv(like, prev)
    else:
        got = comm.recv(like, prev)
        comm.send(mine, nxt)
    expected = _seeded(RING_SHAPE, dtype, seed, prev)
    problems = _compare(f"{name}: recv(src={prev})", got, expected, device)
    if not torch.equal(mine, kept):
        problems.append(f"{name}: send changed its input")
    if not torch.equal(like, torch.full_like(like, -1.0)):
        problems.append(f"{name}: recv wrote into its `like` tensor")
    return problems


def _pipeline_pair(comm: Communicator, rank: int, world_size: int, device: torch.device,
                   seed: int, dtype: torch.dtype) -> list[str]:
    """Stage r receives hidden states and residual from r-1, then sends its own to r+1.

    The residual goes as a transposed (non-contiguous) view, as a slice of a larger
    activation might; it must arrive as a dense tensor with the same values.
    """
    problems = []
    if rank > 0:
        like = torch.empty(STEP_SHAPE, dtype=dtype, device=device)
        got_hidden, got_residual = comm.recv(like, rank - 1), comm.recv(like, rank - 1)
        want_hidden, want_residual = _stage_outputs(seed, rank - 1, dtype)
        problems += _compare("pipeline hidden states", got_hidden, want_hidden, device)
        problems += _compare("pipeline residual", got_residual, want_residual, device)
    if rank < world_size - 1:
        out_hidden, out_residual = (t.to(device) for t in _stage_outputs(seed, rank, dtype))
        comm.send(out_hidden, rank + 1)
        comm.send(out_residual, rank + 1)
    return problems


def _stage_outputs(seed: int, stage: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, hidden = STEP_SHAPE
    residual = _seeded((hidden, tokens), dtype, seed + 1, stage).t()
    return _seeded(STEP_SHAPE, dtype, seed + 2, stage), residual


def _seeded(shape: tuple[int, ...], dtype: torch.dtype, seed: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def _compare(name: str, got: torch.Tensor, expected: torch.Tensor,
             device: torch.device) -> list[str]:
    if (got.shape, got.dtype, got.device) != (expected.shape, expected.dtype, device):
        return [(f"{name} arrived as {tuple(got.shape)} {got.dtype} on {got.device}, "
                 f"expected {tuple(expected.shape)} {expected.dtype} on {device}")]
    if not got.is_contiguous():
        return [f"{name} arrived as a non-contiguous tensor"]
    if not torch.equal(got.cpu(), expected):
        wrong = (got.cpu() != expected).sum().item()
        return [f"{name}: {wrong} of {expected.numel()} elements differ from what was sent"]
    return []


# -- world size 1, in this process


def _world_size_1(ctx: CheckContext) -> list[CheckResult]:
    comm = ctx.platform.make_communicator(0, 1)
    problems = exercise(comm, 0, 1, ctx.device, ctx.seed)
    if problems:
        collectives = CheckResult(COMMUNICATOR, Outcome.FAIL, "world size 1",
                                  "; ".join(problems))
    else:
        collectives = CheckResult(COMMUNICATOR, Outcome.PASS, "world size 1",
                                  figure="all_reduce, all_gather x2, broadcast, barrier")
    if not isinstance(comm, Communicator):
        return [collectives]
    p2p = None if not implements_point_to_point(comm) else exercise_point_to_point(
        comm, 0, 1, ctx.device, ctx.seed, ctx.dtypes)
    return [collectives, _p2p_row(ctx, 1, p2p, figure="send, recv refused: no peer")]


# -- world sizes 2 and 4, in spawned processes


def _spawned(ctx: CheckContext, world_size: int) -> list[CheckResult]:
    case = f"world size {world_size}"
    reason = _cannot_spawn(ctx, world_size)
    if reason is not None:
        return [CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case, reason)]
    assert ctx.spawn_platform is not None
    verdicts = _spawn_ranks(ctx.spawn_platform, world_size, ctx.seed, ctx.dtypes)
    collectives = _merged(verdicts, COLLECTIVES) or []
    if collectives:
        row = CheckResult(COMMUNICATOR, Outcome.FAIL, case, "; ".join(collectives))
    else:
        row = CheckResult(COMMUNICATOR, Outcome.PASS, case, figure=f"{world_size} ranks "
                          f"over '{ctx.platform.distributed_backend}'")
    dtypes = ", ".join(str(d).removeprefix("torch.") for d in ctx.dtypes)
    return [row, _p2p_row(ctx, world_size, _merged(verdicts, P2P),
                          figure=f"ring in {dtypes}; pipeline hidden states + residual")]


def _merged(verdicts: list[Verdict], part: str) -> list[str] | None:
    """Every rank's problems with ``part``; None when a rank's communicator lacks it."""
    if any(v[part] is None for v in verdicts):
        return None
    return [problem for v in verdicts for problem in v[part] or ()]


def _p2p_row(ctx: CheckContext, world_size: int, problems: list[str] | None,
             figure: str) -> CheckResult:
    case = f"world size {world_size}, send/recv"
    if problems is None:
        return CheckResult(COMMUNICATOR, Outcome.NOT_RUN, case,
                           f"the communicator does not implement send/recv (added in "
                           f"plugin API {POINT_TO_POINT_API}); pipeline parallelism "
                           f"cannot run on '{ctx.platform.name}'")
    if problems:
        return CheckResult(COMMUNICATOR, Outcome.FAIL, case, "; ".join(problems))
    return CheckResult(COMMUNICATOR, Outcome.PASS, case, figure=figure)


def _cannot_spawn(ctx: CheckContext, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot be spawned here, or None when they can."""
    if ctx.spawn_platform is None:
        return "no way to rebuild the platform in a child process was given"
    try:
        pickle.dumps(ctx.spawn_platform)
    except Exception as exc:  # e.g. a platform defined inside a function
        return (f"the platform cannot be sent to a child process ({exc}); "
                "run the suite by platform name instead")
    count = device_count(ctx.platform)
    if count is None:
        return (f"cannot count '{ctx.platform.device_type}' devices: torch.accelerator "
                "does not report them")
    if count < world_size:
        return f"needs {world_size} '{ctx.platform.device_type}' devices, found {count}"
    return None


def device_count(platform: Platform) -> int | None:
    """Local devices of the platform's type; None when torch cannot tell.

    Host ranks share the host, so a cpu platform has room for every world size checked
    (correctness needs no free core per rank). Otherwise this asks ``torch.accelerator``,
    which knows only the accelerator torch itself selected.
    """
    if platform.device_type == "cpu":
        return max(SPAWNED_WORLD_SIZES)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return None
    current = accelerator.current_accelerator()
    if current is None or current.type != platform.device_type:
        return None
    return int(accelerator.device_count())


def _spawn_ranks(source: Callable[[], Platform], world_size: int, seed: int,
                 dtypes: tuple[torch.dtype, ...]) -> list[Verdict]:
    """Each rank's verdict; a rank that hung or died gets the same problem in both parts."""
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="quire-conformance-") as workdir:
        ranks = [spawn.Process(target=rank_main, daemon=True,
                               args=(source, r, world_size, workdir, seed, dtypes))
                 for r in range(world_size)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + RANK_TIMEOUT_S  # one budget for all, not each
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        return [_collect(r, process, Path(workdir)) for r, process in enumerate(ranks)]


def _collect(rank: int, process: multiprocessing.process.BaseProcess, workdir: Path
             ) -> Verdict:
    result = workdir / f"rank{rank}.json"
    if process.is_alive():  # stuck in a collective: stop it, report it
        process.kill()
        process.join()
        problem = f"rank {rank} did not finish within {RANK_TIMEOUT_S:.0f} s"
    elif not result.exists():
        problem = f"rank {rank} exited with status {process.exitcode} without a result"
    else:
        return json.loads(result.read_text())
    return {COLLECTIVES: [problem], P2P: [problem]}


def rank_main(source: Callable[[], Platform], rank: int, world_size: int, workdir: str,
              seed: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """One spawned rank: rebuild the platform, join the group, exercise, write the verdict.

    A part that did not finish because something raised gets that exception as its
    problem; a part that finished keeps its own verdict.
    """
    import torch.distributed as dist

    verdict: Verdict = {}
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
            verdict[COLLECTIVES] = [f"rank {rank}: {p}" for p in
                                    exercise(comm, rank, world_size, device, seed)]
            verdict[P2P] = None
            if isinstance(comm, Communicator) and implements_point_to_point(comm):
                verdict[P2P] = [f"rank {rank}: {p}" for p in exercise_point_to_point(
                    comm, rank, world_size, device, seed, dtypes)]
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # the parent reports it; a traceback here would be lost
        error = [f"rank {rank} raised {type(exc).__name__}: {exc}"]
        verdict = {COLLECTIVES: error, P2P: error, **verdict}
    (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(verdict))
