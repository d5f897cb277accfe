"""The order an epoch visits documents in: a permutation per shuffled epoch (of a corpus,
or of one mixture source's cycle), a mixture's order a slice at a time, and the bounded
shuffle buffer of a sequential reader. Each is a function of ``(seed, epoch, ...)``
only, so the stream never depends on workers or timing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from streampack.corpus.reader import Block
from streampack.corpus.schedule import Schedule


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of one shuffled epoch of a single-source corpus."""
    return np.random.default_rng([seed, epoch, 0x5EED])


def corpus_permutation(num_documents: int, seed: int, epoch: int) -> np.ndarray:
    """The document order of a shuffled epoch of a single-source corpus."""
    return epoch_rng(seed, epoch).permutation(num_documents).astype(np.int64, copy=False)


def source_rng(seed: int, epoch: int, source: int, cycle: int) -> np.random.Generator:
    """The generator of one cycle of one mixture source in a shuffled epoch."""
    return np.random.default_rng([seed, epoch, source, cycle, 0x313C])


def source_permutation(size: int, seed: int, epoch: int, source: int, cycle: int) -> np.ndarray:
    """The order of one mixture source's documents in one cycle of a shuffled epoch."""
    return source_rng(seed, epoch, source, cycle).permutation(size).astype(np.int64)


class MixtureOrder:
    """The document ids of one mixture epoch as a sequence sliced in order, without
    holding the whole epoch: ``order[lo:hi]`` works out steps ``lo..hi-1`` from the
    schedule. A shuffled source keeps the permutation of its current cycle (8 bytes per
    document of the source, as a shuffled single corpus does)."""

    def __init__(
        self,
        schedule: Schedule,
        sizes: Sequence[int],
        stopping: str,
        first: np.ndarray,
        *,
        shuffle: bool,
        seed: int,
        epoch: int,
    ) -> None:
        self.schedule, self.sizes, self.first = schedule, list(sizes), first
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        self.length = schedule.epoch_length(sizes, stopping)
        self._permutations: dict[int, tuple[int, np.ndarray]] = {}  # source -> cycle, order

    def __len__(self) -> int:
        return self.length

    def _order(self, source: int, cycle: int) -> np.ndarray:
        held = self._permutations.get(source)
        if held is None or held[0] != cycle:
            held = (
                cycle,
                source_permutation(self.sizes[source], self.seed, self.epoch, source, cycle),
            )
            self._permutations[source] = held
        return held[1]

    def __getitem__(self, steps: slice) -> np.ndarray:
        lo, hi, stride = steps.indices(self.length)
        if stride != 1:
            raise IndexError("an epoch order is read in slices of consecutive steps")
        source, pick = self.schedule.picks(lo, max(lo, hi))
        ids = np.empty(len(source), np.int64)
        for k in np.unique(source).tolist():
            mine = np.flatnonzero(source == k)
            cycle, within = np.divmod(pick[mine], self.sizes[k])
            if self.shuffle:
                for c in np.unique(cycle).tolist():
                    in_cycle = cycle == c
                    within[in_cycle] = self._order(k, c)[within[in_cycle]]
            ids[mine] = self.first[k] + within
        return ids


def buffered_shuffle(items: Iterator[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """A bounded shuffle buffer: emit a uniformly chosen held item per new item."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        slot = int(rng.integers(len(buffer)))
        yield buffer[slot]
        buffer[slot] = item
    while buffer:
        slot = int(rng.integers(len(buffer)))
        buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
        yield buffer.pop()


def buffered_shuffle_blocks(
    blocks: Iterator[Block], size: int, rng: np.random.Generator
) -> Iterator[Block]:
    """:func:`buffered_shuffle` over the documents of ``blocks``: the same documents in
    the same order (the same draws from ``rng``), a block at a time.

    The buffer is a block of its held documents, slot ``i`` its document ``i``. Each
    incoming block first fills it; every further document draws the slot it replaces
    (one ``rng.integers(size, size=m)`` call gives the draws one call per document
    would), the emitted documents leave as one block and the held ones are gathered
    into the next buffer — so memory is the buffer, one block and what was emitted,
    never the blocks a long-held document came from."""
    from streampack.kernels.corpus_cpu import shuffle_buffer_drain, shuffle_buffer_steps

    held: Block | None = None
    for block in blocks:
        room = size - (0 if held is None else len(held))
        if room > 0:
            fill = block.slice(0, min(room, len(block)))
            held = fill if held is None else Block.concat([held, fill])
            if len(block) <= room:
                continue
            block = block.slice(room, len(block))
        assert held is not None
        m = len(block)
        slots = rng.integers(size, size=m).astype(np.int64, copy=False)
        buffer = np.arange(size, dtype=np.int64)  # slot -> document of ``pool``
        emitted = np.empty(m, np.int64)
        shuffle_buffer_steps(buffer, slots, np.arange(size, size + m, dtype=np.int64), emitted)
        # Taken from the buffer and the block as one, without joining them first.
        yield Block.gather([held, block], emitted)
        held = Block.gather([held, block], buffer)
    if held is None or not len(held):
        return
    n = len(held)
    # One call with a falling bound draws what n calls with bounds n, n-1, ... 1 would.
    slots = rng.integers(np.arange(n, 0, -1, dtype=np.int64)).astype(np.int64, copy=False)
    emitted = np.empty(n, np.int64)
    shuffle_buffer_drain(np.arange(n, dtype=np.int64), slots, emitted)
    yield held.take(emitted)
