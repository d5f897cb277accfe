"""Block reading: the compiled gather and shuffle buffer against their plain-Python
references (``streampack.reference.corpus``), and blocks against the records they
replace."""

from __future__ import annotations

import numpy as np
import pytest

from streampack.corpus.gather import copy_ranges, gather_ranges
from streampack.corpus.order import buffered_shuffle, buffered_shuffle_blocks, epoch_rng
from streampack.corpus.reader import Block
from streampack.reference import corpus as reference


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.bool_])
def test_gather_ranges_is_the_reference(tmp_path, dtype):
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2 if dtype == np.bool_ else 500, 1000).astype(dtype)
    np.save(tmp_path / "v.npy", values)
    mapped = np.load(tmp_path / "v.npy", mmap_mode="r")  # read in place, read-only
    lengths = rng.integers(0, 30, 60)
    starts = rng.integers(0, 1000 - 30, 60)
    lengths[[3, 17]] = 0
    out = gather_ranges(mapped, starts, lengths)
    assert out.dtype == dtype
    assert out.tolist() == reference.gather_ranges(values.tolist(), starts, lengths)
    wide = gather_ranges(mapped, starts, lengths, np.int64)
    assert wide.dtype == np.int64 and wide.tolist() == [int(v) for v in out.tolist()]
    # copy_ranges: the same ranges, each to its place in a shuffled window
    order = rng.permutation(60)
    places = np.empty(60, np.int64)
    places[order] = np.cumsum(lengths[order]) - lengths[order]
    window = np.full(int(lengths.sum()), 7, np.int32)
    copy_ranges(mapped, starts, lengths, window, places)
    expected = reference.gather_ranges(values.tolist(), starts[order], lengths[order])
    assert window.tolist() == [int(v) for v in expected]


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_megatron_document_starts_are_the_reference(itemsize):
    """Documents of several sequences, the sentinel document (one past the last
    sequence) among them, indexed as the window cut does (a 2-D stack of starts and
    ends) and one at a time."""
    from streampack.corpus.megatron import _DocumentOffsets

    rng = np.random.default_rng(itemsize)
    sizes = rng.integers(0, 9, 40)
    pointers = (np.concatenate([[0], np.cumsum(sizes)[:-1]]) * itemsize).astype(np.int64)
    documents = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 40), 11, False)), [40]])
    total = int(sizes.sum())
    offsets = _DocumentOffsets(pointers, documents, itemsize, total)
    at = rng.integers(0, len(documents) - 1, 25)
    at[3] = len(documents) - 2  # the last document: its end is the sentinel
    key = np.stack([at, at + 1])
    expected = [
        reference.document_token_starts(
            documents.tolist(), pointers.tolist(), itemsize, total, row.tolist()
        )
        for row in key
    ]
    assert offsets[key].tolist() == expected
    every = reference.document_token_starts(
        documents.tolist(), pointers.tolist(), itemsize, total, list(range(len(documents)))
    )
    assert [offsets[d] for d in range(len(documents))] == every
    assert offsets[2:5].tolist() == every[2:5]


def _block(first: int, lengths: list[int], problems: dict[int, tuple[str, str]]) -> Block:
    n = len(lengths)
    tokens = np.concatenate([np.full(k, first + i, np.int64) for i, k in enumerate(lengths)])
    ids = np.arange(first, first + n, dtype=np.int64)
    return Block(
        tokens=tokens,
        lengths=np.array(lengths, np.int64),
        starts=np.zeros(n, np.int64),
        stops=np.array(lengths, np.int64),
        source_ids=ids,
        example_ids=ids + 1000,
        problems=problems,
        mask=(tokens % 2).astype(np.uint8),
        mask_lengths=np.array(lengths, np.int64),
    )


