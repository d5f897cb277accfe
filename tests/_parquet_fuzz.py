"""The Parquet fuzz tier's cases, and the process that reads them
(``tests/corpus/test_parquet_fuzz.py``).

A case is a real file pyarrow wrote (``BASES``: dictionary or PLAIN values, data pages
v1 or v2, each codec, small pages, list or large_list, every integer type, required
or nullable, a labels column) with a few *edits* applied to its bytes: bytes
overwritten or cut out, a Thrift field of a page header or of the footer set to
another value (zero, negative, huge, off by one) or given another type, and, in
uncompressed pages, the level and index streams' own numbers (a level length prefix,
an RLE run's header, the index bit width, a dictionary index past the dictionary).
Edits are drawn relative to the file's structure (which page, which field), found by
the plain Thrift compact reader below, not by the decoder under test.

Run as a script, this module is the child the test reads each case in, so that a
crash or a hang is seen as one and does not take pytest down: it reads one JSON line
per case on stdin (``{"path", "column", "labels"}``) and answers one JSON line
(``{"outcome", "detail"}``). The outcomes (see ``classify``): ``equal`` (the reader
gave what it gives with pyarrow doing all the decoding), ``refused`` (a one-line
streampack error naming the file), ``both_refuse`` (that, and pyarrow refuses the
bytes too); and the failures ``differs``, ``tokens_where_pyarrow_refuses``,
``foreign_exception``, ``bad_message``, plus ``crash`` and ``hang`` seen by the parent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

FAILURES = {"differs", "tokens_where_pyarrow_refuses", "foreign_exception", "bad_message"}
CASE_SECONDS = 20.0  # one small file read twice; far more is a hang
MEMORY = 3 << 30  # the reading process's address space, bytes


# --- the files ------------------------------------------------------------------


def _lists(rng: np.random.Generator, rows: int, vocab: int, kind: Any, nulls: bool) -> Any:
    import pyarrow as pa

    lengths = rng.integers(1, 40, rows)
    top = min(vocab, np.iinfo(kind.to_pandas_dtype()).max)
    values = rng.integers(0, top, int(lengths.sum()), endpoint=True)
    out = []
    at = 0
    for n in lengths.tolist():
        out.append(values[at : at + n].tolist())
        at += n
    if nulls:
        out[rows // 2] = None
    return pa.array(out, pa.list_(kind))


BASES: dict[str, dict[str, Any]] = {
    # name: writer options, plus "kind", "vocab", "large", "required", "nulls", "labels"
    "snappy-dict-v1": {},
    "plain-v1": {"use_dictionary": False, "compression": "none"},
    "dict-v1": {"compression": "none"},
    "dict-v2": {"compression": "none", "data_page_version": "2.0"},
    "plain-v2": {"compression": "none", "data_page_version": "2.0", "use_dictionary": False},
    "small-pages": {"compression": "none", "data_page_size": 200},
    "small-pages-v2": {"compression": "none", "data_page_size": 200, "data_page_version": "2.0"},
    "gzip-dict": {"compression": "gzip"},
    "zstd-plain-v2": {"compression": "zstd", "data_page_version": "2.0", "use_dictionary": False},
    "brotli-dict-v2": {"compression": "brotli", "data_page_version": "2.0"},
    "snappy-plain": {"use_dictionary": False},
    "int64-large": {"compression": "none", "kind": "int64", "large": True},
    "uint16": {"compression": "none", "kind": "uint16", "vocab": 65535},
    "uint64-plain": {"compression": "none", "kind": "uint64", "use_dictionary": False},
    "int8": {"compression": "none", "kind": "int8", "vocab": 127},
    "wide-dict": {"compression": "none", "vocab": 1 << 20},
    "one-token": {"compression": "none", "vocab": 0},  # index width 0
    "required": {"compression": "none", "required": True},
    "null-row": {"compression": "none", "nulls": True},
    "labels": {"compression": "none", "labels": True},
}


def write_base(name: str, path: Path) -> None:
    """Base file ``name`` at ``path``: 90 documents in 3 row groups, seeded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    options = dict(BASES[name])
    kind = getattr(pa, options.pop("kind", "int32"))()
    vocab = options.pop("vocab", 5000)
    large = options.pop("large", False)
    required = options.pop("required", False)
    nulls = options.pop("nulls", False)
    labels = options.pop("labels", False)
    rng = np.random.default_rng(sorted(BASES).index(name))
    lists = _lists(rng, 90, vocab, kind, nulls)
    item = pa.field("element", kind, nullable=not required)
    field = pa.field("input_ids", (pa.large_list if large else pa.list_)(item), not required)
    columns = {"input_ids": lists.cast(field.type)}
    fields = [field]
    if labels:
        lengths = np.diff(lists.offsets.to_numpy())
        values = np.where(rng.random(int(lengths.sum())) < 0.5, -100, 7).astype(np.int64)
        offsets = pa.array(lists.offsets.to_numpy())
        columns["labels"] = pa.ListArray.from_arrays(offsets, pa.array(values))
        fields.append(pa.field("labels", pa.list_(pa.int64())))
    table = pa.table(columns, schema=pa.schema(fields))
    pq.write_table(table, str(path), row_group_size=30, **options)


