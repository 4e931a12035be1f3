"""The cpu platform: its contract, its plugin hook, host memory readings, collectives."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pluggy
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quire.distributed import TorchDistributedCommunicator
from quire.interfaces import AttentionBackend, Communicator, MemoryProfiler, Platform
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu import CpuPlatform
from quire.platforms.cpu import plugin as cpu_plugin
from quire.platforms.cpu.memory import CpuMemoryProfiler
from quire.platforms.cpu.packed_linear import onednn_available
from quire.plugins import hookspecs
from quire.plugins.spec import PLUGIN_API_VERSION

GIB = 1 << 30
MIB = 1 << 20


# -- platform contract ---------------------------------------------------------------------


def test_platform_attributes() -> None:
    platform = CpuPlatform()
    assert isinstance(platform, Platform)
    assert platform.name == "cpu" and platform.device_type == "cpu"
    assert platform.distributed_backend == "gloo"
    assert platform.supported_dtypes == (torch.float32, torch.bfloat16, torch.float16)
    assert platform.default_block_size == 16
    assert platform.priority == 0
    assert platform.device() == torch.device("cpu")
    availability = platform.availability()
    assert availability and platform.is_available()
    assert availability.reason == ""


@pytest.mark.parametrize("machine,flags,bf16", [
    ("x86_64", ["avx2", "fma"], False),                                  # Zen 3
    ("x86_64", ["avx2", "fma", "avx512f", "avx512_bf16"], True),          # Zen 4
    ("x86_64", ["avx2", "fma", "avx512f", "amx_tile", "amx_bf16"], True),  # Sapphire Rapids
    ("aarch64", ["asimd", "asimddp"], False),                             # Graviton 2
    ("aarch64", ["asimd", "asimddp", "bf16", "i8mm"], True),              # Graviton 3
])
def test_auto_dtype_is_bfloat16_only_for_bf16_checkpoints_on_cpus_with_bf16_products(
        monkeypatch, machine: str, flags: list[str], bf16: bool) -> None:
    from quire.platforms.cpu import platform as platform_module
    from quire.platforms.cpu.isa import CpuFeatures, has_bf16_products

    features = CpuFeatures.of(machine, flags)
    assert has_bf16_products(features) == bf16
    monkeypatch.setattr(platform_module, "detect", lambda: features)
    platform = CpuPlatform()
    want = torch.bfloat16 if bf16 and onednn_available() else torch.float32
    assert platform.auto_dtype(torch.bfloat16) == want
    # a dtype unstated (a GGUF file) keeps a float32 model everywhere: its products
    # take bfloat16 through the activations option instead
    for stored in (torch.float32, torch.float16, None):
        assert platform.auto_dtype(stored) == torch.float32


def test_checkpoint_dtype_reads_the_config() -> None:
    from quire.models.loader import checkpoint_dtype
    from transformers import LlamaConfig

    assert checkpoint_dtype(LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert checkpoint_dtype(LlamaConfig(dtype=torch.float16)) == torch.float16
    assert checkpoint_dtype(LlamaConfig()) is None


def test_check_dtype() -> None:
    platform = CpuPlatform()
    for dtype in platform.supported_dtypes:
        platform.check_dtype(dtype)
    with pytest.raises(ValueError, match=r"float64 .* 'cpu' .*: float32, bfloat16, float16"):
        platform.check_dtype(torch.float64)


def test_factories_build_fresh_backends() -> None:
    platform = CpuPlatform()
    backend = platform.make_attention_backend()
    assert isinstance(backend, AttentionBackend) and isinstance(backend, ReferenceAttentionBackend)
    assert platform.make_attention_backend() is not backend
    comm = platform.make_communicator()
    assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (0, 1)
    assert isinstance(platform.make_memory_profiler(), MemoryProfiler)


# -- plugin hook -------------------------------------------------------------------------------


def test_plugin_hook_provides_the_platform() -> None:
    pm = pluggy.PluginManager("quire")
    pm.add_hookspecs(hookspecs)
    pm.register(cpu_plugin)
    (specs,) = pm.hook.quire_platforms()
    (spec,) = specs
    assert spec.name == "cpu" and spec.api_version == PLUGIN_API_VERSION
    assert spec.description
    assert isinstance(spec.factory(), CpuPlatform)


def test_entry_point_names_the_plugin_module() -> None:
    points = importlib.metadata.entry_points(group="quire.platforms")
    (cpu,) = [p for p in points if p.name == "cpu"]
    assert cpu.load() is cpu_plugin


# -- memory --------------------------------------------------------------------------------------


def fake_proc(
    root: Path, *, available_kib: int, total_kib: int = 64 * 1024 * 1024, rss_kib: int = 1000
) -> Path:
    """A procfs stand-in with meminfo and self/status; no clear_refs (not writable)."""
    (root / "self").mkdir(parents=True)
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        12 kB\n"
        f"MemAvailable:   {available_kib} kB\nHugePages_Total:       0\n"
    )
    write_status(root, hwm_kib=rss_kib, rss_kib=rss_kib)
    (root / "self" / "clear_refs").mkdir()  # a directory: opening it to write fails
    return root


def write_status(proc: Path, *, hwm_kib: int, rss_kib: int) -> None:
    (proc / "self" / "status").write_text(
        f"Name:\tpython\nVmPeak:\t  999999 kB\n"
        f"VmHWM:\t{hwm_kib:8d} kB\nVmRSS:\t{rss_kib:8d} kB\n"
    )


def test_real_host_readings_are_sane() -> None:
    profiler = CpuMemoryProfiler()
    total, free = profiler.total_memory(), profiler.free_memory()
    assert 0 < free <= total


def test_readings_parse_meminfo(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", available_kib=1000, total_kib=4000)
    profiler = CpuMemoryProfiler(proc=proc, cgroup=tmp_path / "no-cgroup")
    assert profiler.total_memory() == 4000 * 1024
    assert profiler.free_memory() == 1000 * 1024


def test_cgroup_limit_caps_readings(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", available_kib=8 * 1024 * 1024)  # 8 GiB free on host
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{2 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB // 2}\n")
    profiler = CpuMemoryProfiler(proc=proc, cgroup=cgroup)
    assert profiler.total_memory() == 2 * GIB
    assert profiler.free_memory() == 2 * GIB - GIB // 2
    (cgroup / "memory.max").write_text("max\n")  # unlimited: host figures again
    assert profiler.free_memory() == 8 * GIB


def test_sysconf_fallback_without_proc(tmp_path: Path) -> None:
    profiler = CpuMemoryProfiler(proc=tmp_path / "absent", cgroup=tmp_path / "absent")
    total, free = profiler.total_memory(), profiler.free_memory()
    assert 0 < free <= total


# The two peak tests run in a fresh interpreter: in a long-lived process (the test
# session) the allocator may serve 200 MB from heap pages that earlier tests freed but
# that are still resident, and then no peak moves, correctly so.
_PEAK_SCRIPT = """
import sys, torch
from pathlib import Path
from quire.platforms.cpu.memory import CpuMemoryProfiler
MIB = 1 << 20
profiler = CpuMemoryProfiler()
if sys.argv[1] == "grow":
    profiler.reset_peak()
    before = profiler.peak_memory()
    block = torch.ones(200 * MIB // 4)  # 200 MB, written so the pages are resident
    after = profiler.peak_memory()
    del block
    # freeing does not lower the peak until the next reset
    print(after - before, profiler.peak_memory() - before)
else:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        print("skip")
        sys.exit(0)
    rise = profiler.profile(lambda: torch.ones(200 * MIB // 4).sum())
    print(rise, rise)
"""


def _run_peak_script(mode: str) -> list[str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, mode], capture_output=True,
                          text=True, check=True)
    return done.stdout.split()


def test_peak_grows_with_a_touched_allocation() -> None:
    during, after_free = (int(v) for v in _run_peak_script("grow"))
    # Linux's RSS counters are synced lazily, so compare with the allocation's size,
    # not byte for byte
    assert during >= 180 * MIB
    assert after_free >= 180 * MIB


def test_profile_reports_a_freed_transient_peak() -> None:
    result = _run_peak_script("profile")
    if result == ["skip"]:
        pytest.skip("clear_refs not writable here: the fallback cannot see freed memory")
    assert int(result[0]) >= 180 * MIB


def test_peak_fallback_without_clear_refs(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", available_kib=1000)
    write_status(proc, hwm_kib=5000, rss_kib=3000)  # an earlier lifetime high of 5000
    profiler = CpuMemoryProfiler(proc=proc, cgroup=tmp_path / "no-cgroup")
    profiler.reset_peak()
    assert profiler.peak_memory() == 3000 * 1024  # RSS at reset
    write_status(proc, hwm_kib=5000, rss_kib=4000)  # below the old high: lower bound
    assert profiler.peak_memory() == 4000 * 1024
    write_status(proc, hwm_kib=7000, rss_kib=3500)  # a new high inside the window: exact
    assert profiler.peak_memory() == 7000 * 1024


def test_kv_budget_arithmetic(tmp_path: Path) -> None:
    def profiler_with_free(gib: int) -> CpuMemoryProfiler:
        proc = fake_proc(tmp_path / f"proc{gib}", available_kib=gib * 1024 * 1024)
        return CpuMemoryProfiler(proc=proc, cgroup=tmp_path / "no-cgroup")

    small, large = profiler_with_free(10), profiler_with_free(100)
    assert small.kv_budget(None) == int(10 * GIB * 0.4)  # 40% of free
    assert large.kv_budget(None) == 8 * GIB  # capped
    assert large.kv_budget(None, activation_peak=GIB) == 7 * GIB
    assert small.kv_budget(0.5) == 5 * GIB
    assert small.kv_budget(0.5, activation_peak=GIB) == 4 * GIB
    assert small.kv_budget(3 * GIB) == 3 * GIB

    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        small.kv_budget(1.5)
    with pytest.raises(ValueError, match="must be > 0"):
        small.kv_budget(-1)
    with pytest.raises(ValueError, match="exceeds"):
        small.kv_budget(11 * GIB)
    with pytest.raises(ValueError, match="no memory left"):
        small.kv_budget(None, activation_peak=5 * GIB)

    assert small.num_kv_blocks(1000, 300) == 3
    with pytest.raises(ValueError, match="holds no page"):
        small.num_kv_blocks(100, 300)
    with pytest.raises(ValueError, match="bytes_per_block"):
        small.num_kv_blocks(1000, 0)


# -- communicator --------------------------------------------------------------------------------


def test_world_size_one_returns_inputs_unchanged() -> None:
    comm = TorchDistributedCommunicator("gloo")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    original = x.clone()
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x, dim=0) is x
    assert comm.broadcast(x) is x
    comm.barrier()
    assert torch.equal(x, original)


def test_bad_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        TorchDistributedCommunicator("gloo", 0, 0)
    with pytest.raises(ValueError, match="rank"):
        TorchDistributedCommunicator("gloo", 2, 2)
    with pytest.raises(ValueError, match="src"):
        TorchDistributedCommunicator("gloo").broadcast(torch.ones(1), src=1)


@pytest.mark.parametrize("peer", [0, 1, -1])
def test_send_and_recv_have_no_peer_at_world_size_one(peer: int) -> None:
    comm = TorchDistributedCommunicator("gloo")
    x = torch.ones(2)
    with pytest.raises(ValueError, match=f"send to dst {peer}: rank 0 of world size 1 has no"):
        comm.send(x, peer)
    with pytest.raises(ValueError, match=f"recv from src {peer}: rank 0 of world size 1 has"):
        comm.recv(x, peer)
    assert torch.equal(x, torch.ones(2))


def test_many_ranks_need_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group.*'gloo'"):
        TorchDistributedCommunicator("gloo", rank=0, world_size=2)


def _worker(rank: int, world_size: int, init_file: str) -> None:
    """Runs in a spawned process; an assertion failure fails the parent's spawn call."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        comm = CpuPlatform().make_communicator(rank, world_size)
        _check_collectives(comm)
        _check_send_recv_ring(comm)
        _check_pipeline_hand_over(comm)
        _check_bad_peers(comm)
        comm.barrier()  # no rank tears the group down while a peer still receives
        with pytest.raises(RuntimeError, match="asked for 'xccl'"):
            TorchDistributedCommunicator("xccl", rank, world_size)
    finally:
        dist.destroy_process_group()


def _check_collectives(comm: Communicator) -> None:
    rank, n = comm.rank, comm.world_size
    x = torch.full((2, 3), float(rank + 1))
    original = x.clone()
    assert torch.equal(comm.all_reduce(x), torch.full((2, 3), n * (n + 1) / 2))
    expected = torch.cat([torch.full((2, 3), float(r + 1)) for r in range(n)])
    assert torch.equal(comm.all_gather(x, dim=0), expected)
    assert comm.all_gather(x).shape == (2, 3 * n)
    assert torch.equal(comm.broadcast(x, src=0), torch.full((2, 3), 1.0))
    comm.barrier()
    assert torch.equal(x, original)  # inputs are never changed


def _drawn(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 9, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _check_send_recv_ring(comm: Communicator) -> None:
    """Each rank sends to rank+1 and receives from rank-1; even ranks send first."""
    rank, n = comm.rank, comm.world_size
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        mine, like = _drawn(rank, dtype), torch.zeros(4, 9, dtype=dtype)
        if rank % 2 == 0:
            comm.send(mine, (rank + 1) % n)
            got = comm.recv(like, (rank - 1) % n)
        else:
            got = comm.recv(like, (rank - 1) % n)
            comm.send(mine, (rank + 1) % n)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, _drawn((rank - 1) % n, dtype)), dtype
        assert torch.equal(mine, _drawn(rank, dtype)) and not like.any()  # inputs unchanged


def _check_pipeline_hand_over(comm: Communicator) -> None:
    """Stage r receives hidden states and a (non-contiguous) residual from r-1, adds one to
    each and passes them on: the last stage holds stage 0's tensors plus one n times."""
    rank, n = comm.rank, comm.world_size
    hidden = _drawn(100, torch.bfloat16)
    residual = _drawn(101, torch.bfloat16).t()  # [9, 4], a view with swapped strides
    if rank > 0:
        hidden = comm.recv(hidden, rank - 1)
        residual = comm.recv(residual, rank - 1)
        assert residual.shape == (9, 4) and residual.is_contiguous()
    hidden, residual = hidden + 1, residual + 1
    if rank < n - 1:
        comm.send(hidden, rank + 1)
        comm.send(residual, rank + 1)
    else:
        want_hidden, want_residual = _drawn(100, torch.bfloat16), _drawn(101, torch.bfloat16).t()
        for _ in range(n):  # one rounding per stage, as the stages did
            want_hidden, want_residual = want_hidden + 1, want_residual + 1
        assert torch.equal(hidden, want_hidden) and torch.equal(residual, want_residual)


def _check_bad_peers(comm: Communicator) -> None:
    rank, n = comm.rank, comm.world_size
    x = torch.ones(1)
    with pytest.raises(ValueError, match=f"that is this rank \\(rank {rank} of world size {n}"):
        comm.send(x, rank)
    with pytest.raises(ValueError, match=f"recv from src {n}: it must be in \\[0, {n}\\)"):
        comm.recv(x, n)
    with pytest.raises(ValueError, match="send to dst -1: it must be in"):
        comm.send(x, -1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_over_gloo(world_size: int, tmp_path: Path) -> None:
    # A file rendezvous instead of a TCP port: no free-port race with parallel runs.
    mp.spawn(_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size,
             join=True)


@pytest.mark.parametrize("flags,kernel,option,dtype_auto,want", [
    (["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], True, "auto", True, "bfloat16"),
    (["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], True, "auto", False, "dtype"),
    (["avx512f", "avx512_bf16"], True, "auto", True, "bfloat16"),   # Zen 4: no AMX
    (["avx512f", "avx512_bf16"], True, "auto", False, "dtype"),
    (["avx2", "fma"], False, "auto", True, "dtype"),                # no bfloat16 kernel
    (["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], False, "auto", True, "dtype"),
    (["avx512f", "avx512_bf16"], True, "bfloat16", False, "bfloat16"),  # asked for
    (["avx2", "fma"], False, "bfloat16", True, "bfloat16"),         # cannot run: logged
    (["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], True, "int8", True, "int8"),
    (["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], True, "dtype", True, "dtype"),
])
def test_the_activations_option_resolves_by_cpu_build_and_dtype(
        monkeypatch, caplog, flags, kernel, option, dtype_auto, want) -> None:
    """``activations=auto`` is bfloat16 products where the build has the bfloat16
    kernel (AVX512_BF16, AMX tiles or not) for a dtype left to auto; an explicit dtype,
    or a build without that kernel, keeps the model's. ``settle_options`` hands workers
    that choice explicitly (other values as they are); ``bfloat16`` where the build
    cannot run it falls back to float32 products and says so."""
    from types import SimpleNamespace

    from quire.platforms.cpu import platform as platform_module
    from quire.platforms.cpu.isa import CpuFeatures
    from quire.platforms.cpu.options import CpuOptions

    assert CpuOptions().activations == "auto"
    monkeypatch.setattr(platform_module, "detect", lambda: CpuFeatures.of("x86_64", flags))
    platform = CpuPlatform()
    platform.configure({"activations": option, "threads": 1})
    monkeypatch.setattr(platform, "_native_kernels",
                        lambda: SimpleNamespace(has_quant_bf16=kernel))
    settled = platform.settle_options({"activations": option, "threads": 1},
                                      dtype_auto=dtype_auto)
    assert settled == {"activations": want, "threads": 1}
    with caplog.at_level("INFO", logger=platform_module.logger.name):
        taken = platform.bf16_activations(dtype_auto)
    assert taken is (want == "bfloat16" and kernel)
    if want == "bfloat16" and not kernel:
        assert "products stay float32" in caplog.text
    # a worker gets the settled options and an explicit dtype: the same answer
    worker = CpuPlatform()
    worker.configure(settled)
    monkeypatch.setattr(worker, "_native_kernels",
                        lambda: SimpleNamespace(has_quant_bf16=kernel))
    assert worker.bf16_activations(False) is taken


def test_the_decode_activations_option() -> None:
    """``decode_activations``: ``auto`` (the default) leaves each layer to follow its
    batched products' activations (None), ``bfloat16`` and ``float32`` say which, and
    int8 rows (``int8``, or ``activations=int8``, which implies them) take no bfloat16
    ones; another value is refused naming the option and the accepted ones."""
    from quire.platforms.cpu.options import CpuOptions

    assert CpuOptions().decode_activations == "auto"
    assert CpuOptions.parse({}, {}).bf16_decode is None
    assert CpuOptions.parse({"decode_activations": "bfloat16"}, {}).bf16_decode is True
    assert CpuOptions.parse({"decode_activations": "float32"}, {}).bf16_decode is False
    env = {"QUIRE_CPU_DECODE_ACTIVATIONS": "bfloat16"}
    assert CpuOptions.parse({}, env).bf16_decode is True
    for options in ({"decode_activations": "int8"},
                    {"decode_activations": "bfloat16", "activations": "int8"}):
        parsed = CpuOptions.parse(options, {})
        assert parsed.int8_decode and parsed.bf16_decode is False
    with pytest.raises(ValueError, match="decode_activations='int4'.*auto, float32, "
                                         "bfloat16, int8"):
        CpuOptions.parse({"decode_activations": "int4"}, {})


def test_bfloat16_activations_mark_a_gguf_model_s_layers_and_stay_close(random_gguf,
                                                                        monkeypatch) -> None:
    """``activations=bfloat16`` on a GGUF model: every weight-only quantised layer takes
    the op's ``bf16_activations``, the batched products run on the bfloat16 kernel, and
    greedy tokens and logprobs stay close to float32 products' (logprobs within 0.05
    where the tokens agree); ``dtype`` marks none. Where the products take bfloat16,
    ``kv_cache_dtype=auto`` gives bfloat16 pages, an explicit ``float32`` float32 ones."""
    from quire import LLM, SamplingParams
    from quire.ops.quantized import QuantizedLinearKernel
    from quire.platforms.cpu.native import NativeKernels, load_native_kernels

    native = load_native_kernels()
    if native is None or not native.has_quant_bf16:
        pytest.skip("no bfloat16 products (AVX512_BF16) on this host")
    path = random_gguf("--preset", "tiny", "--seed", "7")
    prompts = [[1, 17 + i, 45, 99, 23, 7 + i, 5] for i in range(6)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    calls = []
    original = NativeKernels.quant_linear_bf16

    def counting(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(self, x, *args, **kwargs)

    kv_dtypes = []

    def run(activations, dtype="float32", **options):
        with LLM(str(path), device="cpu", kv_cache_memory=16 << 20, dtype=dtype,
                 platform_options={"activations": activations}, **options) as llm:
            worker = llm.engine.core.executor.worker
            kv_dtypes.append(worker.kv_dtype)
            kernels = [m.kernel for m in worker.model.modules()
                       if isinstance(getattr(m, "kernel", None), QuantizedLinearKernel)]
            outs = llm.generate(prompts, params)
        return kernels, [(o.outputs[0].token_ids,
                          [step[t].logprob for step, t in zip(o.outputs[0].logprobs,
                                                              o.outputs[0].token_ids)])
                         for o in outs]

    monkeypatch.setattr(NativeKernels, "quant_linear_bf16", counting)
    plain_kernels, plain = run("dtype")
    assert not calls and plain_kernels
    assert not any(k.bf16_activations for k in plain_kernels)
    kernels, rounded = run("bfloat16")
    assert kernels and all(k.bf16_activations for k in kernels)
    assert calls and min(calls) > 4
    run("bfloat16", kv_cache_dtype="float32")
    assert kv_dtypes == [torch.float32, torch.bfloat16, torch.float32]
    # auto where the build has the bfloat16 kernel (AMX tiles or not): taken for dtype
    # auto (float32 for a GGUF file), not for an explicit float32
    assert not any(k.bf16_activations for k in run("auto")[0])
    assert all(k.bf16_activations for k in run("auto", dtype="auto")[0])
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(rounded, plain):
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                     len(tokens))
        assert agree >= 2
        assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.05)


@pytest.mark.parametrize("activations", ["dtype", "bfloat16"])
def test_a_draft_model_s_products_and_pages_follow_the_activations(random_gguf,
                                                                   activations) -> None:
    """A GGUF draft model (``speculative_config.model``) takes bfloat16 activations on its
    quantised layers, and bfloat16 pages at ``kv_cache_dtype=auto``, exactly where the
    target does; with ``activations=dtype`` neither."""
    from quire import LLM
    from quire.ops.quantized import QuantizedLinearKernel
    from quire.platforms.cpu.native import load_native_kernels

    native = load_native_kernels()
    if native is None or not native.has_quant_bf16:
        pytest.skip("no bfloat16 products (AVX512_BF16) on this host")
    path = str(random_gguf("--preset", "tiny", "--seed", "7"))
    with LLM(path, device="cpu", kv_cache_memory=16 << 20, dtype="float32",
             platform_options={"activations": activations},
             speculative_config={"model": path, "num_speculative_tokens": 2}) as llm:
        worker = llm.engine.core.executor.worker
        draft = [m.kernel for m in worker.draft_model.modules()
                 if isinstance(getattr(m, "kernel", None), QuantizedLinearKernel)]
        target_pages, draft_pages = worker.kv_dtype, worker.draft_kv_dtype
    bf16 = activations == "bfloat16"
    assert draft and all(k.bf16_activations == bf16 for k in draft)
    assert target_pages == draft_pages == (torch.bfloat16 if bf16 else torch.float32)

