"""A GGUF model's blocks on the cpu platform's C kernels: every decoder layer runs whole
in C for a lone sequence's decode steps (the fused layer reading the blocks), other
steps run the C pieces between the products on the blocks, and both give what the
torch reference gives (``native=false``: the reference ``quantized_linear`` and torch
attention)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from greedy_runs import assert_greedy_close
from quire import LLM, SamplingParams

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33, 9, 41, 5, 77, 12]]


@pytest.fixture(scope="module")
def q4_k_m(random_gguf) -> Path:
    return random_gguf("--preset", "tiny", "--seed", "7")


def _run(path: Path, prompts, *, top: int = 1, **options):
    """Float32 unless ``options`` say otherwise: the tolerances below are float32's (an
    explicit dtype also keeps float32 products where ``activations=auto`` would take
    bfloat16 ones for ``dtype=auto``). Each sequence's tokens and their logprobs, and with
    ``top`` above 1 also each step's ``{token: logprob}`` of its ``top`` likeliest."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=top)
    options.setdefault("dtype", "float32")
    with LLM(str(path), device="cpu", kv_cache_memory=16 << 20, **options) as llm:
        outs = llm.generate(prompts, params)
    runs = []
    for o in outs:
        tokens, steps = o.outputs[0].token_ids, o.outputs[0].logprobs
        chosen = [step[t].logprob for step, t in zip(steps, tokens)]
        runs.append((tokens, chosen) if top == 1 else
                    (tokens, chosen, [{t: lp.logprob for t, lp in step.items()}
                                      for step in steps]))
    return runs


def _run_counting_rows_steps(monkeypatch, path: Path, prompts, **options):
    """:func:`_run`, and the rows of every step a layer ran as the C pieces between its
    products (``FusedDecodeLayer._rows_step``), the model's one-call stack off (it takes
    a float32 model's decode batches whole: tests/unit/test_cpu_fused_stack.py holds it
    to this path's results, bit for bit)."""
    from quire.platforms.cpu import platform
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer

    calls: list[int] = []
    original = FusedDecodeLayer._rows_step

    def counting(self, hidden, *args):
        calls.append(hidden.shape[0])
        return original(self, hidden, *args)

    with monkeypatch.context() as patch:
        patch.setattr(FusedDecodeLayer, "_rows_step", counting)
        patch.setattr(platform, "install_fused_stack", lambda model, native: 0)
        return _run(path, prompts, **options), calls


