"""JSON Lines of token lists, read lazily a block of lines at a time.

One document per line: ``{"tokens": [...]}`` with optional ``"id"`` (int, becomes the
example id) and ``"start"``/``"stop"`` (the selected range; default the whole
document). Every line that is not blank is a document and takes a source id,
malformed ones too (they are quarantined as ``malformed``, their location naming the
line). A blank (whitespace-only) line is skipped and counted (``blank_lines``), as
pandas and ``datasets`` read JSON Lines: it is no document.

Reading: about ``BLOCK_BYTES`` of whole lines at a time go to a compiled parser
(``kernels.corpus_cpu.parse_token_lines``) of the plain shape such files have —
``{"tokens": [1, 2, 3]}``, with ``id``/``start``/``stop`` integers and the mask field,
nothing else — straight into one token array: no Python object per token. Every other
line (another field, a string, a float, a null, bad JSON, ...), and one it reads that
breaks a rule (a range outside its tokens, labels that disagree with them), is read by
:func:`parse_line` with ``json``, which says what is wrong with a bad one; both paths
give the same document for a line both read (tested). pyarrow's JSON reader was
measured too: 7.8 M tokens/s against ``json``'s 4.6 on the same lines, not enough.

Supervision (:mod:`streampack.corpus.masks`): ``"mask": "FIELD"`` in the manifest
makes each line carry a list of 0/1 (or true/false) per token under ``FIELD``
(``{"tokens": [...], "mask": [0, 0, 1, 1]}``); ``"labels": "FIELD"`` a list of Hugging
Face labels (-100, or the token). A line without it, or with one of another length or
other values, is quarantined (``mask_length``, ``mask_values``, ``labels_mismatch``).

A bad line is a document's problem; a file none of whose first lines is a document
(``SNIFF_LINES`` non-blank lines, all not JSON objects with a ``tokens`` list of
integers: compressed or binary data, another schema such as ``{"input_ids": ...}``,
a JSON array) is the file's, and refuses the corpus at open rather than quarantining
every line.

A remote file (a URL: :mod:`streampack.corpus.storage`) is read the same way through a
file object whose reads go through the node cache, the blocks after the cursor fetched
ahead (``corpus_prefetch_bytes``). Its first whole pass leaves a line index beside the
node's block cache (``DIR/index/KEY.jsonl-index.npy``, named by the object's version, never
evicted with the blocks): per document its line's byte offset, line number and length
as read. A resume in corpus order (no shuffle) then cuts the windows before it from
those lengths and starts reading at its first document's line, rather than reading and
parsing the file from its start (:meth:`JsonlSource.resume_lengths`). A shuffled resume
still reads from the start: the shuffle buffer holds documents from anywhere before.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.masks import MaskSpec, labels_to_mask, mask_spec
from streampack.corpus.reader import BindingSpec, Block, Record, SingleSource
from streampack.corpus.storage import (
    CorpusPath,
    Url,
    file_size,
    index_path,
    load_index,
    open_binary,
    save_index,
)
from streampack.errors import InternalError, InvalidConfig

#: Non-blank lines read at open: a file where none is a document is refused.
SNIFF_LINES = 8
#: A line longer than this is not judged at open (its document is screened as usual).
SNIFF_BYTES = 1 << 20
#: Reasons that say the line is not this format's document at all.
NOT_A_DOCUMENT = ("malformed", "wrong_dtype")


class JsonlSource(SingleSource):
    """JSON Lines files in manifest order; sequential (shuffles use a bounded buffer)."""

    random_access = False

    def __init__(
        self, paths: list[CorpusPath], binding: BindingSpec, entry: dict[str, Any] | None = None
    ) -> None:
        self.binding = binding
        self.paths = [regular_file(path, "JSON Lines file") for path in paths]
        for path in self.paths:
            if file_size(path) == 0:
                raise InvalidConfig(
                    f"JSON Lines file {str(path)!r} is empty (0 bytes); "
                    f"expected one document per line"
                )
            refuse_without_documents(path)
        self.num_documents: int | None = None
        where = f"JSON Lines file {str(self.paths[0])!r}" if self.paths else "JSON Lines"
        # The first line's fields stand for the file's: enough to catch a supervision
        # field the manifest does not name, at the cost of one line.
        self.spec = mask_spec(entry or {}, where, _first_fields(self.paths[:1]))
        self.masked = self.spec is not None

        self._blank: dict[int, int] = {}  # file -> blank lines found reading it

    @property
    def blank_lines(self) -> int:
        """Blank lines skipped in the files read so far (each file counted once)."""
        return sum(self._blank.values())

    def records(self) -> Iterator[Record]:
        for block in self.blocks():
            yield from block.records(self.location)

    def blocks(self, first: int = 0) -> Iterator[Block]:
        """Every document from source id ``first`` (a resume: only with every file's
        line index, see ``resume_lengths``), in blocks of about ``BLOCK_BYTES`` of
        lines. A whole pass of a remote file writes its line index."""
        source_id = 0
        for number, path in enumerate(self.paths):
            index = _load_index(path) if first > source_id else None
            if index is not None and first >= source_id + len(index) - 1:
                self._blank[number] = int(index[-1, 2])  # skipped whole
                source_id += len(index) - 1
                continue
            blank = 0
            line_number, offset = 1, 0  # of the chunk's first line, and its byte offset
            if index is not None:  # resume inside this file, at document ``first``
                offset, line_number, _ = (int(v) for v in index[first - source_id])
                blank = int(index[-1, 2])
                source_id = first
            rows: list[np.ndarray] | None = [] if offset == 0 and isinstance(path, Url) else None
            for chunk in _chunks(path, offset):
                starts, ends = _line_bounds(chunk)
                filled = _not_blank(chunk, starts, ends)
                lines = line_number + np.flatnonzero(filled)
                block = self._parsed(
                    chunk, starts[filled], ends[filled], source_id, path.name, lines
                )
                if rows is not None and len(block) == len(lines):
                    rows.append(np.stack([offset + starts[filled], lines, block.lengths], 1))
                else:
                    rows = None
                offset += len(chunk)
                del chunk  # parsed: a long line's bytes go before its window is screened
                if source_id < first:  # a file without its index (gone): skip what is before
                    block = block.slice(min(len(block), first - source_id), len(block))
                if len(block):
                    yield block
                if index is None:
                    blank += len(starts) - len(lines)
                source_id += len(lines)
                line_number += len(starts)
            self._blank[number] = blank
            if rows is not None:
                _save_index(path, rows, offset, line_number, blank)

    def resume_lengths(self) -> np.ndarray | None:
        """Every document's length as read (what the window cut sees), from the files'
        line indexes — None unless every file has one (a remote file read whole once):
        then ``blocks(first)`` starts at any document without reading those before."""
        indexes = [_load_index(path) for path in self.paths]
        if any(index is None for index in indexes):
            return None
        return np.concatenate([index[:-1, 2] for index in indexes if index is not None])

    def location(self, source_id: int) -> str:
        raise InternalError("JSON Lines blocks carry their locations (a bug)")

    def _parsed(
        self,
        chunk: bytes | bytearray,
        starts: np.ndarray,
        ends: np.ndarray,
        first: int,
        name: str,
        lines: np.ndarray,
    ) -> Block:
        """The documents of the non-blank lines ``[starts, ends)`` of ``chunk`` (line
        numbers ``lines``, source ids from ``first``). Lines of the plain shape are
        parsed by the compiled ``parse_token_lines``; every other line, and one it reads
        but that breaks a rule (a range outside its tokens, labels that disagree), by
        :func:`parse_line`, which says what is wrong."""
        from streampack.kernels.corpus_cpu import parse_token_lines

        n = len(starts)
        keys = np.zeros((5, 64), np.uint8)
        key_lengths = np.zeros(5, np.int64)
        names = ["tokens", "id", "start", "stop"]
        if self.spec is not None:
            names.append(self.spec.name)
        for k, key in enumerate(names):
            raw = key.encode()
            if len(raw) <= 64:  # a longer mask field: every line goes to json
                keys[k, : len(raw)] = np.frombuffer(raw, np.uint8)
                key_lengths[k] = len(raw)
        buf = _bytes_of(chunk)
        accepted = np.zeros(n, bool)
        lists = np.zeros((n, 4), np.int64)
        scalars = np.zeros((n, 4), np.int64)
        # At most one integer per two bytes ("1," ...): room for every one, as int32
        # (a line with a list value outside it goes to json): a long line of short
        # tokens costs at most twice its bytes here.
        tokens = np.empty(len(chunk) // 2 + 1, np.int32)
        mask = np.empty(len(chunk) // 2 + 1 if self.spec is not None else 0, np.int32)
        if self.spec is None or key_lengths[4] > 0:
            parse_token_lines(
                buf, starts, ends, keys, key_lengths, accepted, lists, scalars, tokens, mask
            )
        fast = np.flatnonzero(accepted)
        lengths = lists[fast, 1]
        present = scalars[fast, 3]
        block_starts = np.where(present & 4, scalars[fast, 1], 0)
        block_stops = np.where(present & 8, scalars[fast, 2], lengths)
        inside = (0 <= block_starts) & (block_starts <= block_stops) & (block_stops <= lengths)
        mask_values = mask_lengths = None
        token_values = tokens[: int(lengths.sum())] if len(fast) else tokens[:0]
        if len(fast) and not (lists[fast, 0] == np.cumsum(lengths) - lengths).all():
            raise InternalError("parse_token_lines: tokens not back to back (a bug)")
        if self.spec is not None:
            mask_lengths = lists[fast, 3]
            mask_values = mask[: int(mask_lengths.sum())]
            if self.spec.kind == "labels":
                mask_values, mismatched = labels_to_mask(
                    token_values, lengths, mask_values, mask_lengths
                )
                for position, _, _ in mismatched:  # parse_line gives these no tokens
                    inside[position] = False
        parsed = Block(
            tokens=token_values,
            lengths=lengths,
            starts=block_starts,
            stops=block_stops,
            source_ids=first + fast,
            example_ids=np.where(present & 2, scalars[fast, 0], first + fast),
            problems={},
            locations=_locations(name, lines[fast]),
            mask=mask_values,
            mask_lengths=mask_lengths,
        )
        if inside.all() and len(fast) == n:
            return parsed
        parsed = parsed.take(np.flatnonzero(inside))
        slow = np.sort(np.concatenate([np.flatnonzero(~accepted), fast[~inside]]))
        records = [
            parse_line(chunk[starts[i] : ends[i]], first + i, f"{name}:{lines[i]}", self.spec)
            for i in slow.tolist()
        ]
        both = Block.concat([parsed, Block.from_records(records, self.masked)])
        return both.take(np.argsort(both.source_ids, kind="stable"))


BLOCK_BYTES = 4 << 20  # lines read and parsed at a time (more for one longer line)


def _load_index(path: CorpusPath) -> np.ndarray | None:
    """The file's line index: int64 rows ``(byte offset, line number, length)`` per
    document, then ``(file size, lines + 1, blank lines)``; None when there is none
    (or it is not whole)."""
    index = load_index(index_path(path, "JSON Lines file", "jsonl-index"))
    if index is None:
        return None
    if index.ndim != 2 or index.shape[1] != 3 or not len(index) or index.dtype != np.int64:
        return None
    return index


def _save_index(
    path: CorpusPath, rows: list[np.ndarray], size: int, lines: int, blank: int
) -> None:
    """Write the line index of a whole pass."""
    where = index_path(path, "JSON Lines file", "jsonl-index")
    if where is None:
        return
    tail = np.array([[size, lines, blank]], np.int64)
    save_index(where, np.concatenate([*(r.astype(np.int64) for r in rows), tail]))


def _chunks(path: CorpusPath, offset: int = 0) -> Iterator[bytes | bytearray]:
    """The file's bytes from ``offset`` (a line's start) in pieces of whole lines, about
    ``BLOCK_BYTES`` each (a line longer than that is a piece of its own); the last may
    lack its newline."""
    with open_binary(path, "JSON Lines file") as handle:
        handle.seek(offset)
        # A callable's iterator keeps no piece between steps: a long line's bytes are
        # freed as soon as the reader has parsed them.
        yield from iter(functools.partial(_next_chunk, handle), b"")


def _next_chunk(handle: io.BufferedReader) -> bytes | bytearray:
    """The next piece of whole lines of ``handle`` (b"" at its end). A line longer
    than ``BLOCK_BYTES`` is measured first and read into one buffer of its size: its
    bytes are held once, never copied into a growing buffer."""
    start = handle.tell()
    data = handle.read(BLOCK_BYTES)
    if len(data) < BLOCK_BYTES or data.endswith(b"\n"):  # the file's end, or a line's
        return data
    cut = data.rfind(b"\n")
    if cut >= 0:
        handle.seek(start + cut + 1)
        return data[: cut + 1]
    end = start + len(data)
    while piece := handle.read(BLOCK_BYTES):
        newline = piece.find(b"\n")
        if newline >= 0:
            end += newline + 1
            break
        end += len(piece)
    handle.seek(start)
    line = bytearray(end - start)
    handle.readinto(line)
    return line


def _bytes_of(chunk: bytes | bytearray) -> np.ndarray:
    """A read-only uint8 view of ``chunk``: one type for the compiled code whether the
    piece is ``bytes`` or a long line's ``bytearray``."""
    view = np.frombuffer(chunk, np.uint8)
    view.flags.writeable = False
    return view


