"""``streampack.corpus.parquet_pages``: every row group it reads equals pyarrow's
reading of it, for every way the common writers store a token column; whatever it
does not read (nulls, empty lists, other value types, pages it does not know) it
leaves to pyarrow by returning None."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampack.corpus import parquet_pages


def token_lists(lengths: list[int], vocab: int, seed: int, dtype=np.int32) -> pa.ListArray:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, vocab, sum(lengths)).astype(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def read_both(
    path: Path, column: str = "input_ids", pyarrow: bool = True
) -> list[tuple[object, pa.ListArray | None]]:
    """Per row group: what parquet_pages reads (``(offsets, tokens)`` or None) and
    pyarrow's list array (None unless ``pyarrow``)."""
    handle = pq.ParquetFile(str(path))
    data = parquet_pages.file_bytes(path)
    plan = parquet_pages.column_plan(pa, handle, column, data)
    out = []
    for group in range(handle.metadata.num_row_groups):
        ours = None if plan is None else parquet_pages.read_row_group(pa, data, plan, group)
        if isinstance(ours, str):  # why it is not read here
            ours = None
        theirs = None
        if pyarrow:
            theirs = handle.read_row_group(group, columns=[column]).column(0).combine_chunks()
        out.append((ours, theirs))
    return out


def assert_same(path: Path) -> None:
    both = read_both(path)
    assert both
    for ours, theirs in both:
        assert ours is not None and theirs is not None
        offsets, tokens = ours
        want = theirs.offsets.to_numpy().astype(np.int64)
        assert offsets.dtype == np.int64 and offsets.tolist() == (want - want[0]).tolist()
        values = theirs.values.to_numpy()[want[0] : want[-1]]
        assert tokens.dtype == values.dtype and np.array_equal(tokens, values)


LEAF = "input_ids.list.element"  # the token column's leaf, as writers name it
WRITERS = {
    "default": {},
    "no-dictionary": {"use_dictionary": False},
    "uncompressed": {"compression": "none"},
    "gzip": {"compression": "gzip"},
    "zstd": {"compression": "zstd"},
    "brotli": {"compression": "brotli"},
    "page-v2": {"data_page_version": "2.0"},
    "page-v2-uncompressed": {"data_page_version": "2.0", "compression": "none"},
    # Small pages: documents run across page boundaries (v1 lets them).
    "small-pages": {"data_page_size": 2048},
    "small-pages-v2": {"data_page_size": 2048, "data_page_version": "2.0"},
    # The dictionary outgrows its page limit: the rest of the chunk is PLAIN.
    "dictionary-fallback": {"dictionary_pagesize_limit": 4096, "data_page_size": 8192},
}


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_setting_reads_as_pyarrow_reads_it(tmp_path, writer):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 600, 900).tolist() + [1, 1, 5000, 1]
    table = pa.table({"input_ids": token_lists(lengths, 50_000, seed=4)})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=300, **WRITERS[writer])
    assert_same(tmp_path / "t.parquet")


def test_the_dictionary_fallback_case_really_mixes_encodings(tmp_path):
    """The fallback setting above does store PLAIN pages after dictionary ones (else
    it would test nothing new)."""
    table = pa.table({"input_ids": token_lists([400] * 300, 50_000, seed=4)})
    pq.write_table(table, tmp_path / "t.parquet", **WRITERS["dictionary-fallback"])
    chunk = pq.ParquetFile(str(tmp_path / "t.parquet")).metadata.row_group(0).column(0)
    assert {"PLAIN", "RLE_DICTIONARY"} <= set(chunk.encodings) or {
        "PLAIN",
        "PLAIN_DICTIONARY",
    } <= set(chunk.encodings)