def _counting_whole_layers(patch, taken: list[bool]) -> None:
    """Record in ``taken`` whether each step a lone sequence could run whole in C did:
    through all its layers at once (``FusedDecodeStack``) or a layer at a time
    (``FusedDecodeLayer._decode``)."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer
    from quire.platforms.cpu.fused_stack import FusedDecodeStack

    layer, stack = FusedDecodeLayer._decode, FusedDecodeStack.__call__

    def counting_layer(self, hidden, *args):
        done = layer(self, hidden, *args)
        taken.append(done is not None)
        return done

    def counting_stack(self, start, end, hidden, *args):
        done = stack(self, start, end, hidden, *args)
        if done is not None:
            taken.append(True)
        return done

    patch.setattr(FusedDecodeLayer, "_decode", counting_layer)
    patch.setattr(FusedDecodeStack, "__call__", counting_stack)


@pytest.mark.parametrize("batched", [False, True])
def test_c_kernels_give_the_reference_tokens_and_logprobs(q4_k_m, batched, caplog):
    prompts = PROMPTS if batched else PROMPTS[:1]
    with caplog.at_level(logging.INFO, logger="quire.platforms.cpu.fused_decode"):
        native = _run(q4_k_m, prompts)
    assert "4 decoder layers run in C" in caplog.text
    reference = _run(q4_k_m, prompts, platform_options={"native": "false"})
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(native, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_int8_decode_activations_stay_close_to_float32(q4_k_m):
    """``decode_activations=int8`` (llama.cpp's Q8 activations for decode rows, and the
    LM head's one row): the logprobs stay within 0.05 of float32's on this model
    (measured: within 0.02) while the tokens agree."""
    float32 = _run(q4_k_m, PROMPTS[:1])
    int8 = _run(q4_k_m, PROMPTS[:1], platform_options={"decode_activations": "int8"})
    (tokens, logprobs), (ref_tokens, ref_logprobs) = int8[0], float32[0]
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                 len(tokens))
    assert agree >= 3
    assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.05)
    assert logprobs[:agree] != pytest.approx(ref_logprobs[:agree], abs=1e-6)  # int8 ran


def test_bfloat16_decode_rows_take_their_formats_on_every_path(q4_k_m, monkeypatch):
    """``decode_activations=bfloat16`` (what ``auto`` takes where a layer's batches take
    bfloat16 products): the fused layers give their parts bfloat16 rows where the kernel
    takes the format (the K-quants of this file) and float32 ones elsewhere, as the
    platform's op does part by part. A lone sequence (whole C layers) and the same
    prompt twice in a batch (the C steps between the products, the op on the blocks)
    round the same rows: their logprobs agree within float32's noise (1e-4), while
    float32 rows' differ from them by more than that and stay within 0.05 where the
    tokens agree."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer
    from quire.platforms.cpu.native import QPartArgs, load_native_kernels
    from quire.quantization.formats import FORMATS

    native = load_native_kernels()
    if native is None or not native.has_quant_bf16:
        pytest.skip("no bfloat16 products (AVX512_BF16) on this host")
    options = {"platform_options": {"decode_activations": "bfloat16"}}
    acts: dict[int, set[int]] = {}  # format id: the parts' activations
    original = FusedDecodeLayer.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for args_ in self._compact_args:
            for part in getattr(args_, "_parts", ()):
                acts.setdefault(part.fmt, set()).add(part.acts)

    # a prompt of more than 8 tokens, alone or twice, takes float32 panels either way
    prompt = [[1, 17, 45, 99, 23, 7, 200, 33, 9, 41]]
    with monkeypatch.context() as patch:
        patch.setattr(FusedDecodeLayer, "__init__", recording)
        lone = _run(q4_k_m, prompt, **options)
    q4_k, q6_k = FORMATS["q4_k"].id, FORMATS["q6_k"].id
    assert acts[q4_k] == {QPartArgs.BF16} and acts[q6_k] == {QPartArgs.BF16}
    for fmt, taken in acts.items():
        fits = native._quant_rows_bf16_fits(fmt, 256)
        assert taken == {QPartArgs.BF16 if fits else QPartArgs.F32}
    pair, calls = _run_counting_rows_steps(monkeypatch, q4_k_m, prompt * 2, **options)
    assert 2 in calls  # the batch's decode steps took the op between the C steps
    float32 = _run(q4_k_m, prompt, platform_options={"decode_activations": "float32"})
    (tokens, logprobs), (f_tokens, f_logprobs) = lone[0], float32[0]
    for batched in pair:
        assert batched[0] == tokens
        assert batched[1] == pytest.approx(logprobs, abs=1e-4)
    agree = next((i for i, (a, b) in enumerate(zip(tokens, f_tokens)) if a != b),
                 len(tokens))
    assert agree >= 3
    assert logprobs[:agree] == pytest.approx(f_logprobs[:agree], abs=0.05)
    assert logprobs[:agree] != pytest.approx(f_logprobs[:agree], abs=1e-4)  # rounded


def test_a_bfloat16_model_s_batches_run_between_the_products_in_c(q4_k_m, monkeypatch):
    """``--dtype bfloat16`` on the blocks: a batch of 6 decode rows runs the C steps
    between the products (``_rows_step``), the products on the blocks. Against the torch
    reference in bfloat16 (the op-by-op path, float32 weights): the same first tokens,
    logprobs within bfloat16's noise (0.1; measured within 0.01)."""
    prompts = [[1, 17 + i, 45, 99, 23, 7 + i] for i in range(6)]
    native, calls = _run_counting_rows_steps(monkeypatch, q4_k_m, prompts, dtype="bfloat16")
    assert 6 in calls  # the decode batches took the C steps
    reference = _run(q4_k_m, prompts, dtype="bfloat16", platform_options={"native": "false"})
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(native, reference):
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                     len(tokens))
        assert agree >= 2
        assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.1)