def _line_bounds(chunk: bytes | bytearray) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` of each line of ``chunk`` (its newline included, as a file
    iterator gives it)."""
    newlines = np.flatnonzero(_bytes_of(chunk) == 0x0A)
    ends = newlines + 1
    if not len(ends) or ends[-1] != len(chunk):
        ends = np.append(ends, len(chunk))
    starts = np.concatenate([[0], ends[:-1]])
    return starts.astype(np.int64), ends.astype(np.int64)


def _not_blank(chunk: bytes | bytearray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """bool per line: it holds a byte that is not whitespace."""
    from streampack.kernels.corpus_cpu import solid_lines

    out = np.empty(len(starts), bool)
    solid_lines(_bytes_of(chunk), starts, ends, out)
    return out


def _locations(name: str, lines: np.ndarray) -> np.ndarray:
    out = np.empty(len(lines), object)
    out[:] = [f"{name}:{line}" for line in lines.tolist()]
    return out


def _first_fields(paths: list[CorpusPath]) -> list[str]:
    """The fields of the first line of ``paths[0]`` that is a JSON object, else none."""
    for path in paths:
        with open_binary(path, "JSON Lines file") as handle:
            for line in handle:
                if line.strip():
                    try:
                        data = json.loads(line)
                    except (ValueError, UnicodeDecodeError, RecursionError):
                        return []
                    return list(data) if isinstance(data, dict) else []
    return []


def refuse_without_documents(path: CorpusPath) -> None:
    """Refuse ``path`` when none of its first ``SNIFF_LINES`` non-blank lines is a
    document (see module docstring); any one that is, good or bad on its own account
    (a range, a token out of the vocabulary), or a line too long to judge, passes."""
    first = None
    seen = 0
    with open_binary(path, "JSON Lines file") as handle:
        while seen < SNIFF_LINES:
            line = handle.readline(SNIFF_BYTES)
            if not line:
                break
            if len(line) == SNIFF_BYTES and not line.endswith(b"\n"):
                return
            if not line.strip():
                continue
            seen += 1
            record = parse_line(line, 0, f"line {seen}")
            if record.reason not in NOT_A_DOCUMENT:
                return
            first = first or record
    if first is not None:
        raise InvalidConfig(
            f"JSON Lines file {str(path)!r}: none of its first {seen} non-blank line(s) is "
            f"a document (first: {first.detail}); expected one JSON object per line, "
            f'{{"tokens": [integer token ids, ...]}}'
        )


def parse_line(
    line: bytes | bytearray, source_id: int, location: str, spec: MaskSpec | None = None
) -> Record:
    """The document of one JSON Lines line; a bad line becomes a quarantined record.
    With ``spec``, the line's mask (or labels, as a mask) comes with it."""

    def bad(reason: str, detail: str, tokens: np.ndarray | None = None) -> Record:
        return Record(source_id, tokens, 0, 0, source_id, reason, detail, location)

    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also a 5000-digit int
        return bad("malformed", f"not JSON: {exc}")
    except RecursionError:
        # Deep nesting ("[[[[..."): the parser's recursion limit, not a crash.
        return bad("malformed", "JSON nested too deeply")
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
    if (
        isinstance(example_id, bool)
        or not isinstance(example_id, int)
        or not (-(2**63) <= example_id < 2**63)
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
    if spec is None:
        return Record(source_id, tokens, start, stop, example_id, None, "", location)
    raw_mask = data.get(spec.name)
    if not isinstance(raw_mask, list):
        found = "missing" if raw_mask is None else f"a {type(raw_mask).__name__}"
        return bad(
            "mask_length",
            f"{spec.kind} field {spec.name!r} is {found}; expected a list of one value per token",
        )
    if not all(isinstance(v, int) for v in raw_mask):
        kinds = sorted({type(v).__name__ for v in raw_mask if not isinstance(v, int)})
        return bad("mask_values", f"{spec.kind} values must be integers; found {kinds}")
    try:
        mask = np.array(raw_mask, dtype=np.int64)
    except OverflowError:
        return bad("mask_values", f"a {spec.kind} value does not fit in 64 bits")
    if spec.kind == "labels":
        mask, problems = labels_to_mask(
            tokens, np.array([len(tokens)]), mask, np.array([len(mask)])
        )
        if problems:
            return bad(problems[0][1], problems[0][2])
    return Record(source_id, tokens, start, stop, example_id, None, "", location, mask)
