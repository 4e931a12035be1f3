"""Gemma 3 with images split over two ranks (the SigLIP tower's heads and MLPs, the
decoder's; and two pipeline stages, whose second corrects image rows' attention too)
against transformers float32, at every prompt position."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from quire import LLM, SamplingParams
from tests.tiny_gemma3_vlm import build_gemma3_vlm
from tests.tiny_vlm import hf_vlm, image

CASES = [(("A long prefix of text before the image arrives <start_of_image> and "
           "<start_of_image> two"), [image(30, 50, 2), image(64, 64, 3)])]


@pytest.mark.slow  # LLaVA's TP=2 and PP=2 run in the default suite
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_gemma3_images_equal_transformers(tmp_path, layout):
    path = build_gemma3_vlm(tmp_path / "tiny")
    model, processor = hf_vlm(path), AutoProcessor.from_pretrained(path)
    text, images = CASES[0]
    with torch.inference_mode():
        want = torch.log_softmax(model(**processor(text=text, images=images,
                                                   return_tensors="pt")).logits[0], -1)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with LLM(str(path), dtype="float32", max_num_batched_tokens=12, **layout) as llm:
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params)[0]
    ids = out.prompt_token_ids
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