@pytest.mark.parametrize("vocab", [1, 2, 3, 255, 256, 70_000, 2**31 - 1])
def test_every_dictionary_index_width_reads_as_pyarrow_reads_it(tmp_path, vocab):
    """Index widths 0 (one distinct token) to 17 bits, and a dictionary given up for
    PLAIN (distinct tokens past its limit)."""
    rng = np.random.default_rng(vocab % 1000)
    lengths = rng.integers(1, 300, 400).tolist()
    table = pa.table({"input_ids": token_lists(lengths, vocab, seed=5)})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=150)
    assert_same(tmp_path / "t.parquet")


@pytest.mark.parametrize(
    "field",
    [
        pa.field("input_ids", pa.list_(pa.int64())),
        pa.field("input_ids", pa.large_list(pa.int32())),
        pa.field("input_ids", pa.list_(pa.field("item", pa.int32(), nullable=False))),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field(
            "input_ids", pa.list_(pa.field("item", pa.int64(), nullable=False)), nullable=False
        ),
    ],
    ids=["int64", "large-list", "required-tokens", "required-rows", "required-both"],
)
def test_other_list_types_and_nullability_read_as_pyarrow_reads_them(tmp_path, field):
    dtype = field.type.value_type.to_pandas_dtype()
    lists = token_lists([3, 1, 700, 20] * 50, 40_000, seed=6, dtype=dtype)
    table = pa.table({"input_ids": lists.cast(field.type)}, schema=pa.schema([field]))
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=64)
    assert_same(tmp_path / "t.parquet")


def test_the_token_column_is_found_among_others(tmp_path):
    lists = token_lists([5, 9, 2] * 40, 1000, seed=7)
    table = pa.table(
        {"id": pa.array(range(120)), "input_ids": lists, "text": pa.array(["x"] * 120)}
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=50)
    assert_same(tmp_path / "t.parquet")


@pytest.mark.parametrize(
    "lists",
    [
        pa.array([[1, 2], None, [3]], pa.list_(pa.int32())),  # a null row
        pa.array([[1, 2], [None, 4], [3]], pa.list_(pa.int32())),  # a null token
        pa.array([[1, 2], [], [3]], pa.list_(pa.int32())),  # an empty document
    ],
    ids=["null-row", "null-token", "empty-list"],
)
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_a_row_group_with_a_null_or_an_empty_list_is_left_to_pyarrow(tmp_path, lists, version):
    """What the levels say is not a plain document: None for that row group only."""
    good = pa.array([[5, 6, 7]] * 3, pa.list_(pa.int32()))
    table = pa.table({"input_ids": pa.concat_arrays([good, lists])})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3, data_page_version=version)
    (first, _), (second, _) = read_both(tmp_path / "t.parquet")
    assert first is not None and first[1].tolist() == [5, 6, 7] * 3
    assert second is None


