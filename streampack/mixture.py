"""Weighted mixtures: the deterministic order in which an epoch visits several sources.

A mixture lists sources with weights, say A: 3 and B: 1. Each epoch interleaves their
documents by *smooth weighted round-robin* (the schedule nginx balances with): every
step, each source's credit grows by its weight, the source with the most credit (the
lowest index on a tie) is picked and pays the sum of all weights. With integer weights
the picks repeat with a period of ``sum(weights)``, and in every prefix of the stream
each source's count is within one of its exact share::

    weights  A=3 B=1                    credit before the pick   pick
    step 0                               A 3  B 1                 A  (A 3-4 = -1)
    step 1                               A 2  B 2                 A  (tie: lowest index)
    step 2                               A 1  B 3                 B  (B 3-4 = -1)
    step 3                               A 4  B 0                 A  -> back to A 0 B 0
    period   A A B A | A A B A | ...

The n-th pick of a source takes its n-th document in the source's own order for the
epoch: corpus order, or with ``shuffle`` a permutation drawn from ``(seed, epoch,
source, cycle)``. So the stream depends only on (seed, epoch, weights, source sizes),
never on workers or timing.

When is an epoch over? ``stopping`` says, with the names Hugging Face's
``interleave_datasets`` uses:

* ``first_exhausted`` (default): the epoch ends at the first pick of a source that has
  no document left. No document repeats within an epoch; the larger sources are cut
  short (the next epoch starts them over, in a new order).
* ``all_exhausted``: a source that runs out starts over (its next *cycle*, a new order
  when shuffled) until every source has been visited whole at least once; the epoch
  ends at the first pick of a source that runs out when all others already have. Small
  sources repeat; no document of any source is left out.

With sizes ``n_k`` the epoch's length is ``min_k T_k`` or ``max_k T_k``, where ``T_k``
is the step of source ``k``'s pick number ``n_k`` (counting from 0): the first pick
that finds it empty.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from streampack.corpus.reader import Record
from streampack.errors import InvalidConfig

STOPPING = ("first_exhausted", "all_exhausted")

#: Largest period (sum of the weights reduced to integers) accepted: the schedule holds
#: one period, 8 bytes a step. Weights like 0.7/0.3 or 3/1 have periods of 10 and 4.
MAX_PERIOD = 1 << 20


def integer_weights(weights: Sequence[float | int]) -> tuple[int, ...]:
    """``weights`` as the smallest integers in the same exact ratios.

    Each weight is read as the decimal it prints as (0.1 is 1/10, not the binary
    fraction nearest to it), so the schedule is the one the manifest's text describes.
    """
    if not weights:
        raise InvalidConfig("a mixture needs at least one source with a weight")
    fractions = []
    for i, weight in enumerate(weights):
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not (math.isfinite(weight) and weight > 0)
        ):
            raise InvalidConfig(f"source {i}: weight {weight!r} must be a positive finite number")
        fractions.append(Fraction(repr(weight)) if isinstance(weight, float) else Fraction(weight))
    denominator = math.lcm(*(f.denominator for f in fractions))
    scaled = [int(f * denominator) for f in fractions]
    divisor = math.gcd(*scaled)
    result = tuple(w // divisor for w in scaled)
    if sum(result) > MAX_PERIOD:
        raise InvalidConfig(
            f"weights {list(weights)} are in the ratios {list(result)}, a schedule period of "
            f"{sum(result)} steps; at most {MAX_PERIOD} are accepted: round the weights "
            f"(e.g. to 3 significant digits)"
        )
    return result


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The smooth weighted round-robin over sources with these weights (module doc).

    ``pattern[t]`` is the source picked at step ``t`` of one period; the pattern repeats.
    """

    weights: tuple[int, ...]
    pattern: np.ndarray  # int64 source per step of one period
    before: np.ndarray  # int64 per step: earlier steps of the period picking that source
    steps: tuple[np.ndarray, ...]  # per source: the steps of the period that pick it

    @classmethod
    def of(cls, weights: Sequence[float | int]) -> Schedule:
        reduced = integer_weights(weights)
        period = sum(reduced)
        pattern = np.empty(period, np.int64)
        credit = [0] * len(reduced)
        for t in range(period):
            for k, w in enumerate(reduced):
                credit[k] += w
            pick = max(range(len(reduced)), key=lambda k: (credit[k], -k))
            credit[pick] -= period
            pattern[t] = pick
        steps = tuple(np.flatnonzero(pattern == k) for k in range(len(reduced)))
        before = np.empty(period, np.int64)
        for where in steps:
            before[where] = np.arange(len(where))
        return cls(weights=reduced, pattern=pattern, before=before, steps=steps)

    @property
    def period(self) -> int:
        return len(self.pattern)

    def picks(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps ``lo..hi-1``: the source each picks, and which pick of that source it
        is (0 for its first)."""
        t = np.arange(lo, hi, dtype=np.int64)
        cycle, step = np.divmod(t, self.period)
        source = self.pattern[step]
        weight = np.asarray(self.weights, np.int64)[source]
        return source, cycle * weight + self.before[step]

    def step_of_pick(self, source: int, n: int) -> int:
        """The step at which ``source`` makes its pick number ``n`` (from 0)."""
        cycle, within = divmod(n, self.weights[source])
        return cycle * self.period + int(self.steps[source][within])

    def epoch_length(self, sizes: Sequence[int], stopping: str) -> int:
        """Documents (steps) in an epoch over sources of these sizes (module doc)."""
        if stopping not in STOPPING:
            raise InvalidConfig(f"stopping {stopping!r}; expected one of {STOPPING}")
        if len(sizes) != len(self.weights):
            raise InvalidConfig(f"{len(sizes)} source sizes for {len(self.weights)} weights")
        ends = [self.step_of_pick(k, n) for k, n in enumerate(sizes)]
        return min(ends) if stopping == "first_exhausted" else max(ends)


def permutation(size: int, seed: int, epoch: int, source: int, cycle: int) -> np.ndarray:
    """The order of one source's documents in one cycle of a shuffled epoch."""
    return (
        np.random.default_rng([seed, epoch, source, cycle, 0x313C])
        .permutation(size)
        .astype(np.int64)
    )


def epoch_order(
    schedule: Schedule,
    sizes: Sequence[int],
    stopping: str,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The documents an epoch visits, in order: ``(source, document)`` arrays, where
    ``document`` is the position within its source (8 bytes each per step)."""
    length = schedule.epoch_length(sizes, stopping)
    source, pick = schedule.picks(0, length)
    document = np.empty(length, np.int64)
    for k, size in enumerate(sizes):
        mine = np.flatnonzero(source == k)
        cycle, within = np.divmod(pick[mine], size)
        if not shuffle:
            document[mine] = within
            continue
        for c in np.unique(cycle).tolist():
            in_cycle = cycle == c
            document[mine[in_cycle]] = permutation(size, seed, epoch, k, c)[within[in_cycle]]
    return source, document


class EpochOrder:
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
            held = (cycle, permutation(self.sizes[source], self.seed, self.epoch, source, cycle))
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


# --- long documents -------------------------------------------------------------------

LONG_DOCUMENTS = ("quarantine", "split")


def split_ranges(
    start: np.ndarray, stop: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut each range ``[start[i], stop[i])`` into consecutive ranges of at most ``limit``
    tokens (``capacity + 1``: one row's worth of pairs)::

        document   t0 t1 t2 t3 t4 t5 t6 t7 t8 t9      limit = 4
        ranges     [t0 t1 t2 t3] [t4 t5 t6 t7] [t8 t9]
        pairs      t0>t1 t1>t2 t2>t3 | t4>t5 ... | t8>t9     lost: t3>t4 and t7>t8

    Each range is its own example: its pairs stay inside it (rule C1), so the one pair
    across each cut is not formed. A last range of a single token holds no pair and is
    not formed either (it would break C1); its cut still costs that one pair.

    Returns ``(owner, piece_start, piece_stop, pairs_cut)``: per range formed, the index
    of the range it came from and its bounds, in order; per input range, the pairs
    lost, ``(stop - start - 1) - sum(piece pairs)``.
    """
    if limit < 2:
        raise InvalidConfig(f"split limit {limit}: a range needs at least 2 tokens")
    start = np.asarray(start, np.int64)
    span = np.asarray(stop, np.int64) - start
    pieces = np.maximum(-(-span // limit), 0)
    owner = np.repeat(np.arange(len(span), dtype=np.int64), pieces)
    first_piece = np.cumsum(pieces) - pieces
    j = np.arange(int(pieces.sum()), dtype=np.int64) - first_piece[owner]
    piece_start = start[owner] + j * limit
    piece_stop = np.minimum(piece_start + limit, start[owner] + span[owner])
    formed = piece_stop - piece_start >= 2
    owner, piece_start, piece_stop = owner[formed], piece_start[formed], piece_stop[formed]
    kept_pairs = np.bincount(
        owner, weights=piece_stop - piece_start - 1, minlength=len(span)
    ).astype(np.int64)
    pairs_cut = np.maximum(span - 1, 0) - kept_pairs
    return owner, piece_start, piece_stop, pairs_cut


def long_documents_policy(entry: dict[str, Any], where: str) -> str:
    """A source entry's ``long_documents`` (default ``quarantine``), checked."""
    policy = entry.get("long_documents", "quarantine")
    if policy not in LONG_DOCUMENTS:
        raise InvalidConfig(
            f"{where}: long_documents {policy!r}; expected one of {', '.join(LONG_DOCUMENTS)}"
        )
    return str(policy)


# --- the mixture reader -----------------------------------------------------------------


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
        long_documents: Sequence[str],
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
        if stopping not in STOPPING:
            raise InvalidConfig(
                f"{where}: stopping {stopping!r}; expected one of {', '.join(STOPPING)}"
            )
        self.readers = list(readers)
        self.schedule = Schedule.of(weights)
        self.stopping = stopping
        self.long_documents = tuple(long_documents)
        self.binding = binding
        self.sizes = [int(n) for n in sizes]
        self.random_access = all(r.random_access for r in readers)
        self._first = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_documents = int(self._first[-1])
        self._split = np.array([p == "split" for p in self.long_documents], bool)

    def source_index(self, ids: np.ndarray) -> np.ndarray:
        """int32: the source of each document id."""
        return (np.searchsorted(self._first, ids, side="right") - 1).astype(np.int32)

    def splits(self, ids: np.ndarray) -> np.ndarray:
        """bool: whether each document's source splits long documents."""
        return self._split[self.source_index(ids)]

    def epoch_order(self, epoch: int, shuffle: bool, seed: int) -> EpochOrder:
        """The document ids an epoch visits, in order (see module doc), worked out a
        slice at a time."""
        return EpochOrder(
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
                    permutation(self.sizes[k], seed, epoch, k, cycle)
                    if shuffle
                    else range(self.sizes[k])
                )
                return (self._record(k, int(i)) for i in order)
            records = reader.records()
            if shuffle:
                rng = np.random.default_rng([seed, epoch, k, cycle, 0x313C])
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
        return Record(
            source_id=i,
            tokens=np.asarray(tokens, np.int64),
            start=0,
            stop=int(lengths[0]),
            example_id=i,
            reason="wrong_dtype" if bad else None,
            detail="stored tokens are not of an accepted integer dtype" if bad else "",
            location=reader.location(i),
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


def open_mixture(
    root: Any, data: dict[str, Any], binding: Any, where: str, *, allow_outside: bool = False
) -> MixtureReader:
    """The mixture a manifest's ``sources`` list describes (see docs/service.md)::

    "sources": [{"weight": 3, "shards": ["web-000"]},
                {"weight": 1, "shards": ["code-000"], "long_documents": "split"}],
    "stopping": "first_exhausted"
    """
    from streampack.corpus.manifest import open_source

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
    readers, weights, policies = [], [], []
    for k, entry in enumerate(entries):
        here = f"{where} source {k}"
        if "weight" not in entry:
            raise InvalidConfig(f"{here}: no weight; every source of a mixture needs one")
        weights.append(entry["weight"])
        policies.append(long_documents_policy(entry, here))
        readers.append(open_source(root, entry, binding, here, allow_outside=allow_outside))
    integer_weights(weights)  # the weights' own errors first, naming the source
    return MixtureReader(
        readers,
        weights,
        stopping=data.get("stopping", "first_exhausted"),
        long_documents=policies,
        binding=binding,
        where=where,
    )
