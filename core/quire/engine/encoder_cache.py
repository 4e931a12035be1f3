"""Which image embeddings the workers hold, so that each image is encoded once while
sequences still need it, and how much encoder work one step may do.

The workers keep one entry per image hash (``quire.executor.encoder_cache``); this class
mirrors their rule exactly, so that no message has to say what to drop:

- each occurrence of an image in a sequence's prompt (the same image may be given
  twice) becomes a user of the image when a step reaches its placeholder tokens; the
  step carries the image's inputs when no entry exists before it;
- it stops being one at the end of the step that reaches its last placeholder token, or
  when its sequence is released (finished, aborted, preempted);
- an entry without users is dropped.

Users are occurrences, not sequences: a sequence holds an image only while it is inside
one, so every entry belongs to prefills under way, which always move on, and a step
that cannot fit a new image never waits on a holder that waits for room itself.

The engine drops a preempted sequence's use at once, the workers after the step that
tells them; so the engine's users are always a subset of the workers', and an image the
engine counts as held is held. A preempted sequence keeps nothing: when it is admitted
again the prefix cache usually covers its image tokens (their pages are named by the
image's hash), and any image past the cached prefix is encoded again.

Sizes are in embeddings (placeholder tokens). One step encodes at most ``budget`` of
them and the entries hold at most ``capacity``, except that a single image always fits
an empty step and an empty cache, so a large image never waits forever.
"""

from __future__ import annotations

from collections.abc import Sequence

from quire.multimodal.inputs import MMItem


class EncoderCache:
    """The engine's mirror of the workers' image-embedding entries."""

    def __init__(self, budget: int, capacity: int) -> None:
        self.budget = budget
        self.capacity = capacity
        self._users: dict[int, set[tuple[int, int]]] = {}  # hash -> (seq_id, item index)
        self._size: dict[int, int] = {}
        self.held = 0  # embeddings held, summed over entries
        #: Images encoded so far (statistic).
        self.encoded = 0

    def holds(self, image_hash: int) -> bool:
        return image_hash in self._users

    def fits(self, n: int, step_used: int) -> bool:
        """Whether an image of ``n`` embeddings may be encoded in a step that already
        encodes ``step_used``."""
        step_ok = step_used == 0 or step_used + n <= self.budget
        return step_ok and (self.held == 0 or self.held + n <= self.capacity)

    def use(self, seq_id: int, items: Sequence[MMItem], start: int, end: int) -> None:
        """A step computes positions ``start .. end`` of sequence ``seq_id``: the images
        there become its (new entries for those not held), and at the step's end those
        whose last placeholder token it reaches are done."""
        done = []
        for index, item in enumerate(items):
            if not item.touches(start, end):
                continue
            h = item.hash
            if h not in self._users:
                self._users[h] = set()
                self._size[h] = item.num_embeds
                self.held += item.num_embeds
                self.encoded += 1
            self._users[h].add((seq_id, index))
            if item.end <= end:
                done.append((h, index))
        for h, index in done:
            self._drop(h, (seq_id, index))

    def release(self, seq_id: int, items: Sequence[MMItem]) -> None:
        """Sequence ``seq_id`` no longer uses any of its images."""
        for index, item in enumerate(items):
            if item.hash in self._users:
                self._drop(item.hash, (seq_id, index))

    def _drop(self, image_hash: int, user: tuple[int, int]) -> None:
        users = self._users[image_hash]
        users.discard(user)
        if not users:
            del self._users[image_hash]
            self.held -= self._size.pop(image_hash)
