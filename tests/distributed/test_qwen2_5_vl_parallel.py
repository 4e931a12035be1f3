"""Qwen2.5-VL with its tower and decoder split over ranks (tensor parallel: heads and
MLPs; pipeline: the tower on the first stage, M-RoPE positions on every stage), images
crossing to worker processes as msgspec messages, against transformers float32."""

from __future__ import annotations

import pytest
from quire import LLM, SamplingParams
from quire.models.qwen2_5_vl import make_processor

from tests.tiny_qwen2_5_vl import PLACEHOLDER as P
from tests.tiny_qwen2_5_vl import build_qwen2_5_vl, hf_greedy, hf_qwen2_5_vl
from tests.tiny_vlm import image

CASES = [(f"Describe {P} now please tell", [image(45, 30, 1)]),
         (f"A {P} and {P} two", [image(30, 50, 2), image(64, 17, 3)])]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl-tp") / "tiny")


@pytest.mark.slow  # LLaVA's TP=2 and PP=2 run in the default suite
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_qwen2_5_vl_equals_transformers(qwen, layout):
    model, processor = hf_qwen2_5_vl(qwen), make_processor(str(qwen))
    refs = [hf_greedy(model, processor, text, images, 8) for text, images in CASES]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # a budget under one image's tokens: chunks cut inside images on every rank
    with LLM(str(qwen), dtype="float32", max_num_batched_tokens=16, **layout) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im}}
                             for t, im in CASES], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
