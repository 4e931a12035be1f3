"""Idefics3 (SmolVLM) end to end against transformers float32, given the same images:
greedy tokens equal token for token, first-token logprobs close, for images split into
tiles of several grids, two images in one prompt, repeated tiles, chunked prefill inside
a tile, the prefix cache keyed on the image's tiles, and tensor and pipeline parallel;
the tower and connector alone equal ``get_image_features`` on tiles of any size."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from quire import LLM, SamplingParams
from quire.distributed import TorchDistributedCommunicator
from quire.models.idefics3 import Idefics3ForConditionalGeneration
from quire.models.loader import load_model_config
from quire.multimodal.processor import ImageInputs
from quire.ops import reference_ops
from safetensors.torch import load_file
from transformers import AutoProcessor

from tests.tiny_idefics3 import TILE_EMBEDS, build_idefics3
from tests.tiny_vlm import hf_vlm, hf_vlm_greedy, image

N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=1)

#: (prompt, images, tiles per image): 2x2, 1x2 and 2x1 grids, each plus a global tile;
#: one image given twice, and a flat one whose tiles are all equal.
CASES = [
    ("Describe <image> now please tell", [image(40, 30, 1)], [5]),
    ("A <image> and <image> two", [image(97, 21, 2), image(21, 97, 3)], [3, 3]),
    ("The capital of France is <image>", [image(64, 64, 4)], [5]),
    ("Twice <image> the same <image>", [image(33, 50, 6)] * 2, [5, 5]),
    ("Flat <image>", [Image.new("RGB", (40, 30), (200, 10, 10))], [5]),
]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return build_idefics3(tmp_path_factory.mktemp("idefics3") / "tiny")


@pytest.fixture(scope="module")
def oracle(idefics3):
    model, processor = hf_vlm(idefics3), AutoProcessor.from_pretrained(idefics3)
    refs = [hf_vlm_greedy(model, processor, text, images, N) for text, images, _ in CASES]
    return model, processor, refs


def _prompts(cases=CASES):
    return [{"prompt": text, "multi_modal_data": {"image": images}}
            for text, images, *_ in cases]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_tile_is_one_item_in_prompt_order(idefics3):
    """The processor's tiles become items of one placeholder run each, in order: every
    ``<image>`` token is some tile's, and equal tiles hash equal."""
    inputs = ImageInputs(str(idefics3), load_model_config(str(idefics3)))
    text, images, tiles = CASES[1]
    ids, items = inputs.process(text, images)
    assert len(items) == sum(tiles)
    assert all(len(item.runs) == 1 and item.num_embeds == TILE_EMBEDS for item in items)
    image_rows = [i for i, t in enumerate(ids) if t == inputs.image_token_id]
    assert [p for item in items for o, n in item.runs for p in range(o, o + n)] == image_rows
    _, again = inputs.process("<image>", images[1:])
    assert [i.hash for i in again] == [i.hash for i in items[3:]]
    # equal tiles of one prompt share a hash, so one encoding serves them all
    _, items = inputs.process(*CASES[3][:2])
    assert len(items) == 10 and [i.hash for i in items[:5]] == [i.hash for i in items[5:]]
    _, items = inputs.process(*CASES[4][:2])
    assert len(items) == sum(CASES[4][2]) > len({item.hash for item in items})


@torch.inference_mode()
def test_tiles_of_any_size_equal_get_image_features(idefics3, oracle):
    """Tiles smaller than the tower's native size take bucketed positions."""
    hf = oracle[0]
    config = load_model_config(str(idefics3))
    ours = Idefics3ForConditionalGeneration(config, TorchDistributedCommunicator("gloo", 0, 1))
    ours.load_weights(load_file(str(idefics3 / "model.safetensors")).items())
    for side in (24, 16, 8):
        pixels = torch.randn(1, 3, 3, side, side, generator=torch.Generator().manual_seed(side))
        mask = torch.ones(1, 3, side, side, dtype=torch.long)
        want = hf.model.get_image_features(pixels, mask).pooler_output[0]
        got = torch.cat(ours.embed_images([{"pixel_values": t[None]} for t in pixels[0]],
                                          reference_ops()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_greedy_and_logprobs_equal_transformers(idefics3, oracle):
    model, processor, refs = oracle
    with LLM(str(idefics3), dtype="float32") as llm:
        outs = llm.generate(_prompts(), GREEDY)
    assert _tokens(outs) == refs
    for (text, images, _), out in zip(CASES, outs):
        inputs = processor(text=text, images=images, return_tensors="pt")
        want = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
        token = out.outputs[0].token_ids[0]
        assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(
            float(want[token]), abs=1e-4)


def test_chunked_prefill_inside_images(idefics3, oracle):
    """A step budget under one image's tokens (and one tile's 9) cuts prompts inside
    tiles; each tile is encoded once and later chunks take it from the cache."""
    with LLM(str(idefics3), dtype="float32", max_num_batched_tokens=7,
             block_size=16) as llm:
        assert _tokens(llm.generate(_prompts(), GREEDY)) == oracle[2]
        encoder = llm.engine.core.scheduler.encoder
        # every distinct tile at least once, never more than once per occurrence
        # (equal tiles share an entry while one of them is under way)
        distinct = {item.hash for text, images, _ in CASES
                    for item in llm.engine.image_inputs().process(text, images)[1]}
        assert len(distinct) <= encoder.encoded <= sum(sum(t) for *_, t in CASES)
        assert encoder.held == 0


def test_prefix_cache_keys_on_the_image(idefics3, oracle):
    """The same image and text hit the cache; another image under the same text hits
    only the pages before it."""
    text, images, _ = CASES[2]
    with LLM(str(idefics3), dtype="float32", block_size=4) as llm:
        first = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        again = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        other = llm.generate(_prompts([(text, [image(64, 64, 5)])]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert _tokens([again]) == [oracle[2][2]]
    ids = first.prompt_token_ids
    image_token = oracle[1].image_token_id
    offset = ids.index(image_token)  # the first tile's first token
    assert other.num_cached_tokens == offset // 4 * 4
    assert _tokens([other]) != [oracle[2][2]]


@pytest.mark.slow  # LLaVA's TP=2 and PP=2 run in the default suite
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_equals_transformers(idefics3, oracle, layout):
    """The tower's heads and MLPs and the connector split over two ranks; or the vision
    part on the first of two pipeline stages."""
    with LLM(str(idefics3), dtype="float32", max_num_batched_tokens=16, **layout) as llm:
        assert _tokens(llm.generate(_prompts(CASES[:2]), GREEDY)) == oracle[2][:2]
