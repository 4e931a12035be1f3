"""A lone sequence's step through all the decoder layers in one C call
(``quire.platforms.cpu.fused_stack``): the same tokens and logprobs as the layers run
one call each, bit for bit (the same C per layer, the residual stream carried in each
thread's copy instead of a tensor), on Llama's one rotary table and on Gemma 3's two
(sliding layers with their own rope and window, a full one); transformers on the same
Gemma file as the oracle; and the layers taking over when one layer's kernel is gone.

Decode batches on quantised weights with bfloat16 products (``activations=bfloat16``)
through the layers in one call too (``quire_rows_stack_f32``): bit for bit what the
layers give one call each, on both families, over bfloat16 and int8 pages, each
product on the kernel its own call would take (the bfloat16 one, or the blocks' direct
path for a few rows); declined past the direct path's rows with float32 products, and
for int8 decode rows.
"""

from __future__ import annotations

import pytest
import torch
from quire import LLM, SamplingParams
from tiny_gguf import write_tiny_gemma3_gguf
from tiny_models import hf_model

PROMPT = [1, 17, 45, 99, 23, 7, 31, 12, 5, 88, 64, 3]  # longer than Gemma's window of 8


@pytest.fixture(scope="module")
def llama_gguf(random_gguf):
    return random_gguf("--preset", "tiny", "--seed", "11")


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    write_tiny_gemma3_gguf(path, seed=3)
    return path


def _generate(path, monkeypatch, stack: bool, prompts=(PROMPT,), max_tokens: int = 12,
              before=None, **options):
    """Tokens and logprobs of greedy runs, and how many steps the stack took; with
    ``stack`` false the platform installs none. ``before(model)`` runs before generating."""
    from quire.platforms.cpu import platform
    from quire.platforms.cpu.fused_stack import FusedDecodeStack

    taken: list[bool] = []
    original = FusedDecodeStack.__call__

    def counting(self, start, end, hidden, *args):
        done = original(self, start, end, hidden, *args)
        taken.append(done is not None)
        return done

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=1)
    with monkeypatch.context() as patch:
        patch.setattr(FusedDecodeStack, "__call__", counting)
        if not stack:
            patch.setattr(platform, "install_fused_stack", lambda model, native: 0)
        with LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=16 << 20,
                 **options) as llm:
            model = llm.engine.core.executor.worker.model
            if before is not None:
                before(model)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    runs = [(o.outputs[0].token_ids,
             [step[t].logprob for step, t in zip(o.outputs[0].logprobs,
                                                 o.outputs[0].token_ids)]) for o in outs]
    return runs, taken


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_llama_stack_equals_the_layers_one_call_each(llama_gguf, monkeypatch, kv_cache_dtype):
    stacked, taken = _generate(llama_gguf, monkeypatch, True, kv_cache_dtype=kv_cache_dtype)
    # every decode step (the prompt's step is no lone decode step: it declines)
    assert taken.count(True) == 11 and taken.count(False) == 1
    layered, untouched = _generate(llama_gguf, monkeypatch, False,
                                   kv_cache_dtype=kv_cache_dtype)
    assert untouched == []
    assert stacked == layered


