"""Qwen2.5-VL end to end against transformers float32, given the same images: the tower's
embeddings and the M-RoPE positions equal, greedy tokens equal token for token, through
chunked prefill inside images, the prefix cache, preemption, ngram drafts and replayed
decode graphs."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from quire import LLM, SamplingParams
from quire.distributed import TorchDistributedCommunicator
from quire.engine.scheduler import ScheduledSeq
from quire.engine.sequence import Sequence
from quire.engine.step_items import step_item
from quire.models.loader import iter_weights, load_model_config
from quire.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, make_processor
from quire.multimodal.processor import ImageInputs
from quire.ops import reference_ops

from tests.tiny_qwen2_5_vl import PLACEHOLDER as P
from tests.tiny_qwen2_5_vl import build_qwen2_5_vl, hf_greedy, hf_qwen2_5_vl
from tests.tiny_vlm import image

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=1)
#: One page of 16 tokens: 2 layers, K and V, 2 heads of 16 float32s.
PAGE_BYTES = 2 * 2 * 2 * 16 * 16 * 4

#: (prompt, images): wide, tall and square images of several sizes (their grids have
#: partial windows), two images apart and adjacent, text after the images.
CASES = [
    (f"Describe {P} now please tell", [image(45, 30, 1)]),
    (f"A {P} and {P} two more words", [image(30, 50, 2), image(64, 17, 3)]),
    (f"{P}{P}", [image(30, 30, 4), image(13, 40, 5)]),
    (f"The capital of France is {P}", [image(97, 21, 6)]),
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny")


@pytest.fixture(scope="module")
def oracle(qwen):
    model, processor = hf_qwen2_5_vl(qwen), make_processor(str(qwen))
    refs = [hf_greedy(model, processor, text, images, N) for text, images in CASES]
    return model, processor, refs


def _prompts(cases=CASES):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def test_tower_and_positions_equal_transformers(qwen, oracle):
    """Each image's embeddings (windows, 2D rotary, merger) and every token's M-RoPE
    positions, whole and cut into chunks anywhere, as transformers computes them."""
    model, processor, _ = oracle
    config = load_model_config(str(qwen))
    ours = Qwen2_5_VLForConditionalGeneration(config, TorchDistributedCommunicator("gloo", 0, 1))
    ours.load_weights(iter_weights(str(qwen)))
    front = ImageInputs(str(qwen), config)
    for text, images in CASES:
        inputs = processor(text=text, images=images, return_tensors="pt")
        want = model.model.get_image_features(inputs["pixel_values"],
                                              inputs["image_grid_thw"]).pooler_output
        ids, items = front.process(text, images)
        assert ids == inputs["input_ids"][0].tolist()
        got = ours.embed_images([item.tensors() for item in items], reference_ops())
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        positions, delta = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
        n = len(ids)
        for cuts in ([0, n], sorted({0, 3, 7, 19, 20, n} & set(range(n + 1))),
                     list(range(n + 1))):
            got_pos = torch.cat([_positions(ids, items, a, b)
                                 for a, b in pairwise(cuts)], dim=1)
            assert torch.equal(got_pos, positions[:, 0])
        # generated tokens: their index plus the prompt's shift
        assert torch.equal(_positions(ids, items, n, n + 2, [5, 6]),
                           torch.arange(n, n + 2).expand(3, 2) + delta[0])


def _positions(prompt, items, start, end, outputs=()) -> torch.Tensor:
    """``step_item``'s positions of tokens ``start .. end``, [3, end - start]."""
    seq = Sequence(seq_id=0, request_id="r", prompt_token_ids=list(prompt),
                   params=SamplingParams(), mm_items=items)
    seq.output_token_ids.extend(outputs)
    item = step_item(ScheduledSeq(seq, start, end - start))
    return torch.tensor(item.mrope_positions).view(3, end - start)


