"""LLaVA end to end against transformers float32, given the same images: greedy tokens
equal token for token, first-token logprobs close, through chunked prefill across the
image tokens, the prefix cache, preemption and the chat API; and refusals."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from transformers import AutoProcessor

from quire import LLM, SamplingParams
from tests.tiny_vlm import build_llava, hf_vlm, hf_vlm_greedy, image

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=1)

#: (prompt, images): several sizes and aspect ratios, two images apart and adjacent.
CASES = [
    ("Describe <image> now please tell", [image(40, 30, 1)]),
    ("A <image> and <image> two", [image(30, 50, 2), image(64, 64, 3)]),
    ("<image><image>", [image(30, 30, 4), image(33, 30, 5)]),
    ("The capital of France is <image>", [image(97, 21, 6)]),
]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "tiny")


@pytest.fixture(scope="module")
def oracle(llava):
    model, processor = hf_vlm(llava), AutoProcessor.from_pretrained(llava)
    refs = [hf_vlm_greedy(model, processor, text, images, N) for text, images in CASES]
    return model, processor, refs


def _prompts(cases=CASES):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def test_greedy_and_logprobs_equal_transformers(llava, oracle):
    model, processor, refs = oracle
    with LLM(str(llava), dtype="float32") as llm:
        outs = llm.generate(_prompts(), GREEDY)
    assert _tokens(outs) == refs
    # the first token's logprob against transformers' log-softmax at the prompt's end
    for (text, images), out in zip(CASES, outs):
        inputs = processor(text=text, images=images, return_tensors="pt")
        want = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
        first = out.outputs[0].logprobs[0]
        token = out.outputs[0].token_ids[0]
        assert first[token].logprob == pytest.approx(float(want[token]), abs=1e-4)


@pytest.mark.parametrize("budget", [None, 10])
def test_the_same_image_twice_in_one_prompt(llava, oracle, budget):
    """Both occurrences take the one encoding: the sequence uses it until the second
    ends, whether one step holds both or chunks split them."""
    model, processor, _ = oracle
    pic = image(40, 30, 1)
    cases = [("<image><image> twice", [pic, pic]), ("<image> then <image>", [pic, pic])]
    refs = [hf_vlm_greedy(model, processor, text, images, N) for text, images in cases]
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    with LLM(str(llava), dtype="float32", **options) as llm:
        assert _tokens(llm.generate(_prompts(cases), GREEDY)) == refs
        assert llm.engine.core.scheduler.encoder.held == 0


def test_the_image_matters(llava, oracle):
    """Other images under the same text give other tokens: the images reach the model."""
    swapped = [(text, [image(45, 45, 100 + i) for i in range(len(images))])
               for text, images in CASES]
    with LLM(str(llava), dtype="float32") as llm:
        outs = llm.generate(_prompts(swapped), GREEDY)
    assert _tokens(outs) != oracle[2]


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_across_image_tokens(llava, oracle, budget):
    """A step budget under one image's 25 tokens cuts prompts inside images; each image
    is encoded once and its embeddings are taken by later chunks from the cache."""
    with LLM(str(llava), dtype="float32", max_num_batched_tokens=budget,
             block_size=16) as llm:
        assert _tokens(llm.generate(_prompts(), GREEDY)) == oracle[2]
        encoder = llm.engine.core.scheduler.encoder
        assert encoder.encoded == sum(len(images) for _, images in CASES)
        assert encoder.held == 0  # every entry dropped once its prompts passed it


def test_prefix_cache_keys_on_the_image(llava, oracle):
    """The same image and text hit the cache; another image under the same text hits
    only the pages before it."""
    text, images = CASES[3]  # 8 text tokens, then the image's 25
    with LLM(str(llava), dtype="float32", block_size=4) as llm:
        first = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        again = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        other = llm.generate(_prompts([(text, [image(97, 21, 7)])]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    # every full page but the one with the last token (its logits are needed)
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert _tokens([again]) == [oracle[2][3]]
    offset = len(first.prompt_token_ids) - 25
    assert other.num_cached_tokens == offset // 4 * 4  # the text before the image only


def test_preemption_recomputes_images(llava, oracle):
    refs = [hf_vlm_greedy(oracle[0], oracle[1], text, images, 24) for text, images in CASES]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(llava), dtype="float32", kv_cache_memory=8 * 8192, block_size=16,
             enable_prefix_caching=False) as llm:
        outs = llm.generate(_prompts(), params)
        assert llm.engine.core.scheduler.stats.num_preemptions > 0
    assert _tokens(outs) == refs


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_url_and_pil_parts(llava, oracle):
    model, processor, _ = oracle
    pic = image(40, 30, 1)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": _data_url(pic)}},
        {"type": "text", "text": " and "},
        {"type": "image_pil", "image_pil": image(50, 30, 9)},
    ]}]
    with LLM(str(llava), dtype="float32") as llm:
        out = llm.chat(messages, GREEDY)[0]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                      {"type": "image"}, {"type": "text", "text": " and "},
                                      {"type": "image"}]}], add_generation_prompt=True)
    # the PNG round trip is lossless: the same pixels as the PIL image
    ref = hf_vlm_greedy(model, processor, prompt, [pic, image(50, 30, 9)], N,
                        add_special_tokens=False)
    assert list(out.outputs[0].token_ids) == ref


def test_refusals(llava, tiny_checkpoint):
    with LLM(str(llava), dtype="float32", limit_mm_per_prompt=2) as llm:
        with pytest.raises(ValueError, match="names 1 image"):
            llm.generate({"prompt": "one <image>", "multi_modal_data": {
                "image": [image(30, 30, 1), image(30, 30, 2)]}}, GREEDY)
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            llm.generate({"prompt": "<image>" * 3, "multi_modal_data": {
                "image": [image(30, 30, i) for i in range(3)]}}, GREEDY)
        with pytest.raises(ValueError, match="PIL images"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"png"}},
                         GREEDY)
        with pytest.raises(ValueError, match="multi_modal_data takes"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"video": []}}, GREEDY)
        with pytest.raises(ValueError, match="image_url"):
            llm.chat([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}]}],
                GREEDY)
        # the engine still serves
        assert _tokens(llm.generate(_prompts(CASES[:1]), GREEDY))[0]
    with LLM(str(tiny_checkpoint("llama")), dtype="float32") as text_only:
        with pytest.raises(ValueError, match="text only"):
            text_only.generate({"prompt": "<image>", "multi_modal_data": {
                "image": image(30, 30, 1)}}, GREEDY)
