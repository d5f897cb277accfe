"""Weighted mixtures: several sources read as one corpus, in the order of their schedule.

The schedule (:mod:`streampack.corpus.schedule`) says which source each step picks;
the n-th pick of a source takes its n-th document in the source's own order for the
epoch (:mod:`streampack.corpus.order`). A manifest's ``sources`` list describes one.

Supervision masks are per source. A mixture is masked when any of its sources is, and
then the documents of its unmasked sources carry an all-ones mask (every target
trained, as without masks): a window's mask is present exactly when the corpus has a
masked source, whatever the window holds, so a masked corpus never changes shape from
one window to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from streampack.corpus.order import MixtureOrder, buffered_shuffle, source_permutation, source_rng
from streampack.corpus.reader import WRONG_DTYPE_DETAIL, Record
from streampack.corpus.schedule import Schedule, check_stopping, integer_weights
from streampack.corpus.sources import open_source
from streampack.errors import InvalidConfig


class MixtureReader:
    """Several sources as one: document ``first[k] + i`` is document ``i`` of source
    ``k`` (its source id), and each epoch visits them in the mixture's order instead of
    corpus order or one permutation. With random access in every source, the window cut
    reads the order a slice at a time (``epoch_order``); otherwise it reads documents one
    by one (``epoch_records``), each sequential source through its own seeded shuffle
    buffer."""

    def __init__(
        self,
        readers: Sequence[Any],
        weights: Sequence[float | int],
        *,
        stopping: str,
        binding: Any,
        where: str,
    ) -> None:
        # A sequential source's size, when its reader does not know it, is counted once
        # here (a pass over its files): the schedule's epoch length needs it.
        sizes = [
            r.num_documents if r.num_documents is not None else sum(1 for _ in r.records())
            for r in readers
        ]
        for k, size in enumerate(sizes):
            if size == 0:
                raise InvalidConfig(f"{where}: source {k} holds no documents")
        self.readers = list(readers)
        self.schedule = Schedule.of(weights)
        self.stopping = check_stopping(stopping, where)
        self.binding = binding
        self.sizes = [int(n) for n in sizes]
        self.random_access = all(r.random_access for r in readers)
        self._first = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_documents = int(self._first[-1])
        # Each source's own long_documents policy, set from its entry by open_source.
        self._split = np.array([r.long_documents == "split" for r in readers], bool)
        self.masked = any(r.masked for r in readers)

    def source_index(self, ids: np.ndarray) -> np.ndarray:
        """int32: the source of each document id."""
        return (np.searchsorted(self._first, ids, side="right") - 1).astype(np.int32)

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """bool: whether each document's source splits long documents."""
        return self._split[self.source_index(ids)]

    def epoch_order(self, epoch: int, shuffle: bool, seed: int) -> MixtureOrder:
        """The document ids an epoch visits, in order (see module doc), worked out a
        slice at a time."""
        return MixtureOrder(
            self.schedule,
            self.sizes,
            self.stopping,
            self._first,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
        )

    def epoch_records(
        self, epoch: int, shuffle: bool, seed: int, shuffle_buffer: int
    ) -> Iterator[Record]:
        """The documents an epoch visits, in order, one record each (source ids and
        locations those of the mixture)."""
        streams: dict[int, tuple[int, Iterator[Record]]] = {}  # source -> cycle, records

        def read(k: int, cycle: int) -> Iterator[Record]:
            reader = self.readers[k]
            if reader.random_access:
                order = (
                    source_permutation(self.sizes[k], seed, epoch, k, cycle)
                    if shuffle
                    else range(self.sizes[k])
                )
                return (self._record(k, int(i)) for i in order)
            records = reader.records()
            if shuffle:
                rng = source_rng(seed, epoch, k, cycle)
                records = buffered_shuffle(records, shuffle_buffer, rng)
            return records

        length = self.schedule.epoch_length(self.sizes, self.stopping)
        for lo in range(0, length, 4096):
            sources, picks = self.schedule.picks(lo, min(length, lo + 4096))
            for k, pick in zip(sources.tolist(), picks.tolist()):
                cycle = pick // self.sizes[k]
                if k not in streams or streams[k][0] != cycle:
                    streams[k] = (cycle, read(k, cycle))
                record = next(streams[k][1])
                yield dataclasses.replace(
                    record,
                    source_id=int(self._first[k]) + record.source_id,
                    example_id=(
                        int(self._first[k]) + record.example_id
                        if self.readers[k].random_access
                        else record.example_id
                    ),
                    location=f"source {k}: {record.location}",
                )

    def _record(self, k: int, i: int) -> Record:
        """Document ``i`` of random-access source ``k`` as a record (its own ids)."""
        reader, ids = self.readers[k], np.array([i], np.int64)
        lengths = reader.lengths(ids)
        tokens, ok = reader.gather(ids, lengths)
        bad = not bool(ok[0])
        mask = None
        if reader.masked and not bad:
            mask, _, problems = reader.gather_mask(ids, lengths, tokens)
            if problems:
                _, reason, detail = problems[0]
                return Record(i, None, 0, 0, i, reason, detail, reader.location(i))
            mask = np.asarray(mask)
        return Record(
            source_id=i,
            tokens=np.asarray(tokens, np.int64),
            start=0,
            stop=int(lengths[0]),
            example_id=i,
            reason="wrong_dtype" if bad else None,
            detail=WRONG_DTYPE_DETAIL if bad else "",
            location=reader.location(i),
            mask=mask,
        )

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(ids), np.int64)
        source = self.source_index(ids)
        for k in np.unique(source).tolist():
            mine = source == k
            out[mine] = self.readers[k].lengths(ids[mine] - self._first[k])
        return out

    def location(self, source_id: int) -> str:
        k = int(self.source_index(np.array([source_id]))[0])
        return f"source {k}: {self.readers[k].location(source_id - int(self._first[k]))}"

    @property
    def prefetch_bytes(self) -> int:
        """As ``OffsetsReader.prefetch_bytes``: the largest of the sources'."""
        return max(getattr(r, "prefetch_bytes", 0) for r in self.readers)

    def prefetch(self, ids: np.ndarray, lengths: np.ndarray) -> int:
        """As ``OffsetsReader.prefetch``: each source's documents of ``ids``."""
        source = self.source_index(ids)
        total = 0
        for k in np.unique(source).tolist():
            mine = source == k
            if getattr(self.readers[k], "prefetch_bytes", 0):
                total += self.readers[k].prefetch(ids[mine] - self._first[k], lengths[mine])
        return total

    def gather(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of documents ``ids`` concatenated in that order (each source gathers
        its own, in its dtype; int64 when some source's are), and dtype flags."""
        source = self.source_index(ids)
        parts = {}
        for k in np.unique(source).tolist():
            mine = np.flatnonzero(source == k)
            parts[k] = (mine, *self.readers[k].gather(ids[mine] - self._first[k], lengths[mine]))
        wide = any(
            np.dtype(tokens.dtype).itemsize > 4 or tokens.dtype == np.uint32
            for _, tokens, _ in parts.values()
        )
        tokens_out = np.empty(int(lengths.sum()), np.int64 if wide else np.int32)
        dtype_ok = np.ones(len(ids), bool)
        out_starts = np.cumsum(lengths) - lengths
        for mine, tokens, ok in parts.values():
            lens = lengths[mine]
            before = np.cumsum(lens) - lens
            destination = np.repeat(out_starts[mine] - before, lens) + np.arange(int(lens.sum()))
            tokens_out[destination] = tokens
            dtype_ok[mine] = ok
        return tokens_out, dtype_ok

    def gather_mask(
        self, ids: np.ndarray, lengths: np.ndarray, tokens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]]]:
        """As the sources' ``gather_mask``; an unmasked source's documents get ones."""
        source = self.source_index(ids)
        token_source = np.repeat(source, lengths)
        parts = {}
        problems: list[tuple[int, str, str]] = []
        mask_lengths = lengths.copy()
        for k in np.unique(source).tolist():
            mine = np.flatnonzero(source == k)
            reader = self.readers[k]
            if not reader.masked:
                parts[k] = (mine, np.ones(int(lengths[mine].sum()), np.uint8))
                continue
            values, own_lengths, found = reader.gather_mask(
                ids[mine] - self._first[k], lengths[mine], tokens[token_source == k]
            )
            mask_lengths[mine] = own_lengths
            parts[k] = (mine, values)
            problems += [(int(mine[j]), reason, detail) for j, reason, detail in found]
        dtypes = [np.asarray(values).dtype for _, values in parts.values()]
        mask = np.empty(int(mask_lengths.sum()), np.result_type(*dtypes) if dtypes else np.uint8)
        out_starts = np.cumsum(mask_lengths) - mask_lengths
        for mine, values in parts.values():
            lens = mask_lengths[mine]
            before = np.cumsum(lens) - lens
            mask[np.repeat(out_starts[mine] - before, lens) + np.arange(int(lens.sum()))] = values
        return mask, mask_lengths, sorted(problems)


def open_mixture(
    root: Any, data: dict[str, Any], binding: Any, where: str, *, allow_outside: bool = False
) -> MixtureReader:
    """The mixture a manifest's ``sources`` list describes (see docs/service.md)::

    "sources": [{"weight": 3, "shards": ["web-000"]},
                {"weight": 1, "shards": ["code-000"], "long_documents": "split"}],
    "stopping": "first_exhausted"
    """
    entries = data["sources"]
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) for e in entries)
    ):
        raise InvalidConfig(
            f"{where}: 'sources' must be a non-empty list of source objects, got {entries!r}"
        )
    if "long_documents" in data:
        raise InvalidConfig(f"{where}: give long_documents per source in a mixture")
    readers, weights = [], []
    for k, entry in enumerate(entries):
        here = f"{where} source {k}"
        if "weight" not in entry:
            raise InvalidConfig(f"{here}: no weight; every source of a mixture needs one")
        weights.append(entry["weight"])
        readers.append(open_source(root, entry, binding, here, allow_outside=allow_outside))
    integer_weights(weights)  # the weights' own errors first, naming the source
    return MixtureReader(
        readers,
        weights,
        stopping=data.get("stopping", "first_exhausted"),
        binding=binding,
        where=where,
    )
