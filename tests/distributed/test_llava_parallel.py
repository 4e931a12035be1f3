"""LLaVA with its tower and decoder split over ranks (tensor parallel: heads and MLPs;
pipeline: the tower on the first stage), images crossing to worker processes as msgspec
messages, against transformers float32."""

from __future__ import annotations

import pytest
from transformers import AutoProcessor

from quire import LLM, SamplingParams
from tests.tiny_vlm import build_llava, hf_vlm, hf_vlm_greedy, image

CASES = [("Describe <image> now please tell", [image(40, 30, 1)]),
         ("A <image> and <image> two", [image(30, 50, 2), image(64, 64, 3)])]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava-tp") / "tiny")


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_llava_equals_transformers(llava, layout):
    model, processor = hf_vlm(llava), AutoProcessor.from_pretrained(llava)
    refs = [hf_vlm_greedy(model, processor, text, images, 8) for text, images in CASES]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # a budget under one image's tokens: chunks cut inside images on every rank
    with LLM(str(llava), dtype="float32", max_num_batched_tokens=16, **layout) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im}}
                             for t, im in CASES], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
