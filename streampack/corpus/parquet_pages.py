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
empty, gives the reason it is not read here (one line naming the column and the page):
the reader then reads that row group with pyarrow as before, and where pyarrow refuses
it too, its error carries both. Every row group read here equals pyarrow's reading of
it (``tests/corpus/test_parquet_pages.py``).

Nothing here trusts the file. Where each chunk is comes from the footer's Thrift, read
here (pyarrow's metadata accessors abort the process on some damaged footers); a
chunk's page headers are all read and checked before anything is allocated or
decompressed (counts adding up to the footer's, sizes bounded by them, one dictionary
page, first, no larger than the chunk's values); every Thrift field read must have its
type; a decompressed page must prove its length; the kernels check every read against
their buffers and return error codes. Wherever the answer cannot be proved, the row
group goes to pyarrow: never tokens pyarrow would not read (the fuzz tier,
``tests/corpus/test_parquet_fuzz.py``, reads crafted files in a child process).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

from streampack.corpus.storage import CorpusPath, RemoteArray, RemoteFile, Url
from streampack.kernels import parquet_cpu

_CODECS = {  # Parquet's codec numbers -> pyarrow's names (None: stored as is)
    0: None,  # UNCOMPRESSED
    1: "snappy",
    2: "gzip",
    4: "brotli",
    6: "zstd",
}  # LZ4 (two framings under one name) and the rest: pyarrow's path
_UNREAD = "not read here"
_TYPES = {"INT32": 1, "INT64": 2}  # Parquet's physical type numbers
_PHYSICAL: dict[str, np.dtype] = {"INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64)}
# Parquet's enums (parquet.thrift).
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
# Thrift compact types of the fields read.
_TRUE, _FALSE, _I32, _I64, _LIST, _STRUCT = 1, 2, 5, 6, 9, 12
#: A page's bytes once decompressed, at most: this per value plus _SLACK (PLAIN values
#: take 8 at most, levels and indices a few; pyarrow writes far less). A page that
#: says more is left to pyarrow: no header number sizes an allocation unchecked.
_BYTES_PER_VALUE = 32
_SLACK = 4096
# Raised for a page not read here, with what is wrong; caught by read_row_group (pyarrow
# then reads the row group). A ValueError, so that it needs no class of its own.
_NotReadHere = ValueError
_KERNEL_ERRORS = {
    parquet_cpu.ENDS_EARLY: "the stream ends before its values",
    parquet_cpu.BAD_RUN: "a run header of zero values, over 32 bits, or past the page's values",
    parquet_cpu.PAST_DICTIONARY: "a dictionary index past the dictionary",
    parquet_cpu.BAD_LEVEL: "a level outside its range, or more rows than the row group's",
    parquet_cpu.BAD_WIDTH: "a bit width past 32",
    parquet_cpu.OUT_OF_BOUNDS: "a stream outside its page",
}


@dataclasses.dataclass(frozen=True)
class ChunkPlace:
    """Where one row group's chunk of the column is, read here from the footer's
    Thrift: pyarrow's metadata accessors abort the process on some damaged footers
    (a codec number they do not know, a level histogram of the wrong size), so the
    page reader never asks them."""

    codec: str | None  # pyarrow's name (None: stored as is)
    start: int
    end: int
    values: int
    rows: int


@dataclasses.dataclass(frozen=True)
class ColumnPlan:
    """How one file's token column is laid out: what decoding it needs."""

    name: str
    leaf: int  # the column's index among the file's leaf columns
    dtype: np.dtype  # as stored: int32 or int64
    values: np.dtype  # as pyarrow reads them: the Arrow type's integer (cast from dtype)
    max_definition: int
    chunks: tuple[ChunkPlace | str, ...]  # per row group (str: why it is not read here)


def column_plan(pa: Any, handle: Any, column: str, data: np.ndarray) -> ColumnPlan | None:
    """The plan for ``column`` of an opened ``pyarrow.parquet.ParquetFile`` whose bytes
    are ``data``, or None where its shape is not the one read here."""
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
        chunks = _chunk_places(data, leaf, _TYPES[described.physical_type], len(data))
        groups = handle.metadata.num_row_groups
        if len(chunks) != groups:
            chunks = ("a footer whose row groups are not pyarrow's",) * groups
        name = f"column {column!r}"
        return ColumnPlan(name, leaf, dtype, values, described.max_definition_level, chunks)
    return None


def _chunk_places(
    data: np.ndarray, leaf: int, kind: int, size: int
) -> tuple[ChunkPlace | str, ...]:
    """Leaf ``leaf``'s chunk in each row group, read from the footer (``kind``: the
    schema's physical type); a row group's entry is why not where it cannot be read
    here."""
    places: list[ChunkPlace | str] = []
    for group in _row_groups(data):
        try:
            chunk = _field(group, 1, _LIST)[leaf]
            metadata = _field(chunk, 3, _STRUCT)
            codec = _CODECS.get(_field(metadata, 4, _I32), _UNREAD)
            if codec == _UNREAD:
                raise _NotReadHere("a codec not read here")
            if 1 in chunk:
                raise _NotReadHere("a chunk in another file")
            if _field(metadata, 1, _I32) != kind:
                raise _NotReadHere("the chunk's physical type is not the schema's")
            # Where pyarrow starts it: the dictionary page where that comes first.
            start = _field(metadata, 9, _I64)
            if 11 in metadata and 0 < _field(metadata, 11, _I64) < start:
                start = _field(metadata, 11, _I64)
            end = start + _field(metadata, 7, _I64)
            if not 0 <= start < end <= size:
                raise _NotReadHere(f"the chunk's bytes {start}..{end} outside the file")
            rows, values = _field(group, 3, _I64), _field(metadata, 5, _I64)
            places.append(ChunkPlace(codec, start, end, values, rows))
        except (_NotReadHere, IndexError, TypeError) as exc:
            places.append(f"footer: {exc}")
    return tuple(places)


def _row_groups(data: np.ndarray) -> list[dict[int, tuple[int, Any]]]:
    """The footer's row groups as read here (none where it cannot be read here)."""
    if len(data) < 12 or bytes(data[-4:]) != b"PAR1":  # (an encrypted footer: PARE)
        return []
    length = int(data[-8:-4].view("<u4")[0])
    if length + 8 > len(data):
        return []
    try:
        footer = _Thrift(data[len(data) - 8 - length : len(data) - 8], 0).struct(0)
        return list(_field(footer, 4, _LIST))
    except (_NotReadHere, TypeError):
        return []


def rows_past_values(data: np.ndarray, leaf: int) -> list[tuple[int, int, int]]:
    """``(row group, rows, values)`` of every row group whose footer says more rows than
    leaf ``leaf``, a list column's, holds values. A list holds one value (level) per
    row at least, so that footer is wrong; pyarrow would size its reading by the rows,
    and a crafted number exhausts the machine's memory."""
    found = []
    for number, group in enumerate(_row_groups(data)):
        try:
            rows = _field(group, 3, _I64)
            values = _field(_field(_field(group, 1, _LIST)[leaf], 3, _STRUCT), 5, _I64)
        except (_NotReadHere, IndexError, TypeError):
            continue
        if rows > values:
            found.append((number, rows, values))
    return found


def read_lists(pa: Any, data: np.ndarray, plans: list[ColumnPlan], group: int) -> list[Any] | str:
    """Row group ``group``'s columns of ``plans`` as pyarrow ``LargeListArray`` views
    of what ``read_row_group`` decodes, or why one of them is not read here."""
    lists = []
    for plan in plans:
        read = read_row_group(pa, data, plan, group)
        if isinstance(read, str):
            return read
        offsets, values = read
        lists.append(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)))
    return lists


def read_row_group(
    pa: Any, data: np.ndarray, plan: ColumnPlan, group: int
) -> tuple[np.ndarray, np.ndarray] | str:
    """``(offsets, tokens)`` of row group ``group`` (``data``: the file's bytes,
    memory-mapped), or why it is not read here (module docstring): one line naming the
    column and the page."""
    place = plan.chunks[group] if group < len(plan.chunks) else "no such row group"
    if isinstance(place, str):
        return f"{plan.name}: {place}"
    # A remote file's: one range read, whose errors are not the decoder's to hide.
    piece = data[place.start : place.end]
    try:
        chunk = _Chunk(pa, piece, place.codec, plan)
        return chunk.decode(place.rows, place.values)
    except _NotReadHere as exc:
        return f"{plan.name}, {exc}"
    except (IndexError, TypeError, OSError, MemoryError, pa.ArrowException) as exc:
        return f"{plan.name}: {type(exc).__name__}: {exc}"


@dataclasses.dataclass
class _Page:
    """A data page's numbers, read from its header and checked."""

    kind: int
    body: np.ndarray  # as stored (compressed)
    size: int  # decompressed
    count: int  # values (levels)
    encoding: int
    rows: int  # a v2 page's rows (-1: v1)
    levels: tuple[int, int]  # v2: the repetition and definition levels' bytes
    compressed: bool  # v2: whether its values are (v1: the whole page, by the codec)


class _Chunk:
    """One column chunk's pages: their headers read and checked first, then decoded."""

    def __init__(self, pa: Any, data: np.ndarray, codec: str | None, plan: ColumnPlan) -> None:
        self.pa = pa
        self.data = data
        self.codec = codec
        self.plan = plan
        self.number = 0  # the page being read, for messages

    def fail(self, what: str) -> ValueError:
        return _NotReadHere(f"page {self.number}: {what}")

    def decode(self, rows: int, values: int) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, tokens)`` of the chunk's ``rows`` rows and ``values`` values."""
        dictionary_page, pages = self.pages(values)
        if not 0 < rows <= values < 2**40:  # (every row holds a value here)
            raise _NotReadHere(f"{rows} rows for {values} values")
        plan = self.plan
        dictionary = None
        if dictionary_page is not None:
            self.number = 0
            count, body, size = dictionary_page
            raw = self.inflate(body, size)
            if count * plan.dtype.itemsize > len(raw):
                raise self.fail(f"{count} dictionary entries in {len(raw)} bytes")
            dictionary = np.frombuffer(raw, plan.dtype, count=count)
        tokens = np.empty(values, plan.dtype)
        starts = np.empty(rows + 1, np.int64)
        level_width = int(plan.max_definition).bit_length()
        entries = found = 0
        for number, page in enumerate(pages, start=int(dictionary_page is not None)):
            self.number = number
            levels, repetition, definition, payload = self.streams(page)
            count = page.count
            if plan.max_definition:
                lo, hi = definition
                equal = parquet_cpu.levels_all_equal(
                    levels, lo, hi, level_width, count, plan.max_definition
                )
                if equal != 1:  # a null or an empty list somewhere (or a corrupt page)
                    raise self.fail(_KERNEL_ERRORS.get(equal, "a null or an empty list"))
            lo, hi = repetition
            before = found
            found = parquet_cpu.row_starts(levels, lo, hi, count, entries, starts, found)
            if found < 0:
                raise self.fail(f"repetition levels: {_KERNEL_ERRORS[found]}")
            if page.rows >= 0 and (
                found - before != page.rows or (count and starts[before] != entries)
            ):  # a v2 page holds whole rows, as many as it says
                raise self.fail(f"{found - before} rows where the header says {page.rows}")
            if page.encoding in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
                if dictionary is None or len(payload) < 1:
                    raise self.fail("dictionary indices without a dictionary page")
                decoded = parquet_cpu.dictionary_values(
                    payload, 1, len(payload), int(payload[0]), count, dictionary, tokens, entries
                )
                if decoded != count:
                    raise self.fail(f"dictionary indices: {_KERNEL_ERRORS[decoded]}")
            elif page.encoding == _PLAIN:
                if count * plan.dtype.itemsize > len(payload):
                    raise self.fail(f"{count} PLAIN values in {len(payload)} bytes")
                tokens[entries : entries + count] = np.frombuffer(payload, plan.dtype, count=count)
            else:
                raise self.fail(f"encoding {page.encoding} is not read here")
            entries += count
        if found != rows or starts[0] != 0:
            raise _NotReadHere(f"{found} rows where the row group has {rows}")
        starts[rows] = entries
        # pyarrow's narrowing and signedness casts are C++ static casts, as NumPy's are.
        return starts, tokens.astype(plan.values, copy=False)

    def pages(self, values: int) -> tuple[tuple[int, np.ndarray, int] | None, list[_Page]]:
        """The dictionary page (``(count, body, size)``, or None) and the data pages
        that hold the chunk's ``values`` values, every header number checked: read
        before anything is allocated or decompressed."""
        dictionary = None
        pages: list[_Page] = []
        pos = total = 0
        while total < values:
            self.number = len(pages) + int(dictionary is not None)
            header, pos = _Thrift(self.data, pos).page_header()
            kind = _field(header, 1, _I32)
            size = _field(header, 2, _I32)
            stored = _field(header, 3, _I32)
            if stored < 0 or size < 0 or pos + stored > len(self.data):
                raise self.fail(f"{stored} bytes stored ({size} decompressed) past the chunk")
            body = self.data[pos : pos + stored]
            pos += stored
            if kind == _DICTIONARY_PAGE:
                described = _field(header, 7, _STRUCT)
                count = _field(described, 1, _I32)
                if pages or dictionary is not None:
                    raise self.fail("a dictionary page after the first page")
                if _field(described, 2, _I32) not in (_PLAIN, _PLAIN_DICTIONARY):
                    raise self.fail("a dictionary page of another encoding")
                if not 0 <= count <= values or size > count * 8 + _SLACK:
                    raise self.fail(f"{count} dictionary entries in {size} bytes")
                dictionary = (count, body, size)
                continue
            if kind == _DATA_PAGE:
                described = _field(header, 5, _STRUCT)
                count = _field(described, 1, _I32)
                if _field(described, 3, _I32) != _RLE or _field(described, 4, _I32) != _RLE:
                    raise self.fail("levels not RLE-encoded")
                page = _Page(kind, body, size, count, _field(described, 2, _I32), -1, (0, 0), True)
            elif kind == _DATA_PAGE_V2:
                described = _field(header, 8, _STRUCT)
                count = _field(described, 1, _I32)
                if _field(described, 2, _I32) != 0:  # null rows or tokens: pyarrow's path
                    raise self.fail("nulls")
                definition = _field(described, 5, _I32)
                repetition = _field(described, 6, _I32)
                if definition < 0 or repetition < 0 or definition + repetition > min(stored, size):
                    raise self.fail(f"levels of {repetition} + {definition} bytes")
                compressed = _flag(described, 7, True)
                rows = _field(described, 3, _I32)
                encoding = _field(described, 4, _I32)
                levels = (repetition, definition)
                page = _Page(kind, body, size, count, encoding, rows, levels, compressed)
            else:
                raise self.fail(f"a page of type {kind}")
            if not 0 <= count <= values - total:
                raise self.fail(f"{count} values where {values - total} are left")
            if self.codec is not None and size > count * _BYTES_PER_VALUE + _SLACK:
                raise self.fail(f"{size} bytes decompressed for {count} values")
            total += count
            pages.append(page)
        return dictionary, pages

    def streams(
        self, page: _Page
    ) -> tuple[np.ndarray, tuple[int, int], tuple[int, int], np.ndarray]:
        """A data page's levels: the bytes they are in and the repetition and the
        definition levels' ``(start, end)`` there; then its values' bytes."""
        if page.kind == _DATA_PAGE:
            raw = self.inflate(page.body, page.size)
            repetition, at = self.prefixed(raw, 0)
            definition = (at, at)
            if self.plan.max_definition:
                definition, at = self.prefixed(raw, at)
            return raw, repetition, definition, raw[at:]
        repeated, defined = page.levels
        levels = repeated + defined
        payload = page.body[levels:]
        if page.compressed:
            payload = self.inflate(payload, page.size - levels)
        return page.body, (0, repeated), (repeated, levels), payload

    def prefixed(self, page: np.ndarray, at: int) -> tuple[tuple[int, int], int]:
        """A data page v1's levels: ``((start, end), next)`` of the stream after its
        4-byte little-endian length at ``at``."""
        if at + 4 > len(page):
            raise self.fail("a level stream's length past the page")
        length = int(page[at : at + 4].view("<u4")[0])
        if at + 4 + length > len(page):
            raise self.fail(f"a level stream of {length} bytes past the page")
        return (at + 4, at + 4 + length), at + 4 + length

    def inflate(self, body: np.ndarray, size: int) -> np.ndarray:
        """A page's bytes, decompressed to exactly ``size`` bytes, or refused: pyarrow's
        ``decompress`` hands back a buffer of ``size`` bytes whatever the data held
        (snappy, gzip and brotli leave the rest uninitialized), so the length is
        proved here as pyarrow's Parquet reader checks it."""
        codec = self.codec
        if codec is None:
            return body
        if codec == "snappy" and _snappy_length(body) != size:  # what it must produce
            raise self.fail(f"snappy data of another length than the header's {size} bytes")
        if codec == "gzip":  # zlib gives its length (the window bits pyarrow uses)
            stream = zlib.decompressobj(15 + 32)
            try:
                raw = stream.decompress(body.tobytes(), size + 1)
            except zlib.error as exc:
                raise self.fail(f"gzip: {exc}") from None
            if len(raw) != size or not stream.eof:
                raise self.fail(f"gzip data of another length than the header's {size} bytes")
            return np.frombuffer(raw, np.uint8)
        pa = self.pa
        raw = pa.decompress(pa.py_buffer(body), decompressed_size=size, codec=codec)
        if codec == "brotli" and size:  # (zstd checks the length itself)
            try:  # one byte less must not be room enough
                pa.decompress(pa.py_buffer(body), decompressed_size=size - 1, codec=codec)
            except (pa.ArrowException, OSError, ValueError):
                pass
            else:
                raise self.fail(f"brotli data shorter than the header's {size} bytes")
        return np.frombuffer(raw, np.uint8)