# --- where things are: a plain Thrift compact reader ----------------------------


@dataclasses.dataclass(frozen=True)
class Field:
    path: tuple[int, ...]  # field ids from the outer struct (list elements: their index)
    kind: int  # compact type
    head: int  # the field header's byte (where its type nibble is)
    start: int  # its value's bytes
    end: int
    value: int | None  # integers: the value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def struct_fields(data: bytes, pos: int, path: tuple[int, ...] = ()) -> tuple[list[Field], int]:
    """Every field of the compact-protocol struct at ``pos`` (nested ones included),
    and where it ends."""
    out: list[Field] = []
    last = 0
    while True:
        head = pos
        byte = data[pos]
        pos += 1
        if byte == 0:
            return out, pos
        kind = byte & 0x0F
        if byte >> 4:
            last += byte >> 4
        else:
            raw, pos = _varint(data, pos)
            last = (raw >> 1) ^ -(raw & 1)
        start = pos
        value, pos, inner = _value(data, pos, kind, path + (last,))
        out.extend(inner)
        out.append(Field(path + (last,), kind, head, start, pos, value))


def _value(data: bytes, pos: int, kind: int, path: tuple[int, ...]) -> tuple[Any, int, list]:
    if kind in (1, 2):
        return None, pos, []
    if kind == 3:
        return None, pos + 1, []
    if kind in (4, 5, 6):
        raw, pos = _varint(data, pos)
        return (raw >> 1) ^ -(raw & 1), pos, []
    if kind == 7:
        return None, pos + 8, []
    if kind == 8:
        size, pos = _varint(data, pos)
        return None, pos + size, []
    if kind in (9, 10):
        head = data[pos]
        pos += 1
        size = head >> 4
        if size == 15:
            size, pos = _varint(data, pos)
        inner: list[Field] = []
        for index in range(size):
            if head & 0x0F in (1, 2):
                pos += 1
                continue
            _, pos, found = _value(data, pos, head & 0x0F, path + (index,))
            inner.extend(found)
        return None, pos, inner
    if kind == 12:
        inner, pos = struct_fields(data, pos, path)
        return None, pos, inner
    raise ValueError(f"compact type {kind} at {pos} (the base files hold no maps)")


@dataclasses.dataclass(frozen=True)
class Page:
    """One page of a column chunk, as written."""

    header: int  # where its header starts
    fields: list[Field]
    body: int  # where its body starts
    end: int
    streams: dict[str, tuple[int, int]]  # uncompressed data pages: "rep", "def", "values"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a file's pages and footer fields are."""

    pages: list[Page]
    chunks: list[tuple[int, int]]  # each column chunk's bytes
    footer: int  # where the footer's Thrift starts
    footer_fields: list[Field]


def layout(data: bytes, path: Path) -> Layout:
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(str(path))
    metadata = handle.metadata
    pages: list[Page] = []
    chunks = []
    for group in range(metadata.num_row_groups):
        for leaf in range(metadata.num_columns):
            chunk = metadata.row_group(group).column(leaf)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            end = start + chunk.total_compressed_size
            chunks.append((start, end))
            max_definition = handle.schema.column(leaf).max_definition_level
            at = start
            while at < end:
                fields, body = struct_fields(data, at)
                values = {f.path: f.value for f in fields}
                stop = body + values[(3,)]
                streams = {}
                if chunk.compression == "UNCOMPRESSED" and values[(1,)] in (0, 3):
                    streams = _streams(data, values, body, stop, max_definition)
                pages.append(Page(at, fields, body, stop, streams))
                at = stop
    footer_size = int.from_bytes(data[-8:-4], "little")
    footer = len(data) - 8 - footer_size
    footer_fields, _ = struct_fields(data, footer)
    return Layout(pages, chunks, footer, footer_fields)