def test_gemma3_stack_matches_transformers_and_the_layers(gemma3_gguf, monkeypatch,
                                                          tiny_checkpoint):
    """Six layers, five sliding (window 8, local rope) and one full (global rope): each
    layer's own rotary rows and window; the same logprobs as transformers reading the
    file (within 1e-4, float32 rounding) and as the layers one call each (exactly)."""
    tokenizer = str(tiny_checkpoint("gemma3"))  # the file has no vocabulary
    stacked, taken = _generate(gemma3_gguf, monkeypatch, True, max_tokens=16,
                               tokenizer=tokenizer)
    assert taken.count(True) == 15
    layered, _ = _generate(gemma3_gguf, monkeypatch, False, max_tokens=16,
                           tokenizer=tokenizer)
    assert stacked == layered
    reference = hf_model(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    tokens, logprobs = stacked[0]
    with torch.inference_mode():
        ids = torch.tensor([PROMPT + tokens])
        logits = reference(ids).logits[0, len(PROMPT) - 1:-1].float()
    theirs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == pytest.approx(theirs.tolist(), abs=1e-4)


def _threads_generate(threads: int, *args, **kwargs):
    """_generate with the kernels' team (torch's OpenMP pool) at `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _generate(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def _llama_reference(path):
    """transformers on the tiny Llama file with the llama3 rope its ``rope_freqs.weight``
    holds: transformers' GGUF loader drops that tensor and runs the default rope, which
    differs from the file's (and from llama.cpp's and Quire's) more the later a
    position. The scaling is the preset's in scripts/make_gguf_model.py."""
    import importlib.util
    import sys
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_gguf_model.py"
    spec = importlib.util.spec_from_file_location("make_gguf_model", script)
    maker = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = maker  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(maker)
    finally:
        del sys.modules[spec.name]
    rope = maker.PRESETS["tiny"].rope_scaling
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.rope_parameters = {
        "rope_type": "llama3", "rope_theta": config.rope_parameters["rope_theta"],
        "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_context_length}
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32,
        attn_implementation="eager").eval()


def test_a_long_context_splits_over_the_team(llama_gguf, monkeypatch):
    """A lone sequence of 600 positions and more: on two threads each layer's attention
    is cut into parts over the team (csrc/paged_decode.c's attend_parts_team, 4 parts
    of about 150 positions) and combined; on one, the row is one item. The same tokens
    and logprobs within 1e-5 (float32 sums in another order), and transformers' on the
    same file with its llama3 rope (:func:`_llama_reference`) within 1e-5 too."""
    prompt = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(5))
    runs = {}
    for threads in (1, 2):
        runs[threads], taken = _threads_generate(threads, llama_gguf, monkeypatch, True,
                                                 prompts=(prompt.tolist(),), max_tokens=6)
        assert taken.count(True) == 5
    (tokens, logprobs), (single, single_logprobs) = runs[2][0], runs[1][0]
    assert tokens == single
    assert logprobs == pytest.approx(single_logprobs, abs=1e-5)
    reference = _llama_reference(llama_gguf)
    with torch.inference_mode():
        ids = torch.tensor([prompt.tolist() + tokens])
        logits = reference(ids).logits[0, len(prompt) - 1:-1].float()
    theirs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == pytest.approx(theirs.tolist(), abs=1e-5)


def test_a_layer_without_its_kernel_sends_the_step_back_to_the_layers(llama_gguf,
                                                                      monkeypatch):
    """LoRA takes the whole-layer kernels away (its hooks sit on the products): a range
    holding such a layer declines, and the layers give the same result one by one."""
    def drop_one(model):
        model.model.layers[2].kernel = None

    dropped, taken = _generate(llama_gguf, monkeypatch, True, before=drop_one)
    assert taken and not any(taken)
    layered, _ = _generate(llama_gguf, monkeypatch, False)
    assert dropped[0][0] == layered[0][0]
    assert dropped[0][1] == pytest.approx(layered[0][1], abs=1e-4)


def test_two_sequences_are_no_lone_sequence(llama_gguf, monkeypatch):
    """Two sequences decoding together are no lone sequence: the batch call takes their
    decode steps (float32 products on the blocks' direct path), with the layers'
    results."""
    prompts = (PROMPT, PROMPT[:7])
    stacked, taken = _generate(llama_gguf, monkeypatch, True, prompts=prompts, max_tokens=4)
    assert taken == [False, True, True, True]
    layered, _ = _generate(llama_gguf, monkeypatch, False, prompts=prompts, max_tokens=4)
    assert stacked == layered


def _bf16_products():
    from quire.platforms.cpu.native import load_native_kernels

    native = load_native_kernels()
    if native is None or not native.has_quant_bf16:
        pytest.skip("no bfloat16 products on quantised weights (AVX512_BF16) on this host")


BATCH = tuple([1, 17 + i, 45, 99, 23 + 2 * i, 7, 31, 12, 5 + i][: 5 + i] for i in range(6))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("activations,prompts", [("bfloat16", BATCH), ("bfloat16", BATCH[:3]),
                                                 ("dtype", BATCH)])
