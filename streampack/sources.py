"""Corpus readers and the deterministic cut of a corpus into windows.

A corpus is described by a JSON manifest (``manifest.json`` in a directory, or any
``*.json`` path)::

    {"format": "streampack-corpus", "version": 1,
     "binding": {"vocab_size": 512, "tokenizer": "...", "split_receipt": "...",
                 "partition": "train"},
     "shards": ["shard-000", "shard-001"]}        # token shards, in order
  or "jsonl": ["documents.jsonl"]                 # JSON Lines files, in order

A token shard ``NAME`` is two NumPy files next to the manifest: ``NAME.tokens.npy``
(int32, uint16 or uint32 tokens, memory-mapped) and ``NAME.offsets.npy`` (int64
document boundaries, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == len(tokens)``).
A JSON Lines file holds one document per line: ``{"tokens": [...]}`` with optional
``"id"`` (int, becomes the example id) and ``"start"``/``"stop"`` (the selected range;
default the whole document).

Every document has a *source id*: its position in the corpus (shards or lines in
manifest order, counting every line, malformed ones too). One example is selected
per document: its range, whole by default.

Windows
-------
An epoch visits the documents in corpus order, or, with ``shuffle``, in the order of a
permutation drawn from ``(seed, epoch)`` (token shards have random access) or through
a bounded shuffle buffer seeded the same way (JSON Lines are read once, in order). The
visited sequence is cut greedily into numbered windows: a window closes when it holds
``window_documents`` documents or when the next document would take it past
``window_tokens`` tokens. The cut counts every document, good or bad, so it depends on
the corpus and these settings only — never on workers or timing::

    lengths   5 3 9 2 | 7 7 1 | 8 ...      window_documents=4, window_tokens=20
    windows   [   0   ] [  1  ] [ 2 ...     (0 is full at 4 documents; 1 would pass 20
                                             tokens with the 8)

Each window is then *screened*, vectorized: a document is quarantined with a reason
when its range has fewer than 2 tokens (``too_short``), more than ``capacity + 1``
tokens (``too_long``), a token outside ``[0, vocab_size)`` anywhere in the document
(``out_of_vocabulary``), tokens that are not integers (``wrong_dtype``), an invalid
range (``bad_range``) or a line that is not a JSON document (``malformed``). The
surviving documents form the window's :class:`streampack.Examples`, which a worker
packs in one ``pack_examples`` call — which can therefore never fail on a document.

Memory: shards are memory-mapped and only one window's tokens are gathered at a time;
JSON Lines are read line by line. A shuffled shard epoch holds its permutation
(8 bytes per document); a shuffled JSON Lines epoch holds ``shuffle_buffer`` documents.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from streampack.errors import InvalidConfig
from streampack.examples import Binding
from streampack.wire import token_dtype

MANIFEST_FORMAT = "streampack-corpus"
MANIFEST_VERSION = 1

REASONS = (
    "too_short",
    "too_long",
    "out_of_vocabulary",
    "wrong_dtype",
    "bad_range",
    "malformed",
)

_TOKEN_DTYPES = {("i", 4), ("u", 2), ("u", 4)}


@dataclasses.dataclass(frozen=True)
class BindingSpec:
    """The binding fields of a manifest, as read; ``to_binding`` checks them."""

    vocab_size: int
    tokenizer: str
    split_receipt: str
    partition: str

    def to_binding(self) -> Binding:
        return Binding(
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            split_receipt=self.split_receipt,
            partition=self.partition,
        )


@dataclasses.dataclass
class Window:
    """One cut window after screening: the arrays a worker packs, plus what was dropped."""

    epoch: int
    index: int
    documents: int  # documents the window covers, quarantined ones included
    tokens: np.ndarray  # the surviving documents concatenated, in wire.token_dtype(vocab)
    offsets: np.ndarray  # int64, len(surviving) + 1
    start: np.ndarray  # int64 per surviving document: its selected range
    stop: np.ndarray
    source_id: np.ndarray  # int64: corpus position of each surviving document
    example_id: np.ndarray  # int64
    quarantined: list[dict[str, Any]]

    @functools.cached_property
    def whole_documents(self) -> bool:
        """Every document selected whole: its tokens are exactly
        ``tokens[offsets[i]:offsets[i + 1]]`` (token shards always; JSON Lines unless
        a line gives a narrower ``start``/``stop``)."""
        return bool((self.start == 0).all() and (self.stop == np.diff(self.offsets)).all())

    @property
    def nbytes(self) -> int:
        return int(
            self.tokens.nbytes
            + self.offsets.nbytes
            + self.start.nbytes * 5  # start, stop, source_id, example_id, doc
        )

    def selected_tokens(self, first: int, last: int) -> np.ndarray:
        """The tokens documents ``first..last-1`` select, concatenated — the
        ``tokens`` of a compact batch holding exactly those documents. A slice of the
        window's tokens (no copy) when each document is selected whole, as from token
        shards: consecutive batches partition the window's tokens, which are freed
        with the last of them. Otherwise a gather."""
        from streampack.packing import select_tokens

        if self.whole_documents:
            return self.tokens[self.offsets[first] : self.offsets[last]]
        tokens, _ = select_tokens(self.tokens, self.offsets,
                                  np.arange(first, last, dtype=np.int64),
                                  self.start[first:last], self.stop[first:last])
        return tokens

    def arrays(self) -> dict[str, np.ndarray]:
        """The window frames of the wire protocol, in order."""
        return {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "doc": np.arange(len(self.start), dtype=np.int64),
            "start": self.start,
            "stop": self.stop,
            "source_id": self.source_id,
            "example_id": self.example_id,
        }


def _read_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    if path.is_dir():
        path = path / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidConfig(
            f"cannot read corpus manifest {str(path)!r}: {exc}; give a manifest JSON file "
            f"or a directory holding manifest.json"
        ) from exc
    except json.JSONDecodeError as exc:
        raise InvalidConfig(f"corpus manifest {str(path)!r} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InvalidConfig(
            f"corpus manifest {str(path)!r} has format "
            f"{data.get('format') if isinstance(data, dict) else data!r}; "
            f"expected {MANIFEST_FORMAT!r}"
        )
    if data.get("version") != MANIFEST_VERSION:
        raise InvalidConfig(
            f"corpus manifest {str(path)!r} has version {data.get('version')!r}; "
            f"expected {MANIFEST_VERSION}"
        )
    return path.parent, data


def _binding_spec(data: dict[str, Any], where: str) -> BindingSpec:
    binding = data.get("binding")
    fields = ("vocab_size", "tokenizer", "split_receipt", "partition")
    if not isinstance(binding, dict) or set(binding) != set(fields):
        raise InvalidConfig(f"{where}: binding {binding!r} must have exactly the keys {fields}")
    vocab = binding["vocab_size"]
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise InvalidConfig(f"{where}: binding vocab_size {vocab!r} must be a positive int")
    if binding["partition"] not in ("train", "validation", "test"):
        raise InvalidConfig(
            f"{where}: binding partition {binding['partition']!r}; "
            f"expected train, validation or test"
        )
    return BindingSpec(
        vocab_size=vocab,
        tokenizer=str(binding["tokenizer"]),
        split_receipt=str(binding["split_receipt"]),
        partition=str(binding["partition"]),
    )


def open_corpus(path: str | Path) -> TokenShardSource | JsonlSource:
    """Open the corpus described by a manifest file or a directory holding one."""
    root, data = _read_manifest(Path(path))
    where = f"corpus {str(path)!r}"
    binding = _binding_spec(data, where)
    if ("shards" in data) == ("jsonl" in data):
        raise InvalidConfig(f"{where}: the manifest must list either 'shards' or 'jsonl'")
    names = data.get("shards", data.get("jsonl"))
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidConfig(f"{where}: expected a non-empty list of file names, got {names!r}")
    if "shards" in data:
        return TokenShardSource(root, names, binding)
    return JsonlSource([root / name for name in names], binding)


class TokenShardSource:
    """Token shards, memory-mapped; random access, so shuffles are full permutations."""

    random_access = True

    def __init__(self, root: Path, names: list[str], binding: BindingSpec) -> None:
        self.binding = binding
        self.names = list(names)
        self._tokens: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        self._dtype_ok: list[bool] = []
        counts = []
        for name in names:
            tokens_path = root / f"{name}.tokens.npy"
            offsets_path = root / f"{name}.offsets.npy"
            try:
                tokens = np.load(tokens_path, mmap_mode="r", allow_pickle=False)
                offsets = np.load(offsets_path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise InvalidConfig(f"cannot open token shard {name!r} in {root}: {exc}") from exc
            if offsets.ndim != 1 or offsets.dtype.kind != "i" or len(offsets) < 1:
                raise InvalidConfig(
                    f"shard {name!r}: offsets have dtype {offsets.dtype} and shape "
                    f"{offsets.shape}; expected a non-empty 1-D int64 array"
                )
            if tokens.ndim != 1:
                raise InvalidConfig(f"shard {name!r}: tokens shape {tokens.shape}; expected 1-D")
            if (
                offsets[0] != 0
                or offsets[-1] != len(tokens)
                or np.any(np.diff(np.asarray(offsets)) < 0)
            ):
                raise InvalidConfig(
                    f"shard {name!r}: offsets must start at 0, never decrease and end at "
                    f"len(tokens) = {len(tokens)}; got first {int(offsets[0])}, "
                    f"last {int(offsets[-1])}"
                )
            self._tokens.append(tokens)
            self._offsets.append(offsets)
            self._dtype_ok.append((tokens.dtype.kind, tokens.dtype.itemsize) in _TOKEN_DTYPES)
            counts.append(len(offsets) - 1)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_documents = int(self._first[-1])

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._first, ids, side="right") - 1

    def _shards_of(self, shard: np.ndarray) -> np.ndarray:
        """The distinct shards in ``shard`` (usually one: no sort needed then)."""
        if len(shard) and shard.min() == shard.max():
            return shard[:1]
        return np.unique(shard)

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Token counts of documents ``ids`` (corpus positions)."""
        out = np.empty(len(ids), dtype=np.int64)
        shard = self._locate(ids)
        for s in self._shards_of(shard):
            offsets = self._offsets[s]
            if len(ids) > 1 and shard[0] == shard[-1] and ids[-1] - ids[0] == len(ids) - 1 \
                    and (np.diff(ids) == 1).all():
                # A run of consecutive documents (no shuffle): one slice of the offsets.
                lo = int(ids[0] - self._first[s])
                out[:] = np.diff(np.asarray(offsets[lo : lo + len(ids) + 1]))
                return out
            sel = shard == s
            local = ids[sel] - self._first[s]
            out[sel] = np.asarray(offsets[local + 1]) - np.asarray(offsets[local])
        return out

    def location(self, source_id: int) -> str:
        shard = int(self._locate(np.array([source_id]))[0])
        return f"{self.names[shard]}#{source_id - int(self._first[shard])}"

    def gather(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of documents ``ids`` concatenated in that order, and dtype flags.

        Returns ``(tokens, dtype_ok)``. A run of consecutive documents of one shard (the
        common case) comes back as a read-only view of the memory map, in the shard's
        dtype: the screen reads it and makes the window's own copy. Otherwise tokens
        come back as int32 when every shard involved holds int32 or uint16, as int64
        when a uint32 shard is involved (its values may not fit int32; the vocabulary
        screen catches those). ``dtype_ok[i]`` is False for documents of a shard whose
        dtype is not int32/uint16/uint32; their tokens come back as zeros.
        """
        total = int(lengths.sum())
        shard = self._locate(ids)
        involved = self._shards_of(shard)
        wide = any(self._tokens[s].dtype.kind == "u" and self._tokens[s].dtype.itemsize == 4
                   for s in involved)
        dtype_ok = np.ones(len(ids), dtype=bool)
        if total and len(involved) == 1 and self._dtype_ok[int(involved[0])] \
                and ids[-1] - ids[0] == len(ids) - 1 and np.all(np.diff(ids) == 1):
            # Contiguous run in one shard: one slice of the memory map, not copied here.
            s = int(involved[0])
            lo = int(self._offsets[s][int(ids[0] - self._first[s])])
            return self._tokens[s][lo : lo + total], dtype_ok
        tokens = np.empty(total, dtype=np.int64 if wide else np.int32)
        if total == 0:
            return tokens, dtype_ok
        out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for s in involved:
            sel = np.flatnonzero(shard == s)
            lens = lengths[sel]
            n = int(lens.sum())
            if n == 0:
                continue
            before = np.cumsum(np.concatenate([[0], lens[:-1]]))
            dst_index = np.repeat(out_starts[sel] - before, lens) + np.arange(n)
            if not self._dtype_ok[s]:
                dtype_ok[sel] = False
                tokens[dst_index] = 0
                continue
            local = ids[sel] - self._first[s]
            src_starts = np.asarray(self._offsets[s][local])
            src_index = np.repeat(src_starts - before, lens) + np.arange(n)
            tokens[dst_index] = self._tokens[s][src_index]
        return tokens, dtype_ok


@dataclasses.dataclass
class _Record:
    """One JSON Lines document as read, before screening."""

    source_id: int
    tokens: np.ndarray | None  # int64, None when the line is unusable
    start: int
    stop: int
    example_id: int
    reason: str | None
    detail: str
    location: str


class JsonlSource:
    """JSON Lines files read lazily, line by line; shuffles use a bounded buffer."""

    random_access = False

    def __init__(self, paths: list[Path], binding: BindingSpec) -> None:
        self.binding = binding
        self.paths = list(paths)
        for path in self.paths:
            if not path.is_file():
                raise InvalidConfig(f"JSON Lines file {str(path)!r} does not exist")
        self.num_documents: int | None = None

    def records(self) -> Iterator[_Record]:
        source_id = 0
        for path in self.paths:
            with open(path, "rb") as handle:
                for line_number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    yield _parse_line(line, source_id, f"{path.name}:{line_number}")
                    source_id += 1


def _parse_line(line: bytes, source_id: int, location: str) -> _Record:
    def bad(reason: str, detail: str, tokens: np.ndarray | None = None) -> _Record:
        return _Record(source_id, tokens, 0, 0, source_id, reason, detail, location)

    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return bad("malformed", f"not JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        return bad("malformed", "expected an object with a 'tokens' list")
    raw = data["tokens"]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        kinds = sorted(
            {type(t).__name__ for t in raw if not isinstance(t, int) or isinstance(t, bool)}
        )
        return bad("wrong_dtype", f"tokens must be integers; found {kinds}")
    try:
        tokens = np.array(raw, dtype=np.int64)
    except OverflowError:
        return bad("out_of_vocabulary", "a token does not fit in 64 bits")
    example_id = data.get("id", source_id)
    if isinstance(example_id, bool) or not isinstance(example_id, int) or not (
        -(2**63) <= example_id < 2**63
    ):
        return bad("malformed", f"id {example_id!r} must be a 64-bit integer")
    start = data.get("start", 0)
    stop = data.get("stop", len(tokens))
    if (
        isinstance(start, bool)
        or isinstance(stop, bool)
        or not isinstance(start, int)
        or not isinstance(stop, int)
        or not 0 <= start <= stop <= len(tokens)
    ):
        return bad("bad_range", f"range [{start!r}, {stop!r}) is not inside 0..{len(tokens)}")
    return _Record(source_id, tokens, start, stop, example_id, None, "", location)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, 0x5EED])


def permutation(num_documents: int, seed: int, epoch: int) -> np.ndarray:
    """The document order of a shuffled epoch: a function of (seed, epoch) only."""
    return _rng(seed, epoch).permutation(num_documents).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CutSpec:
    """The settings that decide windows and screening (a subset of ProducerSettings)."""

    capacity: int
    window_documents: int
    window_tokens: int
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 4096

    @classmethod
    def from_settings(cls, settings: Any) -> CutSpec:
        return cls(
            capacity=settings.capacity,
            window_documents=settings.window_documents,
            window_tokens=settings.window_tokens,
            shuffle=settings.shuffle,
            seed=settings.seed,
            shuffle_buffer=settings.shuffle_buffer,
        )


def _cut(lengths: np.ndarray, spec: CutSpec) -> int:
    """How many of the next documents (``lengths``, at most window_documents) form a window."""
    cumulative = np.cumsum(lengths)
    return max(1, int(np.searchsorted(cumulative, spec.window_tokens, side="right")))


def _window_lengths(
    source: TokenShardSource, order: np.ndarray | None, position: int, end: int,
    window_tokens: int, first_chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """Ids and lengths of documents ``position..end`` of the epoch's order, read in
    doubling chunks (from ``first_chunk``) only until ``window_tokens`` is passed:
    enough for ``_cut``, which looks no further, and O(window) rather than
    O(window_documents) per window."""
    chunk, total, hi = first_chunk, 0, position
    id_parts, length_parts = [], []
    while hi < end and total <= window_tokens:
        lo, hi = hi, min(end, hi + chunk)
        ids = order[lo:hi] if order is not None else np.arange(lo, hi, dtype=np.int64)
        lengths = source.lengths(ids)
        id_parts.append(ids)
        length_parts.append(lengths)
        total += int(lengths.sum())
        chunk *= 2
    return np.concatenate(id_parts), np.concatenate(length_parts)


def iter_windows(
    source: TokenShardSource | JsonlSource, epoch: int, spec: CutSpec, *, start_window: int = 0
) -> Iterator[Window]:
    """The screened windows of ``epoch``, numbered from 0; those before ``start_window``
    are cut (to keep numbering) but neither gathered nor screened."""
    if isinstance(source, TokenShardSource):
        yield from _shard_windows(source, epoch, spec, start_window)
    else:
        yield from _jsonl_windows(source, epoch, spec, start_window)


def _shard_windows(
    source: TokenShardSource, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    n = source.num_documents
    order = permutation(n, spec.seed, epoch) if spec.shuffle else None
    position = 0
    index = 0
    k = 192
    while position < n:
        end = min(n, position + spec.window_documents)
        # The last window's size is a good first guess: usually one read suffices.
        ids, lengths = _window_lengths(source, order, position, end, spec.window_tokens,
                                       first_chunk=k + k // 4 + 16)
        k = _cut(lengths, spec)
        ids, lengths = ids[:k], lengths[:k]
        position += k
        if index >= start_window:
            tokens, dtype_ok = source.gather(ids, lengths)
            yield _screen(
                epoch,
                index,
                source.binding.vocab_size,
                spec.capacity,
                tokens,
                lengths,
                starts=np.zeros(k, dtype=np.int64),
                stops=lengths.copy(),
                source_ids=ids,
                example_ids=ids,
                premarked=[(i, "wrong_dtype", "shard tokens are not int32/uint16/uint32")
                           for i in np.flatnonzero(~dtype_ok).tolist()],
                locate=source.location,
            )
        index += 1


def _shuffled(records: Iterator[_Record], spec: CutSpec, epoch: int) -> Iterator[_Record]:
    """A bounded shuffle buffer: emit a uniformly chosen held record per new record."""
    rng = _rng(spec.seed, epoch)
    buffer: list[_Record] = []
    for record in records:
        if len(buffer) < spec.shuffle_buffer:
            buffer.append(record)
            continue
        slot = int(rng.integers(len(buffer)))
        yield buffer[slot]
        buffer[slot] = record
    while buffer:
        slot = int(rng.integers(len(buffer)))
        buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
        yield buffer.pop()


def _jsonl_windows(
    source: JsonlSource, epoch: int, spec: CutSpec, start_window: int
) -> Iterator[Window]:
    records = source.records()
    if spec.shuffle:
        records = _shuffled(records, spec, epoch)
    index = 0
    held: list[_Record] = []
    held_tokens = 0

    def flush() -> Window | None:
        if index < start_window:
            return None
        lengths = np.array(
            [0 if r.tokens is None else len(r.tokens) for r in held], dtype=np.int64
        )
        tokens = np.concatenate(
            [r.tokens for r in held if r.tokens is not None] or [np.zeros(0, np.int64)]
        )
        by_id = {r.source_id: r.location for r in held}
        return _screen(
            epoch,
            index,
            source.binding.vocab_size,
            spec.capacity,
            tokens,
            lengths,
            starts=np.array([r.start for r in held], dtype=np.int64),
            stops=np.array([r.stop for r in held], dtype=np.int64),
            source_ids=np.array([r.source_id for r in held], dtype=np.int64),
            example_ids=np.array([r.example_id for r in held], dtype=np.int64),
            premarked=[(i, r.reason, r.detail) for i, r in enumerate(held)
                       if r.reason is not None],
            locate=by_id.__getitem__,
        )

    for record in records:
        size = 0 if record.tokens is None else len(record.tokens)
        if held and held_tokens + size > spec.window_tokens:
            window = flush()
            if window is not None:
                yield window
            index += 1
            held, held_tokens = [], 0
        held.append(record)
        held_tokens += size
        if len(held) == spec.window_documents:
            window = flush()
            if window is not None:
                yield window
            index += 1
            held, held_tokens = [], 0
    if held:
        window = flush()
        if window is not None:
            yield window


def _screen(
    epoch: int,
    index: int,
    vocab_size: int,
    capacity: int,
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    starts: np.ndarray,
    stops: np.ndarray,
    source_ids: np.ndarray,
    example_ids: np.ndarray,
    premarked: list[tuple[int, str, str]],
    locate: Any,
) -> Window:
    """Quarantine the bad documents of one window, vectorized; keep the rest in order.

    ``premarked`` lists documents already known bad as (position, reason, detail). A
    clean window (the usual case) costs a few whole-window array operations: the
    per-document reasons are worked out only when something is bad."""
    span = stops - starts
    too_short = span < 2
    too_long = span > capacity + 1
    # Vocabulary: per-document min and max only when the window as a whole has a token
    # outside the vocabulary.
    out_of_vocabulary = None
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        nonempty = np.flatnonzero(lengths > 0)
        lo = np.zeros(len(lengths), dtype=np.int64)
        hi = np.zeros(len(lengths), dtype=np.int64)
        lo[nonempty] = np.minimum.reduceat(tokens, doc_starts[nonempty])
        hi[nonempty] = np.maximum.reduceat(tokens, doc_starts[nonempty])
        out_of_vocabulary = (lo < 0) | (hi >= vocab_size)

    reasons: dict[int, tuple[str, str]] = {i: (reason, detail) for i, reason, detail in premarked}
    checks = (
        ("too_short", too_short, lambda i: f"range has {span[i]} token(s); at least 2 needed"),
        ("too_long", too_long,
         lambda i: f"range has {span[i]} tokens; at most capacity + 1 = {capacity + 1} fit"),
        ("out_of_vocabulary", out_of_vocabulary,
         lambda i: f"tokens span [{lo[i]}, {hi[i]}]; vocabulary is [0, {vocab_size})"),
    )
    for name, bad, describe in checks:
        if bad is None:
            continue
        for i in np.flatnonzero(bad).tolist():  # first reason found wins
            if i not in reasons:
                reasons[i] = (name, describe(i))
    quarantined = [
        {
            "epoch": epoch,
            "window": index,
            "source_id": int(source_ids[i]),
            "example_id": int(example_ids[i]),
            "location": locate(int(source_ids[i])),
            "reason": reason,
            "detail": detail,
        }
        for i, (reason, detail) in sorted(reasons.items())
    ]
    if reasons:
        keep = np.ones(len(lengths), dtype=bool)
        keep[list(reasons)] = False
        kept_lengths = lengths[keep]
        tokens = tokens[np.repeat(keep, lengths)]
        starts, stops = starts[keep], stops[keep]
        source_ids, example_ids = source_ids[keep], example_ids[keep]
    else:
        kept_lengths = lengths
    offsets = np.zeros(len(kept_lengths) + 1, np.int64)
    np.cumsum(kept_lengths, out=offsets[1:])
    return Window(
        epoch=epoch,
        index=index,
        documents=len(lengths),
        # Always a fresh array (never a read-only view of a memory map), in the dtype
        # tokens travel in: uint16 halves every byte moved when the vocabulary fits.
        tokens=tokens.astype(token_dtype(vocab_size)),
        offsets=offsets,
        start=starts.astype(np.int64, copy=False),
        stop=stops.astype(np.int64, copy=False),
        source_id=source_ids.astype(np.int64, copy=False),
        example_id=example_ids.astype(np.int64, copy=False),
        quarantined=quarantined,
    )
