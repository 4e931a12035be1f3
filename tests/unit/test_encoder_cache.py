"""The engine's image-embedding bookkeeping against the workers': under random chunking,
preemption and sharing of images between sequences, an image the engine counts as held
is always held by the workers (no message says what to drop), every row gets its own
image's embeddings, and both end empty."""

from __future__ import annotations

import random

import torch

from quire.engine.encoder_cache import EncoderCache
from quire.executor.array import Array
from quire.executor.encoder_cache import ImageEmbeddings
from quire.executor.messages import StepItem
from quire.multimodal.inputs import MMItem, page_keys, runs_of, spans_in
from quire.ops import reference_ops


def _item(h: int, runs: list[tuple[int, int]]) -> MMItem:
    return MMItem(h, runs, {"pixel_values": Array.of(torch.tensor([float(h)]))})


class _Model:
    """Embedding j of image h is the row (h, j)."""

    def __init__(self) -> None:
        self.calls = 0

    def embed_images(self, images, ops):
        self.calls += 1
        out = []
        for image in images:
            h = int(image["pixel_values"][0])
            n = _SIZES[h]
            out.append(torch.stack([torch.full((n,), float(h)), torch.arange(n).float()], 1))
        return out


_SIZES = {1: 5, 2: 7, 3: 4}


def test_runs_spans_and_page_keys():
    assert runs_of([3, 4, 5, 9, 10]) == [(3, 3), (9, 2)]
    item = _item(1, [(3, 3), (9, 2)])
    assert item.num_embeds == 5 and item.offset == 3 and item.end == 11
    assert [(s.row, s.count, s.first, s.last) for s in spans_in([item], 4, 10)] == [
        (0, 2, 1, False), (5, 1, 3, False)]
    assert spans_in([item], 9, 12)[-1].last
    # the same image again later: each occurrence is its own, by its index
    again = _item(1, [(20, 5)])
    assert [(s.item, s.last) for s in spans_in([item, again], 0, 22)] == [
        (0, False), (0, True), (1, False)]
    assert not item.touches(6, 9) and item.touches(8, 10)
    assert page_keys([item], 0, 4) == (1,) and page_keys([item], 11, 16) == ()


def test_engine_and_workers_agree_under_random_schedules():
    rng = random.Random(0)
    for trial in range(200):
        engine = EncoderCache(budget=rng.choice([4, 8, 100]), capacity=rng.choice([6, 100]))
        workers, model = ImageEmbeddings(), _Model()
        # each sequence: a prompt with one to four images, some shared between them
        seqs = {}
        for seq_id in range(rng.randint(1, 4)):
            # an image may occur twice in one prompt
            hashes = rng.choices([1, 2, 3], k=rng.randint(1, 4))
            at, items = 1, []
            for h in hashes:
                at += rng.randint(0, 3)
                items.append(_item(h, [(at, _SIZES[h])]))
                at += _SIZES[h]
            seqs[seq_id] = [items, 0, at + 2]  # items, computed, prompt length
        released: list[int] = []
        while seqs:
            steps, used = [], 0
            for seq_id, (items, done, length) in list(seqs.items()):
                if rng.random() < 0.1 and done:  # preempted: recomputed from 0
                    engine.release(seq_id, items)
                    released.append(seq_id)
                    seqs[seq_id][1] = 0
                    continue
                num = min(rng.randint(1, 9), length - done)
                end = done + num
                # the scheduler's cut: stop before an image that does not fit
                seen = set()
                for item in items:
                    if item.touches(done, end) and not engine.holds(item.hash) \
                            and item.hash not in seen:
                        if not engine.fits(item.num_embeds, used):
                            end = max(done, item.offset)
                            break
                        used += item.num_embeds
                        seen.add(item.hash)
                if end == done:
                    continue
                fresh = {i.hash: i for i in items
                         if i.touches(done, end) and not engine.holds(i.hash)}
                engine.use(seq_id, items, done, end)
                steps.append(StepItem(seq_id, [0] * (end - done), done, [], False,
                                      mm_encode=list(fresh.values()),
                                      mm_spans=spans_in(items, done, end)))
                seqs[seq_id][1] = end
            if steps:
                mm = workers.step(steps, model, reference_ops(), torch.device("cpu"))
                if mm is not None:
                    rows, values = mm
                    offsets, at = [], 0
                    for step in steps:
                        offsets.append(at)
                        at += len(step.token_ids)
                    # every row's embedding is its own image's, at its own index
                    for step, base in zip(steps, offsets):
                        for span in step.mm_spans:
                            for k in range(span.count):
                                r = (rows == base + span.row + k).nonzero()[0, 0]
                                assert values[r].tolist() == [float(span.hash),
                                                              float(span.first + k)]
            workers.release(released)
            released = []
            for seq_id in [s for s, (_, done, length) in seqs.items() if done == length]:
                engine.release(seq_id, seqs[seq_id][0])
                released.append(seq_id)
                del seqs[seq_id]
        workers.release(released)
        assert engine.held == 0 and len(workers) == 0, trial
