"""Which image embeddings the workers hold, so that each image is encoded once while
sequences still need it, and how much encoder work one step may do.

The workers keep one entry per image hash (``quire.executor.encoder_cache``); this class
mirrors their rule exactly, so that no message has to say what to drop:

- a sequence becomes a user of an image when a step of it reaches the image's
  placeholder tokens; the step carries the image's inputs when no entry exists;
- it stops being one in the step that reaches the image's last placeholder token, or
  when it is released (finished, aborted, preempted);
- an entry without users is dropped.

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

from collections.abc import Iterable

from quire.multimodal.inputs import MMItem


class EncoderCache:
    """The engine's mirror of the workers' image-embedding entries."""

    def __init__(self, budget: int, capacity: int) -> None:
        self.budget = budget
        self.capacity = capacity
        self._users: dict[int, set[int]] = {}
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

    def use(self, seq_id: int, items: Iterable[MMItem], start: int, end: int) -> None:
        """A step computes positions ``start .. end`` of sequence ``seq_id``: it becomes
        a user of the images there (new entries for those not held), and stops using
        those whose last placeholder token the step reaches."""
        for item in items:
            if not item.touches(start, end):
                continue
            h = item.hash
            if h not in self._users:
                self._users[h] = set()
                self._size[h] = item.num_embeds
                self.held += item.num_embeds
                self.encoded += 1
            self._users[h].add(seq_id)
            if item.end <= end:
                self._drop(h, seq_id)

    def release(self, seq_id: int, items: Iterable[MMItem]) -> None:
        """Sequence ``seq_id`` no longer uses any of its images."""
        for item in items:
            if item.hash in self._users:
                self._drop(item.hash, seq_id)

    def _drop(self, image_hash: int, seq_id: int) -> None:
        users = self._users[image_hash]
        users.discard(seq_id)
        if not users:
            del self._users[image_hash]
            self.held -= self._size.pop(image_hash)
