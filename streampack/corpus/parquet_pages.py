"""A Parquet token column's row group read page by page, straight into offsets and
tokens, where the column has the shape tokenized data is written in.

pyarrow rebuilds a list column from its levels one entry at a time, which is most of
its time on token lists (on the 2-core benchmark machine, about 45 of the 57 ms it
takes for 12 M tokens with no compression and no dictionary). Here the repetition
levels are read run by run (a document is one short bit-packed group and one run),
the definition levels are only checked to be all at their maximum (no null row, no null
token, no empty list), and the values are copied (PLAIN) or looked up in the
dictionary (``RLE_DICTIONARY``) by the compiled kernels of
``streampack.kernels.parquet_cpu``; pages are decompressed by pyarrow's codecs.

It reads a list column of any integer type (``large_list`` too; a supervision mask's
``int8`` as well as tokens) stored as Parquet's standard three-level list, with data
pages v1 or v2, PLAIN or dictionary values, RLE levels and the codecs in ``_CODECS``:
what pyarrow (and so ``datasets``) writes by default and with its usual options.
Anything else, and any row group whose levels say a row or token is null or a list
empty, gives None: the reader then reads that row group with pyarrow as before, which
also names whatever is wrong with a corrupt one. Every row group
read here equals pyarrow's reading of it (``tests/corpus/test_parquet_pages.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from streampack.corpus.storage import CorpusPath, RemoteArray, RemoteFile, Url
from streampack.kernels import parquet_cpu

_CODECS = {  # Parquet's codec names -> pyarrow's (None: stored as is)
    "UNCOMPRESSED": None,
    "SNAPPY": "snappy",
    "GZIP": "gzip",
    "ZSTD": "zstd",
    "BROTLI": "brotli",
}  # LZ4 (two framings under one name) and the rest: pyarrow's path
_PHYSICAL: dict[str, np.dtype] = {"INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64)}
# Parquet's enums (parquet.thrift).
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
# Raised for a page not read here, caught by read_row_group (pyarrow then reads the
# row group); a ValueError, so that it needs no class of its own.
_NotReadHere = ValueError


@dataclasses.dataclass(frozen=True)
class ColumnPlan:
    """How one file's token column is laid out: what decoding it needs."""

    leaf: int  # the column's index among the file's leaf columns
    dtype: np.dtype  # as stored: int32 or int64
    values: np.dtype  # as pyarrow reads them: the Arrow type's integer (cast from dtype)
    max_definition: int


def column_plan(pa: Any, handle: Any, column: str) -> ColumnPlan | None:
    """The plan for ``column`` of an opened ``pyarrow.parquet.ParquetFile``, or None
    where its shape is not the one read here."""
    kind = handle.schema_arrow.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    if not pa.types.is_integer(kind.value_type):
        return None
    values = np.dtype(kind.value_type.to_pandas_dtype())
    schema = handle.schema
    for leaf in range(len(schema)):
        described = schema.column(leaf)
        parts = described.path.split(".")
        if parts[0] != column:
            continue
        dtype = _PHYSICAL.get(described.physical_type)
        if (
            len(parts) != 3
            or described.max_repetition_level != 1
            or dtype is None
            or dtype.itemsize < values.itemsize  # (Parquet stores 8 to 32 bits as INT32)
            or described.logical_type.type not in ("NONE", "INT")
        ):
            return None
        return ColumnPlan(leaf, dtype, values, described.max_definition_level)
    return None


def read_lists(
    pa: Any, data: np.ndarray, handle: Any, plans: list[ColumnPlan], group: int
) -> list[Any] | None:
    """Row group ``group``'s columns of ``plans`` as pyarrow ``LargeListArray`` views
    of what ``read_row_group`` decodes, or None where any of them is not read here."""
    lists = []
    for plan in plans:
        read = read_row_group(pa, data, handle, plan, group)
        if read is None:
            return None
        offsets, values = read
        lists.append(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)))
    return lists