def test_a_step_s_mlp_runs_a_block_of_rows_at_a_time(q4_k_m, monkeypatch):
    """The MLP of a step through the C pieces (``_rows_step``) takes
    ``MLP_BLOCK_ROWS`` rows at a time (here 3, so that a prompt step of 14 rows runs
    blocks of 3 and a last one of 2, and decode batches of 2 one block; the one-call
    stack, which would take those batches, off): the reference's tokens, logprobs within
    float32 rounding."""
    from quire.platforms.cpu import fused_decode, platform

    blocks: list[int] = []
    original = fused_decode.FusedDecodeLayer._mlp_rows

    def counting(self, normed, *args):
        blocks.append(normed.shape[0])
        return original(self, normed, *args)

    with monkeypatch.context() as patch:
        patch.setattr(fused_decode, "MLP_BLOCK_ROWS", 3)
        patch.setattr(fused_decode.FusedDecodeLayer, "_mlp_rows", counting)
        patch.setattr(platform, "install_fused_stack", lambda model, native: 0)
        native = _run(q4_k_m, PROMPTS)
    assert 14 in blocks and 2 in blocks
    reference = _run(q4_k_m, PROMPTS, platform_options={"native": "false"})
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(native, reference):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_a_float32_model_s_batches_run_between_the_products_in_c(q4_k_m, kv_cache_dtype,
                                                                 monkeypatch):
    """A float32 model on the blocks (no float32 panels: they would be a float copy of
    the weights): prompt steps and batches of 6 decode rows run the C steps between the
    products (``_rows_step``: norms, rotary, the decode rows' KV writes and attention,
    the activation), the products on the blocks. Against the torch reference
    (``native=false``): the same tokens, logprobs to float32 rounding (1e-4; measured
    1e-6) with float32 pages. With bfloat16 pages a key or value the two paths compute a
    float32 ulp apart can round to neighbouring bfloat16 values, so 1e-3 (measured
    1.3e-4; 6.7e-5 with the prompts' attention on the torch path over the pages too).
    Tokens may differ only from a near-tie within the tolerance on."""
    prompts = [[1, 17 + i, 45, 99, 23, 7 + i] for i in range(6)]
    native, calls = _run_counting_rows_steps(monkeypatch, q4_k_m, prompts, top=2,
                                             kv_cache_dtype=kv_cache_dtype)
    assert 6 in calls and 36 in calls  # decode batches and the prompts' step took it
    reference = _run(q4_k_m, prompts, top=2, kv_cache_dtype=kv_cache_dtype,
                     platform_options={"native": "false"})
    # the texts may part only at a near-tie within the tolerance
    assert_greedy_close(native, reference, 1e-4 if kv_cache_dtype == "auto" else 1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantised_pages_are_written_and_read_in_c(q4_k_m, kv_cache_dtype, monkeypatch):
    """int8 and fp8 pages (a scale per token and KV head): a batch of decode rows
    quantises its keys and values into the pages and attends over them in C (the
    model's one-call stack, or a layer's ``_decode_attention_rows`` where the stack
    declines), a lone sequence runs its whole layer in C (``_decode``),
    and prompts are written by the backend's C writer. Against the torch reference over
    the same kind of pages: the same tokens; logprobs within 5e-3 (measured 1.05e-3 with
    int8, 2.6e-4 with fp8: a key the two paths compute a float32 ulp apart can land on
    the neighbouring quantisation step, 1/127 of its group's largest value for int8).
    So a near-tie may go either way: on a Zen 4 host the random model's second int8 step
    has its two likeliest tokens 3e-4 apart and the paths pick one each; the texts may
    part only at such a step (``greedy_runs.assert_greedy_close``)."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer
    from quire.platforms.cpu.fused_stack import FusedDecodeStack
    from quire.platforms.cpu.native import NativeKernels

    taken: dict[str, list[bool]] = {"rows": [], "whole": [], "written": [], "batch": []}
    rows_attention = FusedDecodeLayer._decode_attention_rows
    batch_call = FusedDecodeStack._batch

    def counting_batches(self, *args):
        done = batch_call(self, *args)
        if done is not None:
            taken["batch"].append(True)
        return done
    write = NativeKernels.write_kv_quant

    def counting_writes(self, *args):
        done = write(self, *args)
        taken["written"].append(done)
        return done

    def counting_rows(self, rows, ctx):
        done = rows_attention(self, rows, ctx)
        taken["rows"].append(done is not None)
        return done

    prompts = [[1, 17 + i, 45, 99, 23, 7 + i] for i in range(6)]
    with monkeypatch.context() as patch:
        patch.setattr(FusedDecodeLayer, "_decode_attention_rows", counting_rows)
        patch.setattr(FusedDecodeStack, "_batch", counting_batches)
        _counting_whole_layers(patch, taken["whole"])
        patch.setattr(NativeKernels, "write_kv_quant", counting_writes)
        batch = _run(q4_k_m, prompts, top=2, kv_cache_dtype=kv_cache_dtype)
        lone = _run(q4_k_m, prompts[:1], top=2, kv_cache_dtype=kv_cache_dtype)
    # every decode batch's attention in C, in the stack's call or the layers'
    assert (taken["rows"] or taken["batch"]) and all(taken["rows"])
    assert taken["whole"] and any(taken["whole"])  # the lone sequence's steps
    assert taken["written"] and all(taken["written"])  # the prompts' pages, in C
    reference = _run(q4_k_m, prompts, top=2, kv_cache_dtype=kv_cache_dtype,
                     platform_options={"native": "false"})
    assert_greedy_close(batch + lone, reference + reference[:1], 5e-3)


def test_a_lone_float32_sequence_over_bfloat16_pages_runs_the_whole_c_layer(
        q4_k_m, monkeypatch):
    """A float32 model with bfloat16 pages (``kv_cache_dtype=bfloat16``, the default where
    its products take bfloat16 activations): a lone sequence's decode steps still run
    whole in C on the blocks (all the layers in one call), the pages written rounded and
    read widened. Against the torch reference: the same tokens, logprobs within 1e-3 (a
    key computed a float32 ulp apart can round to a neighbouring bfloat16 value), up to
    a near-tie within that (``greedy_runs.assert_greedy_close``)."""
    whole: list[bool] = []
    with monkeypatch.context() as patch:
        _counting_whole_layers(patch, whole)
        native = _run(q4_k_m, PROMPTS[:1], top=2, kv_cache_dtype="bfloat16")
    assert whole and all(whole)  # every decode step, whole in C
    reference = _run(q4_k_m, PROMPTS[:1], top=2, kv_cache_dtype="bfloat16",
                     platform_options={"native": "false"})
    assert_greedy_close(native, reference, 1e-3)  # parting only at a near-tie


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_verification_step_runs_the_one_sequence_layer_on_the_blocks(q4_k_m, dtype,
                                                                       monkeypatch):
    """Speculative decoding's verification steps (the last token and its drafts of one
    sequence) run the whole layer in C on the blocks (``quire_decode_rows_f32``), and
    give the torch reference's tokens, with logprobs within float32 rounding (bfloat16:
    within its noise, 0.1)."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer

    rows: list[int] = []
    original = FusedDecodeLayer._last_rows

    def counting(self, n, ctx):
        fits = original(self, n, ctx)
        if fits:
            rows.append(n)
        return fits

    monkeypatch.setattr(FusedDecodeLayer, "_last_rows", counting)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    prompt = [[1, 17, 45, 99, 23, 7, 17, 45, 99, 23, 7, 17, 45]]
    native = _run(q4_k_m, prompt, dtype=dtype, speculative_config=spec)
    assert rows and max(rows) > 1  # verification steps took the C layer
    monkeypatch.setattr(FusedDecodeLayer, "_last_rows", original)
    reference = _run(q4_k_m, prompt, dtype=dtype, speculative_config=spec,
                     platform_options={"native": "false"})
    (tokens, logprobs), (ref_tokens, ref_logprobs) = native[0], reference[0]
    if dtype == "float32":
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    else:
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                     len(tokens))
        assert agree >= 2
        assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.1)