@pytest.mark.parametrize("size", [1, 7, 50, 64, 500])
@pytest.mark.parametrize("block_size", [1, 13, 64])
def test_the_block_shuffle_emits_what_the_record_shuffle_does(size, block_size):
    """Every document in the order ``buffered_shuffle`` (and the reference) gives for
    the same seed, with its tokens, mask, ids and problems — a buffer smaller than,
    equal to and larger than the corpus, blocks of one document and more."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 9, 300).tolist()
    blocks = []
    for lo in range(0, 300, block_size):
        part = lengths[lo : lo + block_size]
        bad = {i: ("malformed", f"doc {lo + i}") for i in range(len(part)) if (lo + i) % 37 == 5}
        blocks.append(_block(lo, part, bad))
    expected = list(buffered_shuffle(iter(range(300)), size, epoch_rng(3, 1)))
    draws = epoch_rng(3, 1)
    assert expected == reference.shuffle_buffer(
        list(range(300)), size, lambda n: int(draws.integers(n))
    )
    out = Block.concat(list(buffered_shuffle_blocks(iter(blocks), size, epoch_rng(3, 1))))
    assert out.source_ids.tolist() == expected
    assert out.example_ids.tolist() == [i + 1000 for i in expected]
    assert out.lengths.tolist() == [lengths[i] for i in expected]
    tokens = [i for i in expected for _ in range(lengths[i])]
    assert out.tokens.tolist() == tokens
    assert out.mask is not None and out.mask.tolist() == [t % 2 for t in tokens]
    assert out.problems == {
        at: ("malformed", f"doc {i}") for at, i in enumerate(expected) if i % 37 == 5
    }


def _lines(masked: str | None) -> list[str]:
    """Lines of every shape: plain ones the compiled parser reads and every kind it
    leaves to ``json`` (each bad one quarantined with its reason by parse_line)."""
    import json

    rng = np.random.default_rng(5)
    out = []
    for i in range(120):
        doc = rng.integers(0, 512, int(rng.integers(2, 30))).tolist()
        line: dict[str, object] = {"tokens": doc}
        if i % 3 == 0:
            line["id"] = 10_000 + i
        if i % 5 == 0:
            line["start"], line["stop"] = 1, len(doc) - 1
        if masked == "mask":
            line["mask"] = [0] + [1] * (len(doc) - 1)
        elif masked == "labels":
            line["labels"] = [-100] + doc[1:]
        out.append(json.dumps(line, separators=(",", ":") if i % 2 else (", ", ": ")))
    extra = "" if masked is None else f', "{masked}": [1, 1, 1]'
    out[3:3] = [
        '{"tokens": [1, 2, 3]' + extra + "}",
        '  {  "tokens" :[ 1 ,2,  3 ]\t' + extra + " }  ",
        '{"tokens": [-0, 5, 6]' + extra + "}",
        '{"tokens": [1, 2, 123456789012345678]' + extra + "}",
        '{"tokens": [1, 2, 1234567890123456789]' + extra + "}",
        '{"tokens": [1, 2, 12345678901234567890123]' + extra + "}",
        '{"tokens": [1, 2.0, 3]' + extra + "}",
        '{"tokens": [1, 2e0, 3]' + extra + "}",
        '{"tokens": [1, true, 3]' + extra + "}",
        '{"tokens": [1, null, 3]' + extra + "}",
        '{"tokens": [01, 2, 3]' + extra + "}",
        '{"tokens": [1, 2, 3,]' + extra + "}",
        '{"tokens": []' + extra + "}",
        '{"tokens": [1, 2, 3], "tokens": [4, 5, 6]' + extra + "}",
        '{"tokens": [1, 2, 3], "text": "a \\u00e9 b"' + extra + "}",
        '{"tokens": [1, 2, 3], "meta": {"a": [1]}' + extra + "}",
        '{"tokens": [1, 2, 3]' + extra + '} {"tokens": [4, 5]}',
        '{"tokens": [1, 2, 3]' + extra + "} x",
        '\ufeff{"tokens": [1, 2, 3]' + extra + "}",
        '{"tokens": [1, 2, 3], "id": null' + extra + "}",
        '{"tokens": [1, 2, 3], "id": 9223372036854775808' + extra + "}",
        '{"tokens": [1, 2, 3], "id": true' + extra + "}",
        '{"tokens": [1, 2, 3], "start": 2, "stop": 1' + extra + "}",
        '{"tokens": [1, 2, 3], "stop": 4' + extra + "}",
        '{"tokens": [1, 2, 3], "start": -1' + extra + "}",
        '{"\\u0074okens": [1, 2, 3]' + extra + "}",
        '{"Tokens": [1, 2, 3]' + extra + "}",
        '{"tokens": [1, 2, 3], "x": ' + "[" * 5000 + "]" * 5000 + extra + "}",
        "[" * 5000,
        "[1, 2, 3]",
        "7",
        "{}",
        '{"tokens": "1 2 3"' + extra + "}",
        '{"tokens": [1, 2, 3]',
        "\x0b",
        "\x0c {",
    ]
    if masked is not None:
        out[40:40] = [
            '{"tokens": [1, 2, 3]}',
            f'{{"tokens": [1, 2, 3], "{masked}": [1, 1]}}',
            f'{{"tokens": [1, 2, 3], "{masked}": [1, 2, 1]}}',
            f'{{"tokens": [1, 2, 3], "{masked}": [true, false, true]}}',
            f'{{"tokens": [1, 2, 3], "{masked}": null}}',
            f'{{"tokens": [1, 2, 3], "{masked}": [-100, 7, 3]}}',
            f'{{"tokens": [1, 2, 3], "{masked}": [0, 0, 0]}}',
        ]
    return out


@pytest.mark.parametrize("masked", [None, "mask", "labels"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_compiled_json_lines_read_as_json_reads_them(tmp_path, monkeypatch, masked, shuffle):
    """Every line as parse_line (``json``) reads it: the same windows, byte for byte,
    with the compiled parser and with every line left to ``json`` — bad lines keep
    their reasons, details and line numbers, blank lines are skipped."""
    from _formats import manifest
    from test_stream_pins import window_digest

    from streampack.corpus import open_corpus
    from streampack.kernels import corpus_cpu
    from streampack.windows import CutSpec, iter_windows

    lines = _lines(masked)
    lines[50:50] = ["", "  ", "\t"]
    (tmp_path / "docs.jsonl").write_bytes(
        "\n".join(lines).encode("utf-8", "surrogatepass") + b"\n\xff\xfe{}\n"
    )
    path = manifest(tmp_path, jsonl=["docs.jsonl"], **({} if masked is None else {masked: masked}))
    spec = CutSpec(capacity=24, window_documents=17, window_tokens=200, shuffle=shuffle)
    parse = corpus_cpu.parse_token_lines
    accepted = []

    def counted(*args):
        parse(*args)
        accepted.append(int(args[5].sum()))

    monkeypatch.setattr(corpus_cpu, "parse_token_lines", counted)
    compiled = window_digest(path, spec)
    assert sum(accepted) >= 100  # the plain lines went the compiled way
    reasons = {q["reason"] for w in iter_windows(open_corpus(path), 1, spec) for q in w.quarantined}
    assert {"malformed", "bad_range", "wrong_dtype", "out_of_vocabulary"} <= reasons
    monkeypatch.setattr(corpus_cpu, "parse_token_lines", lambda *args: None)
    assert window_digest(path, spec) == compiled


def test_blank_lines_are_what_bytes_strip_leaves_empty():
    from streampack.corpus.jsonl import _line_bounds, _not_blank

    rng = np.random.default_rng(6)
    alphabet = np.frombuffer(b" \t\r\x0b\x0c\nab{", np.uint8)
    chunk = rng.choice(alphabet, 4000, p=[0.3, 0.1, 0.1, 0.05, 0.05, 0.3, 0.03, 0.03, 0.04])
    data = chunk.tobytes()
    starts, ends = _line_bounds(data)
    expected = [bool(data[lo:hi].strip()) for lo, hi in zip(starts, ends, strict=True)]
    assert _not_blank(data, starts, ends).tolist() == expected
    assert b"".join(data[lo:hi] for lo, hi in zip(starts, ends, strict=True)) == data


_READ_PEAK = """
import sys, tracemalloc
import pyarrow as pa
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows
spec = CutSpec(capacity=64, window_documents=64, window_tokens=4096,
               shuffle=sys.argv[2] == "1", shuffle_buffer=256)
