"""The image workload (``quire bench images``): one image and a question on an image-text
model, measured four ways.

Every request is a seeded random RGB image (``image_size`` square; the model's
processor resizes it) and a question of exactly ``input_len`` tokens of text around the
model's placeholder, ``USER: <image>\\n... ASSISTANT:``; each request of a pass has its
own image and text, so nothing is shared by accident. Per repeat:

- (a) **TTFT**: one request, ``max_tokens=1``, a fresh image: from handing over the text
  and the decoded image (preprocessing included, in every engine) to the first token.
- (b) **the same image and question again**: its TTFT, the prompt tokens the prefix
  cache served, and the share of (a)'s TTFT saved.
- (c) **requests/s**: ``concurrency`` requests at once, distinct images,
  ``output_len`` tokens each (greedy, ``ignore_eos``).
- (d) **the encoder's share**: time in the model's ``embed_images`` during (a), over
  (a)'s TTFT. Measured by wrapping ``embed_images`` on the engine's in-process model for
  (a)'s run (the uni executor's worker holds it), each call between two device
  synchronizations; None where the model runs in another process.

Peers (``hf``, ``vllm``) run the same prompts and the same images, handed over as PNG
files, in ``peers/image_worker.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quire.bench.corpus import Corpus, TokenizerSource
from quire.bench.report import Figure

#: Around the question: LLaVA-1.5's conversation form, the placeholder where ``<image>``
#: stands.
LEAD, TAIL = "USER: {placeholder}\n", " ASSISTANT:"
#: The peers' script (run with each peer venv's Python).
WORKER = Path(__file__).parent / "peers" / "image_worker.py"
# Slice lengths tried per corpus offset, and offsets tried, before giving up.
_ADJUSTMENTS, _OFFSETS = 8, 200
# The warm-up pass: its batch makes this many tokens per request.
_WARMUP_OUTPUT_LEN = 4

IMAGE_FIGURES = (
    Figure("ttft_s", "TTFT, fresh image (ms)", 1000.0),
    Figure("ttft_cached_s", "TTFT, same image again (ms)", 1000.0),
    Figure("prefix_saving", "TTFT saved by the prefix cache"),
    Figure("cached_tokens", "prompt tokens from the cache"),
    Figure("encoder_s", "encoder in the TTFT (ms)", 1000.0),
    Figure("encoder_share", "encoder share of the TTFT"),
    Figure("requests_per_s", "requests/s, concurrent"),
    Figure("output_tokens_per_s", "output tokens/s, concurrent"),
    Figure("elapsed_s", "concurrent pass (s)"),
    Figure("prompt_tokens", "prompt tokens per request"),
)


@dataclass(frozen=True)
class ImageWorkload:
    """The shape of the workload. :raises ValueError: naming the flag out of range."""

    image_size: int = 448
    input_len: int = 64
    output_len: int = 64
    concurrency: int = 16
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("image_size", "input_len", "output_len", "concurrency", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got "
                                 f"{getattr(self, name)}")


@dataclass(frozen=True)
class ImageRequest:
    """One request: its text (with the placeholder) and its image's seed."""

    prompt: str
    image_seed: tuple[int, int, int]


@dataclass(frozen=True)
class ImagePass:
    """What one repeat runs: (a)/(b)'s request and (c)'s batch."""

    single: ImageRequest
    batch: list[ImageRequest]
    output_len: int


@dataclass(frozen=True)
class ImageRun:
    """What one repeat measured, in any engine. None: not measured there."""

    ttft_s: float
    prompt_tokens: int
    elapsed_s: float
    num_requests: int
    output_tokens: int
    ttft_cached_s: float | None = None
    cached_tokens: int | None = None
    encoder_s: float | None = None

    def figures(self) -> dict[str, float]:
        figures = {"ttft_s": self.ttft_s, "prompt_tokens": float(self.prompt_tokens),
                   "requests_per_s": self.num_requests / self.elapsed_s,
                   "output_tokens_per_s": self.output_tokens / self.elapsed_s,
                   "elapsed_s": self.elapsed_s}
        if self.ttft_cached_s is not None:
            figures["ttft_cached_s"] = self.ttft_cached_s
            figures["prefix_saving"] = 1.0 - self.ttft_cached_s / self.ttft_s
        if self.cached_tokens is not None:
            figures["cached_tokens"] = float(self.cached_tokens)
        if self.encoder_s is not None:
            figures["encoder_s"] = self.encoder_s
            figures["encoder_share"] = self.encoder_s / self.ttft_s
        return figures