def _streams(
    data: bytes, values: dict, body: int, stop: int, max_definition: int
) -> dict[str, tuple[int, int]]:
    """An uncompressed data page's level and value streams: ``(start, end)`` each
    (v1: after each level stream's 4-byte length)."""
    if values[(1,)] == 0:
        at = body
        streams = {}
        for name in ("rep", "def") if max_definition else ("rep",):
            length = int.from_bytes(data[at : at + 4], "little")
            streams[name] = (at + 4, at + 4 + length)
            at += 4 + length
        return {**streams, "values": (at, stop)}
    rep = body + values[(8, 6)]
    level_end = rep + values[(8, 5)]
    return {"rep": (body, rep), "def": (rep, level_end), "values": (level_end, stop)}


# --- edits ------------------------------------------------------------------------


def uleb(value: int, width: int = 0) -> bytes:
    """ULEB128 of ``value`` (taken as 64-bit unsigned), padded to ``width`` bytes with
    continuation bytes where it is shorter (a varint a reader must still accept)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append(value & 0x7F)
        value >>= 7
        if not value:
            break
    while len(out) < width:
        out.append(0)
    for k in range(len(out) - 1):
        out[k] |= 0x80
    return bytes(out)


def zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63) if value < 0 else value << 1


def new_value(spec: tuple[str, int], old: int) -> int:
    """A field's new value: ``("set", v)``, ``("add", d)``, ``("times", k)``,
    ``("over", k)`` (old // k)."""
    how, number = spec
    new = {"set": number, "add": old + number, "times": old * number}.get(how)
    return old // max(number, 1) if new is None else new


Edit = tuple[int, int, bytes]  # replace data[start:end] with these bytes


def resolve(edit: tuple, data: bytes, where: Layout) -> list[Edit]:
    """The byte edits of one drawn edit (indices taken modulo what the file holds;
    an edit that has nowhere to go in this file: none)."""
    kind, *args = edit
    pages = where.pages
    if kind == "flip":  # (chunk, offset, byte)
        lo, hi = where.chunks[args[0] % len(where.chunks)]
        at = lo + args[1] % (hi - lo)
        return [(at, at + 1, bytes([args[2]]))]
    if kind == "cut":  # (chunk, offset, length)
        lo, hi = where.chunks[args[0] % len(where.chunks)]
        at = lo + args[1] % (hi - lo)
        return [(at, min(at + args[2], hi), b"")]
    if kind == "truncate":  # (fraction of the file kept, in 1/1000)
        return [(len(data) * args[0] // 1000, len(data), b"")]
    if kind in ("header", "retype"):  # (page, field, value or kind)
        page = pages[args[0] % len(pages)]
        field = _pick([f for f in page.fields if f.value is not None], args[1])
        if kind == "retype":
            if data[field.head] >> 4 == 0:
                return []
            return [(field.head, field.head + 1, bytes([data[field.head] & 0xF0 | args[2]]))]
        value = new_value(args[2], field.value)
        return [(field.start, field.end, uleb(zigzag(value), field.end - field.start))]
    if kind == "footer":  # (field, value)
        wanted = [f for f in where.footer_fields if f.value is not None and f.kind in (5, 6)]
        field = _pick(wanted, args[0])
        value = new_value(args[1], field.value)
        return [(field.start, field.end, uleb(zigzag(value), field.end - field.start))]
    streamed = [p for p in pages if p.streams]
    if not streamed:
        return []
    page = streamed[args[0] % len(streamed)]
    if kind == "prefix":  # (page, stream, value): a v1 level stream's 4-byte length
        lo, _ = page.streams.get(args[1], page.streams["rep"])
        if lo - 4 < page.body:  # v2: its lengths are header fields
            return []
        return [(lo - 4, lo, (args[2] & 0xFFFFFFFF).to_bytes(4, "little"))]
    if kind == "run":  # (page, stream, header, value byte): an RLE run at a stream's start
        lo, hi = page.streams.get(args[1], page.streams["rep"])
        if args[1] == "values":
            lo += 1  # after the index bit width (PLAIN pages: bytes of values, no harm)
        run = uleb(args[2]) + bytes([args[3]])
        return [(lo, min(lo + len(run), page.end), run[: page.end - lo])]
    if kind == "width":  # (page, value): the index bit width byte
        lo, hi = page.streams["values"]
        return [(lo, lo + 1, bytes([args[1]]))] if lo < hi else []
    raise ValueError(kind)


def _pick(fields: list[Field], which: int | tuple[int, ...]) -> Field:
    """Field ``which`` (an index, taken modulo; or a field path, as the regression
    cases name one)."""
    if isinstance(which, tuple):
        return next(f for f in fields if f.path == which)
    return fields[which % len(fields)]


def apply(data: bytes, where: Layout, edits: list[tuple]) -> bytes:
    """``data`` with ``edits`` applied (resolved against its original layout; overlapping
    ones after the first dropped), the footer's length kept right."""
    resolved = sorted(
        (e for edit in edits for e in resolve(edit, data, where)), key=lambda e: -e[0]
    )
    out = bytearray(data)
    taken: list[tuple[int, int]] = []
    grown = 0  # bytes the footer gained
    for start, end, replacement in resolved:
        if any(start < hi and lo < max(end, start + 1) for lo, hi in taken):
            continue
        taken.append((start, max(end, start + 1)))
        out[start:end] = replacement
        if where.footer <= start < len(data) - 8:
            grown += len(replacement) - (end - start)
    if grown:
        size = int.from_bytes(data[-8:-4], "little") + grown
        out[-8:-4] = (size & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(out)


# --- the child: reading a case --------------------------------------------------


def _read(path: Path, column: str, labels: bool) -> list[tuple[np.ndarray, ...]]:
    from streampack.corpus.parquet import ParquetSource
    from streampack.corpus.reader import BindingSpec

    binding = BindingSpec(vocab_size=1 << 62, tokenizer="t", split_receipt="r", partition="p")
    source = ParquetSource([path], column, binding, {"labels": "labels"} if labels else None)
    out = []
    for block in source.blocks():
        problems = np.array(sorted(block.problems.items()), dtype=object)
        parts = (block.tokens, block.lengths, problems, block.mask, block.mask_lengths)
        out.append(tuple(np.asarray([] if p is None else p) for p in parts))
    return out


def classify(path: Path, column: str, labels: bool) -> tuple[str, str]:
    """``(outcome, detail)`` of reading ``path`` (module docstring)."""
    from streampack.corpus import parquet_pages
    from streampack.errors import InternalError, StreampackError

    plan = parquet_pages.column_plan
    parquet_pages.column_plan = lambda *args: None  # the reference: pyarrow decodes all
    try:
        want: Any = _read(path, column, labels)
    except Exception as exc:
        want = exc
    finally:
        parquet_pages.column_plan = plan
    try:
        got = _read(path, column, labels)
    except StreampackError as exc:
        line = str(exc)
        if isinstance(exc, InternalError):
            return "foreign_exception", f"InternalError: {line}"
        if "\n" in line or path.name not in line:
            return "bad_message", line
        return ("both_refuse" if isinstance(want, Exception) else "refused"), line
    except Exception as exc:
        return "foreign_exception", f"{type(exc).__name__}: {exc}"
    if isinstance(want, Exception):
        return "tokens_where_pyarrow_refuses", f"pyarrow: {type(want).__name__}: {want}"
    if len(got) != len(want):
        return "differs", f"{len(got)} blocks, pyarrow's path {len(want)}"
    for number, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(
            ("tokens", "lengths", "problems", "mask", "mask_lengths"), ours, theirs, strict=True
        ):
            if a.shape != b.shape or not (a == b).all():
                return "differs", f"block {number}: {name} {a[:8]!r} vs {b[:8]!r}"
    return "equal", ""


def main() -> None:
    for line in sys.stdin:
        case = json.loads(line)
        outcome, detail = classify(Path(case["path"]), case["column"], case["labels"])
        print(json.dumps({"outcome": outcome, "detail": detail[:600]}), flush=True)


# --- the parent's side ----------------------------------------------------------


def _bounded_memory() -> None:
    """The child's address space bounded (``MEMORY``): a reader sizing an allocation by
    a crafted number fails there, not by taking a shared machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


class Child:
    """The reading process: started on first use and again after a crash or a hang."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    def read(self, path: Path, labels: bool, warm: bool = False) -> tuple[str, str]:
        """``(outcome, detail)`` of ``path``; ``warm``: the first read, which may
        compile the kernels (minutes allowed)."""
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONFAULTHANDLER": ""},
                preexec_fn=_bounded_memory,
            )
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(
                json.dumps({"path": str(path), "column": "input_ids", "labels": labels}) + "\n"
            )
            process.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([process.stdout], [], [], 300 if warm else CASE_SECONDS)
        answer = process.stdout.readline() if ready else ""
        if answer:
            found = json.loads(answer)
            return found["outcome"], found["detail"]
        self.close()
        if not ready:
            return "hang", f"no answer in {CASE_SECONDS} s"
        return "crash", f"the reading process ended with status {process.returncode}"

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


if __name__ == "__main__":
    main()