@pytest.mark.parametrize(
    "kind",
    [pa.int8(), pa.int16(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()],
    ids=str,
)
def test_every_integer_type_reads_as_pyarrow_reads_it(tmp_path, kind):
    """Narrow types are stored as INT32 and cast back; unsigned ones up to their top
    value (the bit patterns of uint32 and uint64 past the signed range included)."""
    top = np.iinfo(kind.to_pandas_dtype()).max
    rng = np.random.default_rng(11)
    values = [rng.integers(0, top, 40, dtype=kind.to_pandas_dtype(), endpoint=True).tolist()]
    lists = pa.array(values * 30 + [[0, top]], pa.list_(kind))
    pq.write_table(pa.table({"input_ids": lists}), tmp_path / "t.parquet", row_group_size=8)
    assert_same(tmp_path / "t.parquet")


def test_a_list_of_other_values_is_left_to_pyarrow(tmp_path):
    table = pa.table({"input_ids": pa.array([[True, False], [True]], pa.list_(pa.bool_()))})
    pq.write_table(table, tmp_path / "t.parquet")
    handle = pq.ParquetFile(str(tmp_path / "t.parquet"))
    data = parquet_pages.file_bytes(tmp_path / "t.parquet")
    assert parquet_pages.column_plan(pa, handle, "input_ids", data) is None


@pytest.mark.parametrize(
    "writer",
    [
        {"compression": "lz4"},
        {"use_dictionary": False, "column_encoding": {LEAF: "DELTA_BINARY_PACKED"}},
        {"use_dictionary": False, "column_encoding": {LEAF: "BYTE_STREAM_SPLIT"}},
    ],
    ids=["lz4", "delta-binary-packed", "byte-stream-split"],
)
def test_a_codec_or_encoding_not_read_here_is_left_to_pyarrow(tmp_path, writer):
    table = pa.table({"input_ids": token_lists([30] * 50, 1000, seed=8)})
    pq.write_table(table, tmp_path / "t.parquet", **writer)
    [(ours, theirs)] = read_both(tmp_path / "t.parquet")
    assert ours is None and theirs is not None and len(theirs) == 50


def test_a_damaged_page_header_is_left_to_pyarrow(tmp_path):
    """The first page header overwritten: None, no exception (the reader then asks
    pyarrow, whose error names the damage)."""
    table = pa.table({"input_ids": token_lists([30] * 50, 1000, seed=8)})
    pq.write_table(table, tmp_path / "t.parquet", compression="none")
    chunk = pq.ParquetFile(str(tmp_path / "t.parquet")).metadata.row_group(0).column(0)
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    raw = bytearray((tmp_path / "t.parquet").read_bytes())
    raw[start : start + 6] = b"\xff" * 6
    (tmp_path / "t.parquet").write_bytes(bytes(raw))
    [(ours, _)] = read_both(tmp_path / "t.parquet", pyarrow=False)
    assert ours is None


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=120),
    vocab=st.sampled_from([1, 7, 300, 65_536, 1 << 20]),
    rows=st.integers(1, 50),
    page=st.sampled_from([256, 4096, 1 << 20]),
    version=st.sampled_from(["1.0", "2.0"]),
    dictionary=st.booleans(),
    compression=st.sampled_from(["none", "snappy", "zstd"]),
    seed=st.integers(0, 1000),
)
def test_random_token_columns_read_as_pyarrow_reads_them(
    tmp_path, lengths, vocab, rows, page, version, dictionary, compression, seed
):
    table = pa.table({"input_ids": token_lists(lengths, vocab, seed)})
    pq.write_table(
        table,
        tmp_path / "t.parquet",
        row_group_size=rows,
        data_page_size=page,
        data_page_version=version,
        use_dictionary=dictionary,
        compression=compression,
    )
    assert_same(tmp_path / "t.parquet")


def test_a_header_field_of_the_wrong_kind_is_left_to_pyarrow(tmp_path):
    """A well-formed Thrift header whose dictionary-page field is an integer, not a
    struct: None, not an AttributeError."""
    table = pa.table({"input_ids": token_lists([30] * 50, 1000, seed=8)})
    pq.write_table(table, tmp_path / "t.parquet", compression="none")
    chunk = pq.ParquetFile(str(tmp_path / "t.parquet")).metadata.row_group(0).column(0)
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    # Compact protocol: field 1 (i32) = 2, a dictionary page; fields 2 and 3 (i32) = 0
    # bytes; field 7 (i32) = 5 where a DictionaryPageHeader struct belongs; stop.
    header = bytes([0x15, 0x04, 0x15, 0x00, 0x15, 0x00, 0x45, 0x0A, 0x00])
    raw = bytearray((tmp_path / "t.parquet").read_bytes())
    raw[start : start + len(header)] = header
    (tmp_path / "t.parquet").write_bytes(bytes(raw))
    [(ours, _)] = read_both(tmp_path / "t.parquet", pyarrow=False)
    assert ours is None