@torch.inference_mode()
def test_greedy_and_logprobs_equal_transformers(qwen, oracle):
    """And other images of the same sizes under the same text give other tokens; a
    prompt that names fewer images than it is given is refused."""
    model, processor, refs = oracle
    swapped = [(text, [image(*img.size, 100 + i) for i, img in enumerate(images)])
               for text, images in CASES]
    with LLM(str(qwen), dtype="float32") as llm:
        outs = llm.generate(_prompts(), GREEDY)
        assert _tokens(llm.generate(_prompts(swapped), GREEDY)) != refs
        with pytest.raises(ValueError, match="names 1 image"):
            llm.generate({"prompt": f"one {P}", "multi_modal_data": {
                "image": [image(30, 30, 1), image(30, 30, 2)]}}, GREEDY)
    assert _tokens(outs) == refs
    for (text, images), out in zip(CASES, outs):
        inputs = processor(text=text, images=images, return_tensors="pt")
        want = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
        token = out.outputs[0].token_ids[0]
        assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(
            float(want[token]), abs=1e-4)


def test_chunked_prefill_inside_images(qwen, oracle):
    """A step budget under one image's 24 tokens cuts prompts inside images: each chunk's
    positions continue the grid where the last stopped."""
    with LLM(str(qwen), dtype="float32", max_num_batched_tokens=7,
             block_size=16) as llm:
        assert _tokens(llm.generate(_prompts(), GREEDY)) == oracle[2]
        encoder = llm.engine.core.scheduler.encoder
        assert encoder.encoded == sum(len(images) for _, images in CASES)
        assert encoder.held == 0


def test_prefix_cache_keys_on_the_image(qwen, oracle):
    """The same image and text hit the cache, pages after the image included (their
    positions carry its shift); another image under the same text hits only before it."""
    text, images = CASES[0]
    with LLM(str(qwen), dtype="float32", block_size=4) as llm:
        first = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        again = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        other = llm.generate(_prompts([(text, [image(45, 30, 7)])]), GREEDY)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 4 * 4
    assert _tokens([again]) == [oracle[2][0]]
    offset = first.prompt_token_ids.index(llm_image_token(qwen))
    assert other.num_cached_tokens == offset // 4 * 4


def llm_image_token(path) -> int:
    return int(load_model_config(str(path)).image_token_id)


def test_preemption_ngram_drafts_and_async_steps(qwen, oracle):
    """Recomputed prompts after preemption, ngram drafts (their positions are text's)
    and async scheduling (a pending token's positions) give transformers' tokens."""
    refs = oracle[2]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 2}
    with LLM(str(qwen), dtype="float32", kv_cache_memory=6 * PAGE_BYTES, block_size=16,
             enable_prefix_caching=False) as llm:
        assert _tokens(llm.generate(_prompts(), params)) == refs
        assert llm.engine.core.scheduler.stats.num_preemptions > 0
    longer = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(qwen), dtype="float32", speculative_config=ngram) as llm:
        assert _tokens(llm.generate(_prompts(CASES[:2]), longer)) == [
            hf_greedy(oracle[0], oracle[1], text, images, 16) for text, images in CASES[:2]]
        stats = llm.engine.core.stats()
        assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
    with LLM(str(qwen), dtype="float32", async_scheduling=True) as llm:
        assert _tokens(llm.generate(_prompts(), params)) == refs


def test_decode_graphs_replay_at_shifted_positions(qwen, oracle):
    """Replayed decode steps (the fake graphs of test_decode_graphs, captured with one
    position per token) run a sequence's text at its image-shifted position."""
    pytest.importorskip("triton")
    from test_decode_graphs import _llm

    cases = [(f"A {P} and", [image(17, 20, 2)])]
    refs = [hf_greedy(oracle[0], oracle[1], text, images, N) for text, images in cases]
    with _llm(str(qwen), False) as llm:  # max_model_len 48
        got = _tokens(llm.generate(_prompts(cases), GREEDY))
        graphs = llm.engine.core.executor.worker.runner.graphs
    assert got == refs
    assert graphs is not None and graphs.replays > 0
