"""The sampler's randomness: Exponential(1) noise for the exponential race.

Sampling token ``i`` with probability ``p_i`` is done as ``argmax_i p_i / E_i`` with
independent ``E_i ~ Exponential(1)``: ``E_i / p_i`` is exponential with rate ``p_i``, and
the smallest of independent exponentials is ``i`` with probability ``p_i / sum(p)``. It
needs one noise row per batch row, so a seeded row can take its whole row from its own
generator and its tokens do not depend on what else is in the batch.

:class:`NoiseSource` owns every generator: the engine-wide one (unseeded rows) and one
per seeded sequence, created on that sequence's first random step from its
``params.seed`` and dropped by :meth:`NoiseSource.release`.
"""

from __future__ import annotations

import torch


class NoiseSource:
    """Owns the generators; one per sampler (so one per engine)."""

    def __init__(self, seed: int):
        self._seed = seed
        self._shared: torch.Generator | None = None
        self._per_seq: dict[int, torch.Generator] = {}

    def exponential(self, num_rows: int, vocab_size: int, device: torch.device,
                    seeded: list[tuple[int, int, int]],
                    unseeded: torch.Tensor | None) -> torch.Tensor:
        """Noise [num_rows, vocab_size], float32, strictly positive.

        :param seeded: (row, seq_id, seed) for each row with its own seed; each such row
            takes exactly ``vocab_size`` draws from its sequence's generator per call.
        :param unseeded: int64 row indices drawn from the shared generator; None when
            there are none.
        """
        noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        if unseeded is not None:
            shared = self._shared_generator(device)
            if len(unseeded) == num_rows:
                noise.exponential_(generator=shared)
            else:
                noise[unseeded] = torch.empty(len(unseeded), vocab_size, device=device,
                                              dtype=torch.float32).exponential_(
                                                  generator=shared)
        for row, seq_id, seed in seeded:
            noise[row].exponential_(generator=self._seq_generator(seq_id, seed, device))
        # An exact 0 would turn a masked token's 0/0 into NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def uniform(self, num_rows: int, device: torch.device,
                seeded: list[tuple[int, int, int]],
                unseeded: torch.Tensor | None) -> torch.Tensor:
        """One Uniform[0, 1) draw per row, float32 [num_rows] (speculative decoding's
        acceptance tests), from the same generators as :meth:`exponential`: a seeded
        row takes exactly one draw from its sequence's generator."""
        draws = torch.empty(num_rows, dtype=torch.float32, device=device)
        if unseeded is not None:
            shared = self._shared_generator(device)
            if len(unseeded) == num_rows:
                draws.uniform_(generator=shared)
            else:
                draws[unseeded] = torch.empty(len(unseeded), dtype=torch.float32,
                                              device=device).uniform_(generator=shared)
        for row, seq_id, seed in seeded:
            draws[row : row + 1].uniform_(generator=self._seq_generator(seq_id, seed, device))
        return draws

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's generator; unknown ids are ignored."""
        self._per_seq.pop(seq_id, None)

    def num_seq_generators(self) -> int:
        return len(self._per_seq)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._shared is None:
            self._shared = _generator(device, self._seed)
        elif self._shared.device != device:
            raise ValueError(f"the sampler's generator lives on {self._shared.device}, "
                             f"but these logits are on {device}")
        return self._shared

    def _seq_generator(self, seq_id: int, seed: int, device: torch.device) -> torch.Generator:
        gen = self._per_seq.get(seq_id)
        if gen is None:
            gen = self._per_seq[seq_id] = _generator(device, seed)
        return gen


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