def _snappy_length(body: np.ndarray) -> int:
    """The decompressed length raw snappy data starts with (a varint), or -1."""
    value = shift = 0
    for byte in body[:5].tolist():
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value
        shift += 7
    return -1


def _field(fields: dict[int, tuple[int, Any]], number: int, kind: int) -> Any:
    """Field ``number`` of a read Thrift struct, which must be there with compact type
    ``kind`` (an i32 inside its 32 bits): where pyarrow's Thrift would skip it or read
    it otherwise, nothing here guesses."""
    found = fields.get(number)
    if found is None or found[0] != kind:
        raise _NotReadHere(f"Thrift field {number} missing or not of type {kind}")
    value = found[1]
    bits = {_I32: 31, _I64: 63}.get(kind)
    if bits is not None and not -(2**bits) <= value < 2**bits:
        raise _NotReadHere(f"Thrift field {number}: {value} is past {bits + 1} bits")
    return value


def _flag(fields: dict[int, tuple[int, Any]], number: int, default: bool) -> bool:
    found = fields.get(number)
    if found is None:
        return default
    if found[0] not in (_TRUE, _FALSE):
        raise _NotReadHere(f"Thrift field {number} not a boolean")
    return found[0] == _TRUE


class _Thrift:
    """Thrift's compact protocol, as far as page headers and the footer's codecs need:
    a struct read into ``{field id: (compact type, value)}`` (nested structs as
    dicts, lists of structs as lists of them; other lists, maps and binaries are read
    past). Nesting is bounded (no recursion past ``_DEPTH``)."""

    _DEPTH = 12

    def __init__(self, data: np.ndarray, pos: int) -> None:
        self.data = data
        self.pos = pos

    def page_header(self) -> tuple[dict[int, tuple[int, Any]], int]:
        return self.struct(0), self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _NotReadHere("a Thrift header past the chunk")
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
                raise _NotReadHere("a Thrift varint over 10 bytes")

    def integer(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)  # zigzag

    def struct(self, depth: int) -> dict[int, tuple[int, Any]]:
        if depth > self._DEPTH:
            raise _NotReadHere("Thrift nested too deep")
        fields: dict[int, tuple[int, Any]] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.integer()
            fields[last] = (kind, self.value(kind, depth))

    def value(self, kind: int, depth: int) -> Any:
        if kind in (_TRUE, _FALSE):  # a struct field's boolean, held in its type
            return kind == _TRUE
        if kind == 3:
            return self.byte()
        if kind in (4, _I32, _I64):
            return self.integer()
        if kind == 7:
            self.skip(8)
            return None
        if kind == 8:
            self.skip(self.varint())
            return None
        if kind in (_LIST, 10):  # list, set
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            if head & 0x0F == _STRUCT:
                return [self.element(_STRUCT, depth + 1) for _ in range(size)]
            for _ in range(size):
                self.element(head & 0x0F, depth + 1)
            return None
        if kind == 11:  # map
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.element(types >> 4, depth + 1)
                    self.element(types & 0x0F, depth + 1)
            return None
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise _NotReadHere(f"Thrift type {kind}")

    def element(self, kind: int, depth: int) -> Any:
        if depth > self._DEPTH:
            raise _NotReadHere("Thrift nested too deep")
        if kind in (_TRUE, _FALSE):  # a list's boolean: one byte
            return self.byte()
        return self.value(kind, depth)

    def skip(self, size: int) -> None:
        if self.pos + size > len(self.data):
            raise _NotReadHere("a Thrift binary past the chunk")
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