def test_the_dictionary_kernel_refuses_what_it_cannot_look_up():
    """An index past the dictionary (in a repeated run and bit-packed), an empty
    dictionary, an index wider than 32 bits, a stream that ends early: -1, nothing
    read outside the stream or the dictionary."""
    from streampack.kernels import parquet_cpu

    out = np.zeros(8, np.int32)
    dictionary = np.array([10, 11, 12], np.int32)
    packed = np.array([0x03, 0b10_01_00_10, 0b00_00_00_01], np.uint8)  # 8 x 2 bits
    args = (0, len(packed), 2, 8)
    assert parquet_cpu.dictionary_values(packed, *args, dictionary, out, 0) == 8
    assert out.tolist() == [12, 10, 11, 12, 11, 10, 10, 10]
    past = parquet_cpu.PAST_DICTIONARY
    assert parquet_cpu.dictionary_values(packed, *args, dictionary[:2], out, 0) == past
    assert parquet_cpu.dictionary_values(packed, *args, dictionary[:0], out, 0) == past
    repeated = np.array([8 << 1, 3], np.uint8)  # 8 copies of index 3
    assert parquet_cpu.dictionary_values(repeated, 0, 2, 2, 8, dictionary, out, 0) == past
    ends = parquet_cpu.ENDS_EARLY
    assert parquet_cpu.dictionary_values(packed, 0, 2, 2, 8, dictionary, out, 0) == ends
    wide = parquet_cpu.BAD_WIDTH
    assert parquet_cpu.dictionary_values(packed, 0, 3, 33, 8, dictionary, out, 0) == wide
    # A stream said to end past its buffer, an output slice past its array: refused
    # before anything is read or written.
    outside = parquet_cpu.OUT_OF_BOUNDS
    assert parquet_cpu.dictionary_values(packed, 0, 4, 2, 8, dictionary, out, 0) == outside
    assert parquet_cpu.dictionary_values(packed, *args, dictionary, out, 1) == outside
    # A run header of zero values, and one over 5 bytes (pyarrow reads neither).
    zero = np.array([0, 0, 0x03, 0b10_01_00_10, 0b00_00_00_01], np.uint8)
    assert (
        parquet_cpu.dictionary_values(zero, 0, 5, 2, 8, dictionary, out, 0) == parquet_cpu.BAD_RUN
    )
    long = np.array([0x83, 0x80, 0x80, 0x80, 0x80, 0x00, 0xFF, 0xFF], np.uint8)
    assert (
        parquet_cpu.dictionary_values(long, 0, 8, 2, 8, dictionary, out, 0) == parquet_cpu.BAD_RUN
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    version=st.sampled_from(["1.0", "2.0"]),
)
def test_damaged_bytes_give_a_reading_or_none_never_an_error(tmp_path, flips, version):
    """Bytes of the column chunk overwritten at random: parquet_pages returns None or
    arrays of the row group's shape (what a damaged value page decodes to, pyarrow
    would read too: Parquet keeps no checksum by default), and raises nothing."""
    path = tmp_path / f"t-{version}.parquet"  # headers, levels and values, damaged alike
    if not path.exists():
        table = pa.table({"input_ids": token_lists([40, 3, 200] * 20, 5000, seed=9)})
        pq.write_table(
            table, path, row_group_size=60, data_page_size=1024, data_page_version=version
        )
    handle = pq.ParquetFile(str(path))
    chunk = handle.metadata.row_group(0).column(0)
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    data = np.array(parquet_pages.file_bytes(path))  # a copy to damage
    for at, value in flips:
        data[start + at % chunk.total_compressed_size] = value
    plan = parquet_pages.column_plan(pa, handle, "input_ids", data)
    assert plan is not None
    read = parquet_pages.read_row_group(pa, data, plan, 0)
    if not isinstance(read, str):
        offsets, tokens = read
        assert len(offsets) == 61 and offsets[0] == 0 and offsets[-1] == len(tokens)
        assert (np.diff(offsets) >= 1).all() and len(tokens) == chunk.num_values