def test_llama_decode_batches_equal_the_layers(llama_gguf, monkeypatch, kv_cache_dtype,
                                               activations, prompts):
    """Sequences of different lengths decoding together, every decode step in one call,
    the same tokens and logprobs as the layers one call each, bit for bit (the same
    kernels on the same rows): six rows on the bfloat16 kernel; three rows (fewer than
    that kernel's smallest batch) and six with float32 products on the blocks' direct
    path."""
    if activations == "bfloat16":
        _bf16_products()
    options = {"prompts": prompts, "max_tokens": 8, "kv_cache_dtype": kv_cache_dtype,
               "platform_options": {"activations": activations}}
    stacked, taken = _generate(llama_gguf, monkeypatch, True, **options)
    assert taken.count(True) == 7 and taken.count(False) == 1  # the prompts' step declines
    layered, untouched = _generate(llama_gguf, monkeypatch, False, **options)
    assert untouched == []
    assert stacked == layered


def test_gemma3_decode_batches_equal_the_layers(gemma3_gguf, monkeypatch, tiny_checkpoint):
    """Gemma 3's sandwich norms, q/k norms, GELU and sliding layers (their own rotary
    rows and window of 8, which the longer sequences pass) in the batch call: bit for
    bit the layers one call each."""
    _bf16_products()
    options = {"prompts": BATCH, "max_tokens": 12, "tokenizer": str(tiny_checkpoint("gemma3")),
               "platform_options": {"activations": "bfloat16"}}
    stacked, taken = _generate(gemma3_gguf, monkeypatch, True, **options)
    assert taken.count(True) == 11
    layered, _ = _generate(gemma3_gguf, monkeypatch, False, **options)
    assert stacked == layered


def test_a_batch_whose_products_take_both_kernels_takes_the_call(random_gguf, monkeypatch):
    """Six rows where the down product's long rows (1,024 columns) keep the direct path
    and the other products take the bfloat16 kernel, as SmolLM2's batches of five to
    eight sequences do: the batch call runs each product on its own kernel, bit for bit
    the layers one call each."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer
    from quire.platforms.cpu.quant_linear import bf16_min_rows

    _bf16_products()
    assert bf16_min_rows(256) < len(BATCH) <= bf16_min_rows(1024)
    path = random_gguf("--preset", "tiny", "--seed", "11", "--ffn-size", "1024")
    kinds: list[int | None] = []
    original = FusedDecodeLayer.batch_kernel

    def recording(self, rows, ctx):
        kind = original(self, rows, ctx)
        kinds.append(kind)
        return kind

    monkeypatch.setattr(FusedDecodeLayer, "batch_kernel", recording)
    options = {"prompts": BATCH, "max_tokens": 6,
               "platform_options": {"activations": "bfloat16"}}
    stacked, taken = _generate(path, monkeypatch, True, **options)
    assert taken.count(True) == 5  # every decode step; the prompts' step declines
    assert set(kinds) == {None, 1 | 2 | 4}  # None: the prompts' step
    layered, _ = _generate(path, monkeypatch, False, **options)
    assert stacked == layered


TEN = tuple([1, 17 + i, 45, 99, 23, 7 + i, 5] for i in range(10))


@pytest.mark.parametrize("prompts,options", [
    (TEN, {"platform_options": {"activations": "dtype"}}),
    (BATCH[:3], {"platform_options": {"activations": "dtype", "decode_activations": "int8"}}),
])
def test_decode_batches_the_call_does_not_take(llama_gguf, monkeypatch, prompts, options):
    """Ten rows of float32 products (past the blocks' direct path, where the products
    take panels) and int8 decode rows are not the batch call's: the layers take those
    steps, one call each, and give what they give without the stack."""
    stacked, taken = _generate(llama_gguf, monkeypatch, True, prompts=prompts, max_tokens=4,
                               **options)
    assert taken and not any(taken)
    layered, _ = _generate(llama_gguf, monkeypatch, False, prompts=prompts, max_tokens=4,
                           **options)
    assert stacked == layered