for _ in iter_windows(open_corpus(sys.argv[1]), 0, spec):  # imports and compilation first
    pass
tracemalloc.start()
documents = sum(w.documents for w in iter_windows(open_corpus(sys.argv[1]), 0, spec))
print(documents, tracemalloc.get_traced_memory()[1], pa.default_memory_pool().max_memory())
"""


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("null_rows", [False, True], ids=["our-decoder", "pyarrow"])
def test_parquet_holds_a_few_row_groups_not_the_file(tmp_path, shuffle, null_rows):
    """A Parquet file of 40 row groups (4 MB of tokens) read whole, in a fresh process:
    NumPy's peak (tracemalloc) and pyarrow's (its pool) each stay a few row groups: those
    being decoded (``DECODERS``), decoded and queued (``READ_AHEAD``), held by the
    read-ahead thread, being cut, still sliced by a window, and the shuffle buffer's
    int64 copies; not the file. Row groups read by parquet_pages are NumPy's; a null
    row in each row group sends every one to pyarrow instead."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    from _formats import manifest

    from streampack.corpus.parquet import DECODERS, READ_AHEAD

    rows, per_row = 40 * 500, 50  # 20,000 documents of 50 int32 tokens: 4 MB
    values = pa.array((np.arange(rows * per_row) % 500).astype(np.int32))
    offsets = pa.array(np.arange(0, rows * per_row + 1, per_row, dtype=np.int32))
    null = pa.array(np.arange(rows) % 500 == 7) if null_rows else None
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, values, mask=null)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=500)
    path = manifest(tmp_path, parquet=["big.parquet"])
    out = subprocess.run(
        [sys.executable, "-c", _READ_PEAK, str(path), str(int(shuffle))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    documents, numpy_peak, pyarrow_peak = map(int, out)
    group = 500 * per_row * 4  # one row group's int32 tokens
    assert documents == rows  # quarantined ones included
    # NumPy: the row groups held as blocks (decoding, queued, handed over, being cut,
    # sliced by a window) and the shuffle buffer's int64 copies.
    held = (DECODERS + READ_AHEAD + 3) * group + 4 * (2 * group)
    assert numpy_peak <= held, numpy_peak / group
    # pyarrow: footers and page buffers only, or, for the row groups it decodes, about
    # three row groups' worth per decoder (pages, levels, values) until the block is made.
    pyarrow_held = (3 * DECODERS + 1) * group if null_rows else group
    assert pyarrow_peak <= pyarrow_held, pyarrow_peak / group


@pytest.mark.parametrize("decoders", [2, 3])
def test_parquet_row_groups_decoded_at_once_come_in_order(tmp_path, monkeypatch, decoders):
    """Row groups decoded on several threads (``DECODERS``) reach the cut in corpus
    order, across files: every window, shuffled or not, is the one-decoder window."""
    from _formats import documents, masks, write_parquet

    from streampack.corpus import open_corpus, parquet
    from streampack.windows import CutSpec, iter_windows

    docs = documents(300, seed=8)
    path = write_parquet(
        tmp_path, docs, row_group_size=7, files=3, supervision={"completion_mask": masks(docs)}
    )

    def windows() -> list[list[list[int]]]:
        out = []
        for shuffle in (False, True):
            spec = CutSpec(capacity=64, window_documents=9, window_tokens=200, shuffle=shuffle)
            for w in iter_windows(open_corpus(path), 0, spec):
                out.append([a.tolist() for a in w.arrays().values()])
        return out

    monkeypatch.setattr(parquet, "DECODERS", 1)
    expected = windows()
    monkeypatch.setattr(parquet, "DECODERS", decoders)
    assert windows() == expected


_LONG_LINE_PEAK = """
import json, sys
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

def peak():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))

spec = CutSpec(capacity=64, window_documents=16, window_tokens=1 << 16)
list(iter_windows(open_corpus(sys.argv[1]), 0, spec))  # imports and kernels first
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak from here on
before = peak()
source = open_corpus(sys.argv[2])
windows = [[q["reason"] for q in w.quarantined] for w in iter_windows(source, 0, spec)]
print(json.dumps({"growth": peak() - before, "windows": windows}))
"""


def test_a_huge_json_line_costs_a_few_times_its_bytes(tmp_path):
    """One JSON Lines line of 10 M one-digit tokens (20 MB) between two short ones:
    reading it raises the peak resident set (a fresh process, after imports and
    compilation) by at most 4x the line — its bytes once, its tokens as int32 — and
    it is quarantined as too long, its neighbours kept."""
    import json
    import os
    import subprocess
    import sys

    from _formats import manifest

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    count = 10_000_000
    line = b'{"tokens": [' + b"1," * (count - 1) + b"1]}\n"
    small, huge = tmp_path / "small", tmp_path / "huge"
    small.mkdir()
    huge.mkdir()
    (small / "docs.jsonl").write_bytes(b'{"tokens": [1, 2, 3]}\n')
    (huge / "docs.jsonl").write_bytes(b'{"tokens": [1, 2]}\n' + line + b'{"tokens": [3, 4]}\n')
    manifest(small, jsonl=["docs.jsonl"])
    manifest(huge, jsonl=["docs.jsonl"])
    out = subprocess.run(
        [sys.executable, "-c", _LONG_LINE_PEAK, str(small), str(huge)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    measured = json.loads(out)
    assert measured["windows"] == [[], ["too_long"], []]
    assert measured["growth"] <= 4 * len(line), measured["growth"] / len(line)


@pytest.mark.parametrize("masked", [None, "labels"])
def test_json_list_values_outside_int32_are_read_by_json_alike(tmp_path, monkeypatch, masked):
    """The compiled parser writes int32: a line with a list value outside that range
    goes to ``json``, and every line reads as ``json`` reads it (the windows, byte for
    byte) — out-of-vocabulary details keep the exact value."""
    import json

    from _formats import manifest
    from test_stream_pins import window_digest

    from streampack.corpus import open_corpus
    from streampack.kernels import corpus_cpu
    from streampack.windows import CutSpec, iter_windows

    edges = [2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 10**17]
    lines = []
    for value in edges:
        line: dict[str, object] = {"tokens": [1, value, 2]}
        if masked:
            line[masked] = [-100, -100, 2]
        lines.append(json.dumps(line))
    lines.append(json.dumps({"tokens": [3, 4, 5], **({masked: [-100, 4, 5]} if masked else {})}))
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    path = manifest(tmp_path, jsonl=["docs.jsonl"], **({} if masked is None else {masked: masked}))
    spec = CutSpec(capacity=24, window_documents=4, window_tokens=200)
    parse = corpus_cpu.parse_token_lines
    accepted = []

    def counted(*args):
        parse(*args)
        accepted.extend(args[5].tolist())

    monkeypatch.setattr(corpus_cpu, "parse_token_lines", counted)
    compiled = window_digest(path, spec)
    assert accepted == [True, False, True, False, False, True]
    details = [q["detail"] for w in iter_windows(open_corpus(path), 1, spec) for q in w.quarantined]
    assert details[1] == "tokens span [1, 2147483648]; vocabulary is [0, 512)"
    monkeypatch.setattr(corpus_cpu, "parse_token_lines", lambda *args: None)
    assert window_digest(path, spec) == compiled
