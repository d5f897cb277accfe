"""Step targets: how many loss-eligible targets each optimizer step of the stream has.

A step is ``world_size * accumulation`` consecutive global batches
(``streampack.loss.step_range``); every batch goes out with the targets of its whole
step, so a trainer divides its NLL sum by the step's count with no communication.
The producer records the count of every batch it numbers (a few bytes a batch, per
epoch still in use) and answers a fetch only once every batch of the key's step is
numbered, or the epoch's end has cut the step short. The wait this adds is at most
one step of batches, held under the reorder budget like a drop tail's groups.
"""

from __future__ import annotations

import numpy as np

from ..loss import step_range

_UNKNOWN = -1


class StepTargets:
    """Supervised targets of every numbered batch, per epoch (``-1``: not numbered)."""

    def __init__(self, accumulation: int) -> None:
        self.accumulation = accumulation
        self._counts: dict[int, np.ndarray] = {}

    def record(self, epoch: int, index: int, targets: int) -> None:
        counts = self._counts.get(epoch)
        if counts is None or index >= len(counts):
            grown = np.full(max(64, 2 * (index + 1)), _UNKNOWN, np.int64)
            if counts is not None:
                grown[: len(counts)] = counts
            counts = self._counts[epoch] = grown
        counts[index] = targets

    def of_step(
        self, epoch: int, index: int, world_size: int, base: int, end: int | None
    ) -> int | None:
        """The targets of the step of batch ``index`` for ranks of ``world_size`` whose
        shares start at ``base``; ``end``: the first index past the epoch's batches in
        any share (fillers and a drop tail's leftovers count 0), None while unknown.
        None when some batch of the step is not numbered yet."""
        first, stop = step_range(index, world_size, self.accumulation, base)
        if end is not None:
            stop = min(stop, end)
        if stop <= first:
            return 0
        counts = self._counts.get(epoch)
        if counts is None or stop > len(counts):
            return None
        part = counts[first:stop]
        if (part == _UNKNOWN).any():
            return None
        return int(part.sum())

    def forget_before(self, epoch: int) -> None:
        """Drop the counts of epochs no consumer can still be in (a rewind into one
        renumbers its batches, and with them the counts)."""
        for old in [e for e in self._counts if e < epoch]:
            del self._counts[old]

    @property
    def nbytes(self) -> int:
        return sum(counts.nbytes for counts in self._counts.values())
