"""A file-level problem gets a file-level answer (issue 22): a file whose dtype or type a
reader cannot take is read correctly or refused when the corpus is opened, in one line
naming the file, what it holds and what is accepted (``streampack digest`` and
``produce`` exit 2) — never served as healthy while every document it holds goes to
quarantine one by one. One case per reader, at least.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
from _formats import documents, manifest, megatron_index, write_megatron

from streampack import cli
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

DOCS = documents(30)
SPEC = CutSpec(capacity=64, window_documents=8, window_tokens=400)


def write_shard(root: Path, dtype: str) -> Path:
    lengths = [len(d) for d in DOCS]
    np.save(root / "s.tokens.npy", np.concatenate(DOCS).astype(dtype))
    np.save(root / "s.offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return manifest(root, shards=["s"])


def windows(corpus: Path, shuffle: bool) -> list[tuple[list[int], list[int], int]]:
    spec = dataclasses.replace(SPEC, shuffle=shuffle, seed=3)
    return [
        (w.tokens.tolist(), w.source_id.tolist(), len(w.quarantined))
        for w in iter_windows(open_corpus(corpus), 0, spec)
    ]


@pytest.mark.parametrize("dtype", [">i4", ">u2", "<i8", ">i8", ">i2", "<u4", ">u4"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_shard_of_any_integer_dtype_is_read_as_its_values(tmp_path, dtype, shuffle):
    """A big-endian int32 shard (the issue's case), or int64, int16, ...: each window
    takes the values, byte-swapped where need be, exactly as from an int32 shard;
    nothing is quarantined."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = windows(write_shard(tmp_path / "a", "<i4"), shuffle)
    got = windows(write_shard(tmp_path / "b", dtype), shuffle)
    assert got == want and all(quarantined == 0 for *_, quarantined in got)


def test_a_big_endian_shard_streams_exactly_the_int32_shards_digest(tmp_path, capsys):
    digests = []
    for dtype in ("<i4", ">i4"):
        (tmp_path / dtype).mkdir()
        corpus = write_shard(tmp_path / dtype, dtype)
        assert cli.main(["digest", "--corpus", str(corpus), "--capacity", "64"]) == 0
        digests.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert digests[0] == digests[1] and digests[0]["batches"] > 0


def _float_shard(root: Path) -> Path:
    return write_shard(root, "<f4")


def _jsonl(root: Path, lines: list[str], name: str = "docs.jsonl") -> Path:
    (root / name).write_text("\n".join(lines) + "\n")
    return manifest(root, jsonl=[name])


def _jsonl_other_schema(root: Path) -> Path:
    return _jsonl(root, ["", *(json.dumps({"input_ids": d, "text": "x"}) for d in DOCS)])


def _jsonl_gzipped(root: Path) -> Path:
    data = "\n".join(json.dumps({"tokens": d}) for d in DOCS).encode()
    (root / "docs.jsonl").write_bytes(gzip.compress(data))
    return manifest(root, jsonl=["docs.jsonl"])


def _jsonl_float_tokens(root: Path) -> Path:
    return _jsonl(root, [json.dumps({"tokens": [t + 0.5 for t in d]}) for d in DOCS])


def _parquet(root: Path, arrays: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(arrays), root / "f.parquet")
    return manifest(root, parquet=["f.parquet"])


def _parquet_float_column(root: Path) -> Path:
    import pyarrow as pa

    return _parquet(root, {"input_ids": pa.array(DOCS, pa.list_(pa.float32()))})


def _parquet_without_the_column(root: Path) -> Path:
    import pyarrow as pa

    return _parquet(root, {"tokens": pa.array(DOCS, pa.list_(pa.int32()))})


def _arrow(root: Path, column: str, kind: object) -> Path:
    import pyarrow as pa

    table = pa.table({column: pa.array(DOCS, kind)})
    with (
        pa.OSFile(str(root / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=8)
    return manifest(root, arrow=["d.arrow"])


def _arrow_without_the_column(root: Path) -> Path:
    import pyarrow as pa

    return _arrow(root, "token_ids", pa.list_(pa.int32()))


def _arrow_float_column(root: Path) -> Path:
    import pyarrow as pa

    return _arrow(root, "input_ids", pa.list_(pa.float64()))


def _megatron_float_tokens(root: Path) -> Path:
    write_megatron(root, DOCS)
    path = root / "corpus_text_document_0.idx"
    lengths = [len(d) for d in DOCS[:15]]
    path.write_bytes(megatron_index(lengths, list(range(16)), np.uint16, code=7))
    return root


# (case, writer, what the one line must say: the file, its dtype or type, what is accepted)
CASES = [
    (
        "shards-float32",
        _float_shard,
        r"shard 's': tokens '.*s\.tokens\.npy' have dtype <f4 \(float32\); expected "
        r"integer token ids",
    ),
    (
        "jsonl-another-schema",
        _jsonl_other_schema,
        r"JSON Lines file '.*docs\.jsonl': none of its first 8 non-blank line\(s\) is a "
        r"document \(first: expected an object with a 'tokens' list\); expected one JSON",
    ),
    (
        "jsonl-gzipped",
        _jsonl_gzipped,
        r"JSON Lines file '.*docs\.jsonl': none of its first \d non-blank line\(s\) is a "
        r"document \(first: not JSON",
    ),
    (
        "jsonl-float-tokens",
        _jsonl_float_tokens,
        r"JSON Lines file '.*docs\.jsonl': none of its first 8 non-blank line\(s\) is a "
        r"document \(first: tokens must be "
        r"integers; found \['float'\]\)",
    ),
    (
        "parquet-float-column",
        _parquet_float_column,
        r"Parquet file '.*f\.parquet': column 'input_ids' has type list<.*float>; expected "
        r"a list of integer token ids",
    ),
    (
        "parquet-no-column",
        _parquet_without_the_column,
        r"Parquet file '.*f\.parquet' has no column 'input_ids'; its columns are \['tokens'\]",
    ),
    (
        "arrow-float-column",
        _arrow_float_column,
        r"Arrow file '.*d\.arrow': column 'input_ids' has type list<.*double>; expected a "
        r"list of integer token ids",
    ),
    (
        "arrow-no-column",
        _arrow_without_the_column,
        r"Arrow file '.*d\.arrow' has no column 'input_ids'; its columns are \['token_ids'\]",
    ),
    (
        "megatron-float32",
        _megatron_float_tokens,
        r"Megatron index '.*_0\.idx' holds float32 tokens \(dtype code 7\); tokens must be "
        r"integers \(codes 1-5 and 8\)",
    ),
]


@pytest.mark.parametrize("case, write, line", CASES, ids=[c[0] for c in CASES])
def test_a_file_a_reader_cannot_take_is_refused_at_open_in_one_line(
    tmp_path, capsys, case, write, line
):
    corpus = write(tmp_path)
    assert cli.main(["digest", "--corpus", str(corpus)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (error,) = captured.err.splitlines()
    assert re.fullmatch(rf"streampack digest: error: {line}.*", error), error


def test_produce_refuses_such_a_file_before_it_binds(tmp_path, capsys):
    corpus = _float_shard(tmp_path)
    args = ["produce", "--corpus", str(corpus), "--worker-endpoint", "tcp://127.0.0.1:1"]
    assert cli.main([*args, "--consumer-endpoint", "tcp://127.0.0.1:2"]) == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith("streampack produce: error: shard 's': tokens ")
    assert "have dtype <f4 (float32)" in error


def test_bad_lines_of_a_good_json_lines_file_are_still_quarantined_one_by_one(tmp_path):
    """The open-time check judges the file, not its documents: one good line among the
    first ones is enough, and the bad lines are quarantined as before."""
    lines = ['{"tokens": [1, 2', json.dumps({"input_ids": [1, 2]}), json.dumps({"tokens": DOCS[0]})]
    source = open_corpus(_jsonl(tmp_path, [*lines, json.dumps({"tokens": [0.5]})]))
    reasons = [q["reason"] for w in iter_windows(source, 0, SPEC) for q in w.quarantined]
    assert reasons == ["malformed", "malformed", "wrong_dtype"]
