"""The decoder models run their norms, gated activations and (where the backend names
the KV slots) rotary-with-KV-write through ``ctx.ops``: a platform's ops (the Triton
kernels on cuda/rocm) replace the reference in every layer, and the reference route
computes what it computed before, bit for bit."""

from __future__ import annotations

import pytest
import torch
from quire.interfaces.attention import AttentionBatch
from quire.models.context import ForwardContext
from quire.models.loader import load_model
from quire.ops import reference_ops
from quire.ops.attention import ReferenceAttentionBackend
from tiny_models import SingleRank

PROMPT = [5, 17, 42, 9, 77, 3, 101, 64, 8]
#: arch -> (rms_norm calls, activation op, its calls) for one step of the two-layer model:
#: Llama 2 per layer + the final norm; Qwen3 adds q and k norms; Gemma 3 six per layer.
CALLS = {"llama": (5, "silu_and_mul", 2), "qwen3": (9, "silu_and_mul", 2),
         "gemma3": (13, "gelu_tanh_and_mul", 2)}



def run_steps(model, steps, ops, backend=None):
    """One sequence fed ``steps`` chunk after chunk through paged KV; every logit."""
    backend, block = backend or ReferenceAttentionBackend(), 4
    caches = [backend.allocate_kv_cache(8, block, model.num_kv_heads, model.head_dim,
                                        torch.float32, torch.device("cpu"))
              for _ in range(model.num_layers)]
    table = torch.arange(8, dtype=torch.int32)[None]
    done, out = 0, []
    for chunk in steps:
        n, end = len(chunk), done + len(chunk)
        pos = torch.arange(done, end)
        batch = AttentionBatch(
            slot_mapping=pos.long(), query_start_loc=torch.tensor([0, n]),
            seq_lens=torch.tensor([end]), block_tables=table, block_size=block,
            max_query_len=n, max_seq_len=end, query_lens=(n,))
        ctx = ForwardContext(backend, backend.build_metadata(batch), caches, ops=ops)
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(chunk), pos, ctx)))
        done = end
    return torch.cat(out)


@pytest.mark.parametrize("arch", sorted(CALLS))
def test_every_norm_and_activation_goes_through_the_ops(arch, tiny_checkpoint):
    model, _ = load_model(str(tiny_checkpoint(arch)), SingleRank(), "cpu", torch.float32)
    ref = reference_ops()
    calls: list[str] = []

    def counted(name):
        def op(*args, **kwargs):
            calls.append(name)
            return getattr(ref, name)(*args, **kwargs)
        return op

    norms, act, acts = CALLS[arch]
    ops = ref.with_ops("counting", rms_norm=counted("rms_norm"), **{act: counted(act)})
    counted_logits = run_steps(model, [PROMPT], ops)
    assert calls.count("rms_norm") == norms and calls.count(act) == acts
    assert torch.equal(counted_logits, run_steps(model, [PROMPT], ref))


@pytest.mark.parametrize("arch", sorted(CALLS))
def test_the_triton_ops_in_a_model_match_the_reference(arch, tiny_checkpoint):
    """The cuda platform's op set, kernels in Triton's interpreter, through prefill and
    decode steps of a tiny model (float32, rtol = atol = 1e-4, as the conformance
    suite's attention)."""
    pytest.importorskip("triton")
    from quire_cuda.platform import CudaPlatform

    model, _ = load_model(str(tiny_checkpoint(arch)), SingleRank(), "cpu", torch.float32)
    steps = [PROMPT[:6], PROMPT[6:7], PROMPT[7:8]]
    got = run_steps(model, steps, CudaPlatform().make_ops())
    torch.testing.assert_close(got, run_steps(model, steps, reference_ops()),
                               rtol=1e-4, atol=1e-4)


class SlotNamingReference(ReferenceAttentionBackend):
    """The reference backend, letting the op set write K/V; counts its own writes."""

    def __init__(self):
        self.writes = 0

    def kv_slots(self, metadata):
        return metadata.slot_mapping

    def write_kv(self, key, value, kv_cache, metadata):
        self.writes += 1
        super().write_kv(key, value, kv_cache, metadata)


@pytest.mark.parametrize("arch", sorted(CALLS))
def test_where_the_backend_names_slots_the_op_writes_kv_and_the_backend_does_not(
        arch, tiny_checkpoint):
    """The reference rotary_write_kv is apply_rotary and the reference backend's write,
    so the logits are those of the usual route bit for bit; the backend writes nothing."""
    model, _ = load_model(str(tiny_checkpoint(arch)), SingleRank(), "cpu", torch.float32)
    ref = reference_ops()
    calls: list[str] = []

    def rotary_write_kv(*args):
        calls.append("rotary_write_kv")
        return ref.rotary_write_kv(*args)

    backend = SlotNamingReference()
    steps = [PROMPT[:6], PROMPT[6:7], PROMPT[7:]]
    ops = ref.with_ops("counting", rotary_write_kv=rotary_write_kv)
    got = run_steps(model, steps, ops, backend)
    assert backend.writes == 0 and len(calls) == 2 * len(steps)  # two layers per step
    assert torch.equal(got, run_steps(model, steps, ref))


@pytest.mark.parametrize("arch", sorted(CALLS))
def test_the_triton_backend_and_ops_in_a_model_match_the_reference(arch, tiny_checkpoint):
    """The cuda platform's backend and op set together (rotation and KV write in the
    fused kernel), in Triton's interpreter, through prefill and decode steps."""
    pytest.importorskip("triton")
    from quire.kernels import TritonAttentionBackend
    from quire_cuda.platform import CudaPlatform

    class Counting(TritonAttentionBackend):
        writes = 0

        def write_kv(self, *args):
            Counting.writes += 1
            super().write_kv(*args)

    model, _ = load_model(str(tiny_checkpoint(arch)), SingleRank(), "cpu", torch.float32)
    steps = [PROMPT[:6], PROMPT[6:7], PROMPT[7:8]]
    got = run_steps(model, steps, CudaPlatform().make_ops(), Counting())
    assert Counting.writes == 0
    torch.testing.assert_close(got, run_steps(model, steps, reference_ops()),
                               rtol=1e-4, atol=1e-4)