# -- the workload ----------------------------------------------------------------------------
def random_image(size: int, seed: tuple[int, int, int]) -> Any:
    """A ``size`` x ``size`` RGB image of seeded uniform noise (PIL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(list(seed)).integers(0, 256, (size, size, 3),
                                                         dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


class Questions:
    """Question texts of exactly ``input_len`` text tokens around ``placeholder``, cut
    from the benchmark corpus at seeded offsets (the placeholder counts as one token of
    the tokenizer's; :func:`check_length` verifies against the processor)."""

    def __init__(self, tokenizer: Any, placeholder: str, input_len: int, seed: int) -> None:
        self.source = TokenizerSource(tokenizer)
        self.corpus = Corpus(self.source)
        self.lead = LEAD.format(placeholder=placeholder)
        self.input_len = input_len
        self.seed = seed
        #: Text tokens of the lead and tail alone (special tokens included).
        self.fixed = len(self.source.encode(self.lead + TAIL)) - 1
        if self.fixed >= input_len:
            raise ValueError(f"--input-len: must be more than the {self.fixed} tokens of "
                             f"{(self.lead + TAIL)!r}, got {input_len}")

    def text(self, key: tuple[int, int]) -> str:
        """The question for ``key`` (repeat, index): the same key, the same text."""
        import random

        rng = random.Random(f"{self.seed}:{key[0]}:{key[1]}")
        target = self.input_len + 1  # the placeholder is one of the tokenizer's tokens
        limit = len(self.corpus) - self.input_len - 2 * _ADJUSTMENTS
        for _ in range(_OFFSETS):
            start = rng.randrange(max(1, limit))
            length = self.input_len - self.fixed
            for _ in range(_ADJUSTMENTS):
                if length < 1:
                    break
                body = self.source.decode(self.corpus.token_ids[start:start + length])
                text = self.lead + body + TAIL
                got = len(self.source.encode(text))
                if got == target:
                    return text
                length += target - got
        raise ValueError(f"--input-len: no question of {self.input_len} tokens found in "
                         "the corpus with this tokenizer")


def build_passes(spec: ImageWorkload, questions: Questions) -> tuple[ImagePass,
                                                                     list[ImagePass]]:
    """The warm-up pass (its own images and text; short outputs) and one pass per
    repeat. Image seeds are (seed, pass, index): pass 0 is the warm-up's."""
    def one(p: int, output_len: int) -> ImagePass:
        requests = [ImageRequest(questions.text((p, i)), (spec.seed, p, i))
                    for i in range(spec.concurrency + 1)]
        return ImagePass(requests[0], requests[1:], output_len)

    return (one(0, min(_WARMUP_OUTPUT_LEN, spec.output_len)),
            [one(p, spec.output_len) for p in range(1, spec.repeats + 1)])


def check_length(inputs: Any, prompt: str, image: Any, input_len: int) -> int:
    """The prompt's length through the model's processor (image tokens included).

    :raises ValueError: when its text is not ``input_len`` tokens."""
    ids, items = inputs.process(prompt, [image])
    text = len(ids) - sum(item.num_embeds for item in items)
    if text != input_len:
        raise ValueError(f"--input-len: the question came to {text} text tokens through "
                         f"the model's processor, not {input_len}")
    return len(ids)


# -- Quire ----------------------------------------------------------------------------------
class EncoderTimer:
    """Seconds spent in ``model.embed_images`` while :meth:`timing` is open: the method is
    wrapped on the instance (the runner calls it through the instance), each call between
    two ``synchronize()`` so that the device's work is inside the clock."""

    def __init__(self, model: Any, synchronize: Callable[[], None]) -> None:
        self.model = model
        self.synchronize = synchronize
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[EncoderTimer]:
        original = self.model.embed_images
        self.seconds = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.synchronize()
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.synchronize()
            self.seconds += time.perf_counter() - start
            return out

        self.model.embed_images = timed
        try:
            yield self
        finally:
            del self.model.embed_images  # the class's method again


def encoder_timer(engine: Any) -> EncoderTimer | None:
    """A timer on the engine's in-process model, None where the model runs elsewhere
    (worker processes)."""
    try:
        worker = engine.core.executor.worker
    except AttributeError:
        return None
    if not hasattr(worker.model, "embed_images"):
        return None
    return EncoderTimer(worker.model, worker.platform.synchronize)


def run_quire(llm: Any, p: ImagePass, images: dict[tuple[int, int, int], Any],
              timer: EncoderTimer | None) -> ImageRun:
    """One repeat on ``llm`` (idle, prefix caching on): (a), (b) and (c), and (d) when a
    timer is given.

    :raises RuntimeError: when the batch made other than ``output_len`` tokens each."""
    from quire.bench.quire_engine import greedy_params

    def prompt(request: ImageRequest) -> dict[str, Any]:
        return {"prompt": request.prompt,
                "multi_modal_data": {"image": images[request.image_seed]}}

    first = greedy_params(1)
    start = time.perf_counter()
    if timer is not None:
        with timer.timing():
            fresh = llm.generate(prompt(p.single), first)[0]
    else:
        fresh = llm.generate(prompt(p.single), first)[0]
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    again = llm.generate(prompt(p.single), first)[0]
    ttft_cached = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate([prompt(r) for r in p.batch], greedy_params(p.output_len))
    elapsed = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != p.output_len * len(p.batch):
        raise RuntimeError(f"quire made {made} output tokens, expected "
                           f"{p.output_len * len(p.batch)}: raise --max-model-len")
    return ImageRun(ttft_s=ttft, prompt_tokens=len(fresh.prompt_token_ids),
                    elapsed_s=elapsed, num_requests=len(p.batch), output_tokens=made,
                    ttft_cached_s=ttft_cached, cached_tokens=again.num_cached_tokens,
                    encoder_s=None if timer is None else timer.seconds)


# -- peers ----------------------------------------------------------------------------------
def peer_job(model: str, warmup: ImagePass, passes: list[ImagePass], png: dict[Any, str],
             options: dict[str, Any]) -> dict[str, Any]:
    """The image worker's job: every pass's prompts with their images' PNG files."""
    def request(r: ImageRequest) -> dict[str, str]:
        return {"prompt": r.prompt, "image": png[r.image_seed]}

    def one(p: ImagePass) -> dict[str, Any]:
        return {"single": request(p.single), "batch": [request(r) for r in p.batch],
                "output_len": p.output_len}

    return {"action": "images", "model": model, "warmup": one(warmup),
            "runs": [one(p) for p in passes], "options": options}


def write_pngs(images: dict[tuple[int, int, int], Any], directory: Path
               ) -> dict[tuple[int, int, int], str]:
    """Each image as a PNG (lossless: the peers decode the very pixels Quire got)."""
    paths = {}
    for seed, image in images.items():
        path = directory / f"image-{'-'.join(map(str, seed))}.png"
        image.save(path, format="PNG")
        paths[seed] = str(path)
    return paths


def peer_runs(result: dict[str, Any], spec: ImageWorkload) -> list[ImageRun]:
    """A worker's runs. :raises ValueError: when a batch made other than
    ``output_len`` tokens per request (the figures would be wrong)."""
    runs = [ImageRun(**run) for run in result["runs"]]
    expected = spec.output_len * spec.concurrency
    for run in runs:
        if run.output_tokens != expected:
            raise ValueError(f"the concurrent pass made {run.output_tokens} output tokens, "
                             f"expected {expected}")
    return runs


def settings(spec: ImageWorkload, **extra: Any) -> dict[str, Any]:
    return {"workload": asdict(spec), "lead": LEAD, "tail": TAIL, **extra}
