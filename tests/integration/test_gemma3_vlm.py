"""Gemma 3 with images against transformers float32: every prompt position's logprob
(image rows attend over their whole image, on a sliding layer whose window is shorter
than an image, and past it after a long prefix), greedy tokens, through chunked prefill
(an image is never cut: a chunk stops before it or runs past the budget to its end) and
the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from quire import LLM, SamplingParams
from tests.tiny_gemma3_vlm import TOKENS, build_gemma3_vlm
from tests.tiny_vlm import hf_vlm, hf_vlm_greedy, image

CASES = [
    ("Look <start_of_image> here", [image(40, 30, 1)]),
    (("A long prefix of text before the image arrives <start_of_image> and "
      "<start_of_image> two"), [image(30, 50, 2), image(64, 64, 3)]),
    ("<start_of_image><start_of_image>", [image(32, 32, 4), image(20, 90, 5)]),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm") / "tiny")


@pytest.fixture(scope="module")
def oracle(gemma3):
    model, processor = hf_vlm(gemma3), AutoProcessor.from_pretrained(gemma3)
    logprobs = []
    with torch.inference_mode():
        for text, images in CASES:
            inputs = processor(text=text, images=images, return_tensors="pt")
            logprobs.append(torch.log_softmax(model(**inputs).logits[0].float(), -1))
    greedy = [hf_vlm_greedy(model, processor, text, images, 6) for text, images in CASES]
    return logprobs, greedy


def _prompts():
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in CASES]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 12, "block_size": 8}],
                         ids=["whole", "chunked"])
def test_every_prompt_position_equals_transformers(gemma3, oracle, options):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(gemma3), dtype="float32", **options) as llm:
        outs = llm.generate(_prompts(), params)
        assert llm.engine.core.scheduler.encoder.held == 0
    for out, want, greedy in zip(outs, *oracle):
        ids = out.prompt_token_ids
        assert max(ids.count(t) for t in set(ids)) >= TOKENS  # the image tokens are in
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert list(out.outputs[0].token_ids) == greedy


def test_the_prefix_cache_serves_an_image_again(gemma3, oracle):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(gemma3), dtype="float32", block_size=4) as llm:
        llm.generate(_prompts()[1:2], params)
        again = llm.generate(_prompts()[1:2], params)[0]
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4
    assert list(again.outputs[0].token_ids) == oracle[1][1]
