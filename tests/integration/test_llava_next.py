"""LLaVA-NeXT against transformers float32, given the same images: each image's packed
embeddings (base tile, unpadded grid, row newlines), the number of placeholder tokens
the processor expands an image to, and greedy tokens with their top logprobs, through
chunked prefill inside images and the prefix cache; and refusals."""

from __future__ import annotations

import pytest
import torch
from quire import LLM, SamplingParams
from quire.distributed import TorchDistributedCommunicator
from quire.models.llava_next import IMAGE_FAMILY, LlavaNextForConditionalGeneration
from quire.models.loader import iter_weights, load_model_config
from quire.multimodal.processor import ImageInputs
from quire.ops import reference_ops
from transformers import AutoProcessor

from tests.tiny_llava_next import build_llava_next, llava_next_config
from tests.tiny_vlm import hf_vlm, image

N = 6
TOP = 3
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=TOP)

#: (prompt, images): wide and tall images whose grids need unpadding, a 2x2 grid, one
#: that fills its grid exactly, two images of different tile counts in one prompt.
CASES = [
    ("Describe <image> now please tell", [image(40, 30, 1)]),
    ("A <image> and <image> two", [image(30, 50, 2), image(64, 64, 3)]),
    ("<image><image>", [image(60, 30, 4), image(21, 97, 5)]),
    ("The capital of France is <image>", [image(97, 21, 6)]),
]

#: (width, height) of images whose embeddings are compared one by one.
SIZES = [(40, 30), (30, 50), (64, 64), (60, 30), (30, 60), (97, 21), (21, 97), (7, 5),
         (200, 90), (30, 30), (61, 59)]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    return build_llava_next(tmp_path_factory.mktemp("llava_next") / "tiny")


@pytest.fixture(scope="module")
def oracle(llava_next):
    model, processor = hf_vlm(llava_next), AutoProcessor.from_pretrained(llava_next)
    refs = [_hf_greedy(model, processor, text, images) for text, images in CASES]
    return model, processor, refs


@torch.inference_mode()
def _hf_greedy(model, processor, prompt: str, images: list
               ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-softmax, the whole sequence each
    step."""
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    tokens, logprobs = [], []
    for _ in range(N):
        logprobs.append(torch.log_softmax(model(input_ids=ids, **inputs).logits[0, -1], -1))
        tokens.append(int(logprobs[-1].argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logprobs


def _prompts(cases=CASES):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(outs, refs) -> None:
    """Tokens equal, and each step's top logprobs transformers' log-softmax."""
    assert _tokens(outs) == [tokens for tokens, _ in refs]
    for (_, want), out in zip(refs, outs):
        for step, theirs in zip(out.outputs[0].logprobs, want):
            assert len(step) >= TOP
            for token, logprob in step.items():
                assert logprob.logprob == pytest.approx(float(theirs[token]), abs=1e-4)


@torch.inference_mode()
def test_embeddings_equal_transformers(llava_next, oracle):
    """Every image's embeddings equal ``get_image_features``' packed ones, as many as
    the processor puts placeholder tokens; an image padded to a larger one's tile count
    in its batch is the same item as alone."""
    model, processor, _ = oracle
    config = load_model_config(str(llava_next))
    ours = LlavaNextForConditionalGeneration(config, TorchDistributedCommunicator("gloo"))
    ours.load_weights(iter_weights(str(llava_next)))
    images = [image(w, h, i) for i, (w, h) in enumerate(SIZES)]
    out = processor(text="<image>" * len(images), images=images, return_tensors="pt")
    want = model.model.get_image_features(out["pixel_values"], out["image_sizes"])
    per_image = IMAGE_FAMILY.split(dict(out), len(images))
    got = ours.embed_images(per_image, reference_ops())
    for size, mine, theirs, inputs in zip(SIZES, got, want.pooler_output, per_image):
        assert mine.shape == theirs.shape, size
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=str(size))
        alone = processor(text="<image>", images=[images[SIZES.index(size)]],
                          return_tensors="pt")
        assert IMAGE_FAMILY.num_embeds(config, inputs) == len(mine) == int(
            (alone["input_ids"] == config.image_token_index).sum()), size
        torch.testing.assert_close(inputs["pixel_values"],
                                   IMAGE_FAMILY.split(dict(alone), 1)[0]["pixel_values"],
                                   rtol=0, atol=0)


def test_num_embeds_equal_the_processors_expansion(llava_next):
    """Over many sizes and aspect ratios: the processor's own count of an image's
    placeholder tokens."""
    config = load_model_config(str(llava_next))
    processor = AutoProcessor.from_pretrained(llava_next)
    tile = config.vision_config.image_size
    for height in range(1, 130, 7):
        for width in range(1, 130, 5):
            theirs = processor._get_number_of_features(height, width, tile, tile) - 1
            sizes = {"image_sizes": torch.tensor([[height, width]])}
            assert IMAGE_FAMILY.num_embeds(config, sizes) == theirs, (height, width)


@torch.inference_mode()
def test_greedy_and_logprobs_equal_transformers(llava_next, oracle):
    with LLM(str(llava_next), dtype="float32") as llm:
        _check(llm.generate(_prompts(), GREEDY), oracle[2])


@pytest.mark.parametrize("budget", [16, 50])
def test_chunked_prefill_inside_images(llava_next, oracle, budget):
    """A step budget under one image's tokens (58 or more) cuts prompts inside images;
    each image is encoded once."""
    with LLM(str(llava_next), dtype="float32", max_num_batched_tokens=budget,
             block_size=16) as llm:
        _check(llm.generate(_prompts(), GREEDY), oracle[2])
        encoder = llm.engine.core.scheduler.encoder
        assert encoder.encoded == sum(len(images) for _, images in CASES)
        assert encoder.held == 0


def test_prefix_cache_keys_on_the_image(llava_next, oracle):
    """The same image hits the cache, also beside a larger image that pads its tiles in
    the processor's batch; another image under the same text hits only the text."""
    text, images = CASES[3]
    with LLM(str(llava_next), dtype="float32", block_size=4) as llm:
        first = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        again = llm.generate(_prompts([(text, images)]), GREEDY)[0]
        beside = llm.generate(_prompts([(text + " and <image>", images + [image(64, 64, 3)])]),
                              GREEDY)[0]
        other = llm.generate(_prompts([(text, [image(97, 21, 7)])]), GREEDY)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (n - 1) // 4 * 4
    _check([again], oracle[2][3:])
    assert beside.num_cached_tokens >= n // 4 * 4
    offset = first.prompt_token_ids.index(load_model_config(str(llava_next)).image_token_index)
    assert other.num_cached_tokens == offset // 4 * 4


def test_image_inputs_count_the_processors_tokens(llava_next):
    """The front's check: the processor's image tokens equal the embeddings counted."""
    config = load_model_config(str(llava_next))
    front = ImageInputs(str(llava_next), config)
    ids, items = front.process("A <image> and <image>", [image(30, 50, 2), image(64, 64, 3)])
    assert [item.num_embeds for item in items] == [73, 135]
    assert sum(t == config.image_token_index for t in ids) == 73 + 135


def test_refusals():
    comm = TorchDistributedCommunicator("gloo")
    with pytest.raises(ValueError, match="vision_feature_select_strategy='full'"):
        LlavaNextForConditionalGeneration(llava_next_config(400, "full"), comm)
    config = llava_next_config(400)
    config.image_grid_pinpoints = [[30, 45]]
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        LlavaNextForConditionalGeneration(config, comm)