def read_row_group(
    pa: Any, data: np.ndarray, handle: Any, plan: ColumnPlan, group: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(offsets, tokens)`` of row group ``group`` (``data``: the file's bytes,
    memory-mapped), or None where it is not read here (module docstring)."""
    chunk = handle.metadata.row_group(group).column(plan.leaf)
    codec = chunk.compression
    if codec not in _CODECS or chunk.file_path:
        return None
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
        start = min(start, chunk.dictionary_page_offset)
    end = start + chunk.total_compressed_size
    if start < 0 or end > len(data):
        return None
    rows = handle.metadata.row_group(group).num_rows
    piece = data[start:end]  # a remote file's: one range read (its errors are not ours)
    try:
        return _decode(pa, piece, _CODECS[codec], plan, rows, chunk.num_values)
    except (IndexError, ValueError, TypeError, AttributeError, OSError, pa.ArrowException):
        return None  # _NotReadHere, or a damaged header's field of the wrong kind


def _decode(
    pa: Any, chunk: np.ndarray, codec: str | None, plan: ColumnPlan, rows: int, values: int
) -> tuple[np.ndarray, np.ndarray] | None:
    tokens = np.empty(values, plan.dtype)
    starts = np.empty(rows + 1, np.int64)
    level_width = int(plan.max_definition).bit_length()
    dictionary = None
    entries = found = pos = 0
    while entries < values:
        header, pos = _Thrift(chunk, pos).page_header()
        kind, size, stored = header.get(1), header.get(2), header.get(3)
        if not isinstance(size, int) or not isinstance(stored, int) or size < 0:
            raise _NotReadHere
        body = chunk[pos : pos + stored]
        pos += stored
        if len(body) != stored:
            raise _NotReadHere
        if kind == _DICTIONARY_PAGE:
            described = header.get(7) or {}
            if described.get(2) not in (_PLAIN, _PLAIN_DICTIONARY):
                raise _NotReadHere
            raw = _inflate(pa, body, codec, size)
            count = described.get(1, -1)
            if count < 0 or count * plan.dtype.itemsize > len(raw):
                raise _NotReadHere
            dictionary = np.frombuffer(raw, plan.dtype, count=count)
            continue
        if kind == _DATA_PAGE:
            described = header.get(5) or {}
            if described.get(3, _RLE) != _RLE or described.get(4, _RLE) != _RLE:
                raise _NotReadHere
            page = _inflate(pa, body, codec, size)
            repetition, at = _prefixed(page, 0)
            definition, at = _prefixed(page, at) if plan.max_definition else ((at, at), at)
            payload = page[at:]
        elif kind == _DATA_PAGE_V2:
            described = header.get(8) or {}
            if described.get(2, 0) != 0:  # null rows or tokens: pyarrow's path
                raise _NotReadHere
            definition_bytes, repetition_bytes = described.get(5, -1), described.get(6, -1)
            if definition_bytes < 0 or repetition_bytes < 0:
                raise _NotReadHere
            levels = repetition_bytes + definition_bytes
            if levels > len(body):
                raise _NotReadHere
            repetition = (0, repetition_bytes)
            definition = (repetition_bytes, levels)
            page = body
            payload = body[levels:]
            if described.get(7, True):
                payload = _inflate(pa, payload, codec, size - levels)
        else:
            raise _NotReadHere
        count = described.get(1, -1)
        if count < 0 or count > values - entries:
            raise _NotReadHere
        if plan.max_definition:
            lo, hi = definition
            equal = parquet_cpu.levels_all_equal(
                page, lo, hi, level_width, count, plan.max_definition
            )
            if equal != 1:  # a null or an empty list somewhere (or a corrupt page)
                raise _NotReadHere
        lo, hi = repetition
        found = parquet_cpu.row_starts(page, lo, hi, count, entries, starts[:rows], found)
        if found < 0:
            raise _NotReadHere
        encoding = described.get(2 if kind == _DATA_PAGE else 4)
        if encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            if dictionary is None or len(payload) < 1:
                raise _NotReadHere
            width = int(payload[0])
            decoded = parquet_cpu.dictionary_values(
                payload, 1, len(payload), width, count, dictionary, tokens, entries
            )
            if decoded != count:
                raise _NotReadHere
        elif encoding == _PLAIN:
            tokens[entries : entries + count] = np.frombuffer(payload, plan.dtype, count=count)
        else:
            raise _NotReadHere
        entries += count
    if found != rows or (rows and starts[0] != 0):
        raise _NotReadHere
    starts[rows] = entries
    # pyarrow's narrowing and signedness casts are C++ static casts, as NumPy's are.
    return starts, tokens.astype(plan.values, copy=False)


def _inflate(pa: Any, body: np.ndarray, codec: str | None, size: int) -> np.ndarray:
    """A page's bytes, decompressed to ``size`` bytes."""
    if codec is None:
        return body
    raw = pa.decompress(pa.py_buffer(body), decompressed_size=size, codec=codec, asbytes=False)
    return np.frombuffer(raw, np.uint8)


def _prefixed(page: np.ndarray, at: int) -> tuple[tuple[int, int], int]:
    """A data page v1's levels: ``((start, end), next)`` of the stream after its
    4-byte little-endian length at ``at``."""
    if at + 4 > len(page):
        raise _NotReadHere
    length = int(page[at : at + 4].view("<u4")[0])
    if at + 4 + length > len(page):
        raise _NotReadHere
    return (at + 4, at + 4 + length), at + 4 + length


class _Thrift:
    """Thrift's compact protocol, as far as a page header needs: a struct read into
    ``{field id: value}`` (nested structs as dicts; lists, maps and binaries are
    read past)."""

    def __init__(self, data: np.ndarray, pos: int) -> None:
        self.data = data
        self.pos = pos

    def page_header(self) -> tuple[dict[int, Any], int]:
        return self.struct(0), self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _NotReadHere
        value = int(self.data[self.pos])
        self.pos += 1
        return value

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise _NotReadHere

    def integer(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)  # zigzag

    def struct(self, depth: int) -> dict[int, Any]:
        if depth > 8:
            raise _NotReadHere
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.integer()
            fields[last] = self.value(kind, depth)

    def value(self, kind: int, depth: int) -> Any:
        if kind in (1, 2):  # a struct field's boolean, held in its type
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.integer()
        if kind == 7:
            self.skip(8)
            return None
        if kind == 8:
            self.skip(self.varint())
            return None
        if kind in (9, 10):  # list, set
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.element(head & 0x0F, depth)
            return None
        if kind == 11:  # map
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.element(types >> 4, depth)
                    self.element(types & 0x0F, depth)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise _NotReadHere

    def element(self, kind: int, depth: int) -> None:
        if kind in (1, 2):  # a list's boolean: one byte
            self.byte()
        else:
            self.value(kind, depth)

    def skip(self, size: int) -> None:
        if self.pos + size > len(self.data):
            raise _NotReadHere
        self.pos += size


def file_bytes(path: CorpusPath) -> Any:
    """The file's bytes, memory-mapped read-only (an empty file: an empty array); a
    remote file's as a ``storage.RemoteArray`` (each slice a range read)."""
    if isinstance(path, Url):
        file = RemoteFile(path, "Parquet file")
        return RemoteArray(file, 0, np.uint8, file.size)
    if path.stat().st_size == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, np.uint8, mode="r")
