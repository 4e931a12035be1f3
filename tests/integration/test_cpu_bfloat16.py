"""bfloat16 on the cpu platform, end to end: weights and KV pages in bfloat16, products on
oneDNN's bfloat16 path, decode attention reading bfloat16 pages in C.

Oracles and tolerances:

- transformers at bfloat16 (eager attention) on the same checkpoint: every logprob the
  engine reports (prompt and generated tokens) within ``LOGPROB_TOL`` = 0.08 of
  transformers'. Both round to bfloat16 after every product but not at the same
  points (our attention sums in float32 from the bfloat16 pages), and bfloat16 keeps 8
  bits of mantissa: the worst gap seen was 0.040.
- float32: the most likely next token, teacher-forced over a fixed text, the same at
  bfloat16 for at least ``TOP1_AGREEMENT`` = 90% of positions (125 of 127 in the run
  seen; a position whose two best tokens are within bfloat16's rounding may flip); and
  so are greedy decode batches' tokens, through the C pieces between the products and
  op by op.
- ``dtype="auto"``: bfloat16 for a bfloat16 checkpoint exactly when this CPU has
  bfloat16 products (the decision itself is tested on made-up CPUs in
  tests/unit/test_cpu_platform.py).
"""

from __future__ import annotations

import pytest
import torch
from quire import LLM, SamplingParams
from quire.platforms.cpu.isa import detect, has_bf16_products
from quire.platforms.cpu.packed_linear import onednn_available
from transformers import AutoModelForCausalLM, AutoTokenizer

LOGPROB_TOL = 0.08
TOP1_AGREEMENT = 0.9
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the "
        "steps aloud, and at the top he lit the lamp that guided the fishing boats home "
        "through the fog of the northern sea.")


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama saved in bfloat16 (its config says so)."""
    source = tiny_checkpoint("llama")
    target = tmp_path_factory.mktemp("tiny-llama-bf16")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def _rank1(entry) -> int:
    return next(tid for tid, lp in entry.items() if lp.rank == 1)


def test_bfloat16_logprobs_agree_with_transformers_bfloat16(bf16_checkpoint) -> None:
    llm = LLM(str(bf16_checkpoint), device="cpu", dtype="bfloat16", block_size=4)
    assert llm.engine.config.dtype == torch.bfloat16
    ids = llm.get_tokenizer().encode(TEXT)
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             logprobs=1, prompt_logprobs=1))
    gen = out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + gen])).logits[0].float(), -1)
    worst = 0.0
    for i, (token, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        # greedy took transformers' top token, or one within rounding of it
        assert float(row[token]) >= float(row.max()) - LOGPROB_TOL
        worst = max(worst, abs(entry[token].logprob - float(row[token])))
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        worst = max(worst, abs(entry[ids[p]].logprob - float(ref[p - 1, ids[p]])))
    assert worst < LOGPROB_TOL


def test_bfloat16_agrees_with_float32_on_the_top_token(bf16_checkpoint) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(bf16_checkpoint), device="cpu", dtype=dtype)
        ids = llm.get_tokenizer().encode(TEXT)
        [out] = llm.generate(ids, params)
        tops[dtype] = [_rank1(entry) for entry in out.prompt_logprobs[1:]]
        del llm
    same = sum(a == b for a, b in zip(tops["float32"], tops["bfloat16"]))
    assert len(tops["float32"]) > 30
    assert same / len(tops["float32"]) >= TOP1_AGREEMENT


def test_bfloat16_decode_batches_in_c_agree_with_float32_on_the_top_token(
        bf16_checkpoint) -> None:
    """Greedy decode batches of a bfloat16 model in C (fused_decode.py: each layer in one
    call on pair panels where the ISA level has them, else the C pieces between oneDNN's
    products) and op by op, each teacher-forced against float32: every generated token
    float32's most likely next token for ``TOP1_AGREEMENT`` of them (bfloat16 rounding
    may flip near ties; the two paths round at different points): 59 of 60 through the
    C pieces and 57 op by op in one run seen, 58 through the whole layer and 56 op by op
    in another."""
    llm = LLM(str(bf16_checkpoint), device="cpu", dtype="bfloat16", block_size=4)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.encode(TEXT)
    prompts = [text[:n] for n in (5, 9, 14, 20, 27, 33)]  # scattered lengths, one batch
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    layers = [layer.kernel for layer in llm.engine.core.executor.worker.model.model.layers]
    whole = layers[0].native.has_bf16_gemm
    assert layers and all(
        layer is not None and (layer._panels if whole else layer._products) is not None
        for layer in layers)
    attend = _count(layers, "decode_batch_bf16" if whole else "rows_attend")
    generated = {"c": [o.outputs[0].token_ids for o in llm.generate(prompts, params)]}
    assert attend.calls == 9 * len(layers)  # every decode step, every layer
    for layer in layers:
        layer._panels = layer._products = None  # the op-by-op path, same weights
    generated["op_by_op"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert attend.calls == 9 * len(layers)
    del llm
    reference = LLM(str(bf16_checkpoint), device="cpu", dtype="float32")
    for path, outputs in generated.items():
        agree = total = 0
        for prompt, gen in zip(prompts, outputs):
            [ref] = reference.generate(prompt + gen, SamplingParams(max_tokens=1,
                                                                    prompt_logprobs=1))
            for i, token in enumerate(gen):
                agree += _rank1(ref.prompt_logprobs[len(prompt) + i]) == token
                total += 1
        assert agree / total >= TOP1_AGREEMENT, (path, agree, total)


class _Counted:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


class _Native:
    def __init__(self, kernels, name: str, counted: _Counted) -> None:
        self._kernels = kernels
        setattr(self, name, counted)

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def _count(layers, name: str) -> _Counted:
    """One counter of entry point ``name``'s calls over every layer's kernels."""
    counted = _Counted(getattr(layers[0].native, name))
    for layer in layers:
        layer.native = _Native(layer.native, name, counted)
    return counted


def test_auto_picks_bfloat16_for_a_bfloat16_checkpoint_on_a_cpu_with_bf16_products(
        bf16_checkpoint, tiny_checkpoint) -> None:
    fast = has_bf16_products(detect()) and onednn_available()
    llm = LLM(str(bf16_checkpoint), device="cpu")
    assert llm.engine.config.dtype == (torch.bfloat16 if fast else torch.float32)
    del llm
    # a float32 checkpoint stays float32 everywhere
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu")
    assert llm.engine.config.dtype == torch.float32
