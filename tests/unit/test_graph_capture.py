"""The pieces of graph replay that need no model: the ladder of sizes, the Triton
backend's in-place metadata refill, the platform hook's defaults and the flag."""

from __future__ import annotations

import pytest
import torch
from quire.config import EngineConfig
from quire.entrypoints.cli import build_parser, parse_args
from quire.executor.graphs import DecodeGraphs, capture_sizes
from quire.interfaces.attention import AttentionBatch
from quire.kernels import TritonAttentionBackend
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.platform import CpuPlatform


def test_the_ladder_is_vllms_and_ends_at_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    ladder = capture_sizes(256)
    assert ladder[:5] == (1, 2, 4, 8, 16) and ladder[-1] == 256 and len(ladder) == 35
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def _decode_batch(lens: list[int], width: int, max_seq_len: int | None = None,
                  seed: int = 0) -> AttentionBatch:
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    return AttentionBatch(
        slot_mapping=torch.randint(0, 64, (b,), generator=g),
        query_start_loc=torch.arange(b + 1), seq_lens=torch.tensor(lens),
        block_tables=torch.randint(0, 16, (b, width), generator=g, dtype=torch.int32),
        block_size=4, max_query_len=1, max_seq_len=max_seq_len or max(lens),
        query_lens=(1,) * b)


def test_triton_metadata_is_refilled_in_place():
    backend = TritonAttentionBackend()
    captured = _decode_batch([1, 1, 1], width=8, max_seq_len=32)
    meta = backend.build_metadata(captured)
    addresses = [t.data_ptr() for t in (meta.slot_mapping, meta.query_start_loc,
                                        meta.seq_lens, meta.block_tables, meta.decode_seqs)]
    step = _decode_batch([5, 9, 17], width=8, seed=1)
    assert backend.update_metadata(meta, step)
    fresh = backend.build_metadata(step)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "decode_seqs", "qblock_seq", "qblock_idx"):
        assert torch.equal(getattr(meta, name), getattr(fresh, name)), name
    assert addresses == [t.data_ptr() for t in (meta.slot_mapping, meta.query_start_loc,
                                                meta.seq_lens, meta.block_tables,
                                                meta.decode_seqs)]
    assert meta.max_seq_len == 32  # the capture's: its decode split stays


@pytest.mark.parametrize("step", [
    _decode_batch([5, 9], width=8),  # fewer sequences
    _decode_batch([5, 9, 40], width=8, max_seq_len=40),  # longer than the capture's
    _decode_batch([5, 9, 17], width=4),  # narrower tables
    AttentionBatch(slot_mapping=torch.arange(4), query_start_loc=torch.tensor([0, 2, 3, 4]),
                   seq_lens=torch.tensor([5, 9, 17]),
                   block_tables=torch.zeros(3, 8, dtype=torch.int32), block_size=4,
                   max_query_len=2, max_seq_len=17, query_lens=(2, 1, 1)),  # a prefill
])
def test_triton_metadata_refill_refuses_another_shape(step):
    backend = TritonAttentionBackend()
    meta = backend.build_metadata(_decode_batch([1, 1, 1], width=8, max_seq_len=32))
    before = meta.seq_lens.clone()
    assert not backend.update_metadata(meta, step)
    assert torch.equal(meta.seq_lens, before)


def test_a_backend_that_cannot_refill_is_named_at_capture():
    backend = ReferenceAttentionBackend()
    assert not backend.update_metadata(object(), _decode_batch([3], width=2))
    graphs = DecodeGraphs(object(), (1, 2), block_size=4, max_seq_len=16,  # type: ignore[arg-type]
                          device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="'cpu-reference' attention backend cannot refill"):
        graphs.capture_all(torch.nn.Identity(), backend, [], None)  # type: ignore[arg-type]


def test_platforms_without_graphs_run_eagerly_and_cuda_rocm_create_theirs_lazily():
    assert CpuPlatform().graph_capture() is None
    quire_cuda = pytest.importorskip("quire_cuda.platform")
    quire_rocm = pytest.importorskip("quire_rocm.platform")
    # made without a device: the pool is made at the first capture
    assert type(quire_cuda.CudaPlatform().graph_capture(0)).__name__ == "TorchGraphCapture"
    assert type(quire_rocm.RocmPlatform().graph_capture(0)).__name__ == "TorchGraphCapture"


def test_enforce_eager_is_a_bare_flag_like_vllms():
    parser = build_parser()
    assert parse_args(parser, ["generate", "--enforce-eager", "-p", "x"]).enforce_eager is True
    assert parse_args(parser, ["generate", "--enforce-eager", "false"]).enforce_eager is False
    assert parse_args(parser, ["generate"]).enforce_eager is False
    # a positional model after the bare flag stays the model (vLLM's usual order)
    served = parse_args(parser, ["serve", "--enforce-eager", "gemma3-270m"])
    assert served.enforce_eager is True and served.model_tag == "gemma3-270m"
    served = parse_args(parser, ["serve", "--enforce-eager", "off", "gemma3-270m"])
    assert served.enforce_eager is False and served.model_tag == "gemma3-270m"
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(model="m", enforce_eager="yes")  # type: ignore[arg-type]


class _FakeCuda:
    """The slice of ``torch.cuda`` the recorders call, logging each call."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.replays = 0

    def _context(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def ctx(*args, **kwargs):
            self.log.append(f"enter {name} {kwargs.get('pool', '')}".strip())
            yield
            self.log.append(f"exit {name}")
        return ctx

    def __getattr__(self, name: str):
        if name in ("device", "stream", "graph"):
            return self._context(name)
        fake = self

        class Stream:
            def wait_stream(self, other) -> None:
                fake.log.append("wait_stream")

        class CUDAGraph:
            def replay(self) -> None:
                fake.replays += 1

        return {"graph_pool_handle": lambda: "pool-1", "Stream": Stream,
                "current_stream": Stream, "CUDAGraph": CUDAGraph,
                "synchronize": lambda *a: self.log.append("synchronize")}[name]


def test_the_torch_recorder_warms_up_on_a_side_stream_and_shares_one_pool(monkeypatch):
    from quire.kernels import torch_graphs as graphs

    cuda = _FakeCuda()
    monkeypatch.setattr(graphs.torch, "cuda", cuda)
    recorder = graphs.TorchGraphCapture(0)
    runs: list[torch.Tensor] = []

    def fn() -> torch.Tensor:
        runs.append(torch.full((2,), float(len(runs))))
        return runs[-1]

    replay_a = recorder.capture(fn)
    replay_b = recorder.capture(fn)
    assert len(runs) == 4  # a warm-up and the capture, each time
    assert cuda.log.count("enter graph pool-1") == 2  # one pool for every graph
    first = cuda.log.index("enter stream")
    assert first < cuda.log.index("enter graph pool-1")  # the warm-up comes first
    assert replay_a() is runs[1] and replay_b() is runs[3] and cuda.replays == 2
