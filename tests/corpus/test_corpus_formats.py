"""Parquet, Arrow (``datasets.save_to_disk`` and IPC files) and Megatron readers:
every document read exactly once with its tokens, shuffles, and one clear error for
each way a file can be wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _formats import (
    WRITERS,
    documents,
    manifest,
    megatron_index,
    write_hf_dataset,
    write_megatron,
    write_parquet,
)

from streampack import InvalidConfig
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

SPEC = CutSpec(capacity=64, window_documents=9, window_tokens=200)


def read_all(source, spec=SPEC, epoch=0):
    """{source_id: tokens} and the visiting order, through the window cut."""
    got, order = {}, []
    for window in iter_windows(source, epoch, spec):
        assert not window.quarantined
        for i, source_id in enumerate(window.source_id.tolist()):
            assert source_id not in got
            got[source_id] = window.tokens[window.offsets[i] : window.offsets[i + 1]].tolist()
            order.append(source_id)
    return got, order


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_document_is_read_once_with_its_tokens(tmp_path, fmt):
    docs = documents()
    source = open_corpus(WRITERS[fmt](tmp_path, docs))
    assert source.num_documents == len(docs)
    got, order = read_all(source)
    assert got == dict(enumerate(docs))
    assert order == list(range(len(docs)))


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_shuffles_visit_every_document_once(tmp_path, fmt):
    docs = documents()
    source = open_corpus(WRITERS[fmt](tmp_path, docs))
    spec = CutSpec(
        capacity=64, window_documents=9, window_tokens=200, shuffle=True, seed=5, shuffle_buffer=8
    )
    got, order = read_all(source, spec)
    assert got == dict(enumerate(docs))
    assert order != list(range(len(docs)))
    assert read_all(source, spec)[1] == order
    if source.random_access:  # Arrow and Megatron: the full permutation, as for shards
        from streampack.corpus.order import corpus_permutation

        assert order == corpus_permutation(len(docs), 5, 0).tolist()


def test_parquet_is_sequential_and_reads_a_named_column(tmp_path):
    docs = documents(20)
    source = open_corpus(write_parquet(tmp_path, docs, column="ids", files=1))
    assert not source.random_access
    assert read_all(source)[0] == dict(enumerate(docs))


def test_megatron_documents_of_several_sequences_are_read_whole(tmp_path):
    sequences = [[5, 6], [7, 8, 9], [10, 11], [12, 13, 14, 15]]
    (tmp_path / "d.bin").write_bytes(np.concatenate(sequences).astype(np.int32).tobytes())
    (tmp_path / "d.idx").write_bytes(megatron_index([2, 3, 2, 4], [0, 2, 2, 4], np.int32))
    source = open_corpus(manifest(tmp_path, megatron=["d"]))
    assert source.num_documents == 3
    (window,) = iter_windows(source, 0, SPEC)
    # document 1 holds no sequence: too short, quarantined; 0 and 2 span two sequences
    assert [(q["source_id"], q["reason"]) for q in window.quarantined] == [(1, "too_short")]
    assert window.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert window.offsets.tolist() == [0, 5, 11]


def test_out_of_vocabulary_rows_are_quarantined_not_fatal(tmp_path):
    docs = documents(10)
    docs[3] = [1, 2, 600]
    for fmt in ("parquet", "megatron"):
        root = tmp_path / fmt
        root.mkdir()
        windows = list(iter_windows(open_corpus(WRITERS[fmt](root, docs)), 0, SPEC))
        reasons = [(q["source_id"], q["reason"]) for w in windows for q in w.quarantined]
        assert reasons == [(3, "out_of_vocabulary")], fmt


# -- one clear error per way a file can be wrong ---------------------------------------


def test_missing_files_are_named(tmp_path):
    for entry, match in (
        ({"parquet": ["nope.parquet"]}, "Parquet file .*nope.parquet' does not exist"),
        ({"arrow": ["nope.arrow"]}, "Arrow file .*nope.arrow' does not exist"),
        ({"megatron": ["nope"]}, "Megatron index .*nope.idx' does not exist"),
    ):
        with pytest.raises(InvalidConfig, match=match):
            open_corpus(manifest(tmp_path, **entry))


def test_megatron_bin_missing(tmp_path):
    write_megatron(tmp_path, documents(6))
    (tmp_path / "corpus_text_document_1.bin").unlink()
    with pytest.raises(InvalidConfig, match="Megatron data file .*_1.bin' does not exist"):
        open_corpus(tmp_path)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b"NOTMEGA!!" + b[9:], "starts with b'NOTMEGA!!'; expected the magic"),
        (lambda b: b[:9] + (2).to_bytes(8, "little") + b[17:], "version 2; expected 1"),
        (lambda b: b[:17] + bytes([9]) + b[18:], "dtype code 9; expected one of"),
        (lambda b: b[:17] + bytes([7]) + b[18:], "float32 tokens .*must be integers"),
        (lambda b: b[:-5], "is 97 bytes; its header .3 sequences, 4 document indices. needs 102"),
        (lambda b: b[:20], "truncated: 20 bytes, shorter than the 34-byte header"),
    ],
)
def test_a_bad_megatron_index_is_one_clear_error(tmp_path, mutate, match):
    write_megatron(tmp_path, documents(6))
    path = tmp_path / "corpus_text_document_0.idx"
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(InvalidConfig, match=match):
        open_corpus(tmp_path)


def test_megatron_pointers_and_document_indices_are_checked(tmp_path):
    (tmp_path / "d.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    good = megatron_index([4, 6], [0, 1, 2])
    (tmp_path / "d.idx").write_bytes(good)
    manifest(tmp_path, megatron=["d"])
    assert open_corpus(tmp_path).num_documents == 2
    pointers_at = 34 + 4 * 2
    bad = good[: pointers_at + 8] + np.int64(6).tobytes() + good[pointers_at + 16 :]
    (tmp_path / "d.idx").write_bytes(bad)
    with pytest.raises(InvalidConfig, match="sequence 1 starts at byte 6, expected 8"):
        open_corpus(tmp_path)
    (tmp_path / "d.idx").write_bytes(megatron_index([4, 6], [0, 2, 1, 2]))
    with pytest.raises(InvalidConfig, match="document indices.*decrease at document 1"):
        open_corpus(tmp_path)
    (tmp_path / "d.idx").write_bytes(good)
    (tmp_path / "d.bin").write_bytes(np.arange(7, dtype=np.uint16).tobytes())
    with pytest.raises(
        InvalidConfig, match="d.bin' is 14 bytes; its index describes 10 uint16 tokens .* truncated"
    ):
        open_corpus(tmp_path)


def test_an_empty_megatron_dataset_is_refused(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(megatron_index([], [0]))
    with pytest.raises(InvalidConfig, match="holds no documents"):
        open_corpus(manifest(tmp_path, megatron=["d"]))


def test_corrupt_and_truncated_parquet_and_arrow_are_named(tmp_path):
    write_parquet(tmp_path, documents(10), files=1)
    data = (tmp_path / "train-000.parquet").read_bytes()
    (tmp_path / "train-000.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        InvalidConfig, match="Parquet file .*train-000.parquet' is corrupt or truncated"
    ):
        open_corpus(tmp_path)
    (tmp_path / "x.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(InvalidConfig, match="Arrow file .*x.arrow' is corrupt or truncated"):
        open_corpus(manifest(tmp_path, arrow=["x.arrow"]))


def test_wrong_column_type_and_missing_column_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"input_ids": pa.array([[1.5, 2.0]], pa.list_(pa.float32()))}),
        tmp_path / "f.parquet",
    )
    with pytest.raises(
        InvalidConfig, match="column 'input_ids' has type list<.*float>; expected a list of integer"
    ):
        open_corpus(manifest(tmp_path, parquet=["f.parquet"]))
    with pytest.raises(
        InvalidConfig, match="has no column 'tokens'; its columns are \\['input_ids'\\]"
    ):
        open_corpus(manifest(tmp_path, parquet=["f.parquet"], column="tokens"))


def test_empty_parquet_and_hf_dataset_dict_are_refused(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))}), tmp_path / "e.parquet"
    )
    with pytest.raises(InvalidConfig, match="hold no rows"):
        open_corpus(manifest(tmp_path, parquet=["e.parquet"]))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"input_ids": [[1, 2]]})}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InvalidConfig, match="holds a DatasetDict \\(splits \\['train'\\]\\)"):
        open_corpus(manifest(tmp_path, arrow=["dd"]))
    assert open_corpus(manifest(tmp_path, arrow=["dd/train"])).num_documents == 1


def test_null_rows_and_tokens(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pa.array([[1, 2, 3], None, [4, None, 5], [6, 7]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "n.parquet")
    (window,) = iter_windows(open_corpus(manifest(tmp_path, parquet=["n.parquet"])), 0, SPEC)
    assert [(q["source_id"], q["reason"], q["location"]) for q in window.quarantined] == [
        (1, "malformed", "n.parquet:0:1"),
        (2, "malformed", "n.parquet:0:2"),
    ]
    assert window.tokens.tolist() == [1, 2, 3, 6, 7]
    # in Arrow, whose tokens are read zero-copy, a null token is refused at open
    with (
        pa.OSFile(str(tmp_path / "n.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("input_ids", rows.type)])) as writer,
    ):
        writer.write_batch(pa.record_batch([rows], names=["input_ids"]))
    with pytest.raises(InvalidConfig, match="holds 1 null token"):
        open_corpus(manifest(tmp_path, arrow=["n.arrow"]))


def test_hf_dataset_state_must_list_its_files(tmp_path):
    write_hf_dataset(tmp_path, documents(5), shards=1)
    (tmp_path / "hf" / "state.json").write_text(json.dumps({"_data_files": "x"}))
    with pytest.raises(InvalidConfig, match="does not list its data files"):
        open_corpus(tmp_path)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_document_arrives_once_through_the_service(tmp_path, fmt):
    """Real producer and worker processes over real sockets, two consumer ranks: each
    document, as its format's own library wrote it, arrives exactly once, pairs intact."""
    import threading

    from _service import Service

    from streampack.client import BatchStream

    docs = documents()
    corpus = WRITERS[fmt](tmp_path, docs)
    received: dict[int, list] = {0: [], 1: []}

    def drain(endpoint, rank):
        with BatchStream(endpoint, rank=rank, world_size=2, timeout=60) as stream:
            received[rank].extend(stream)

    settings = {
        "capacity": 64,
        "window_documents": 9,
        "window_tokens": 200,
        "shuffle": True,
        "seed": 3,
        "shuffle_buffer": 16,
    }
    with Service(corpus, serve_workers=1, **settings) as service:
        threads = [
            threading.Thread(target=drain, args=(service.consumer_endpoint, rank))
            for rank in (0, 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    seen = []
    for batch in received[0] + received[1]:
        for occ in batch.occurrences:
            doc = docs[int(occ["source_id"])]
            row, start, stop = int(occ["row"]), int(occ["start"]), int(occ["stop"])
            assert batch.inputs[row, start:stop].tolist() == doc[:-1]
            assert batch.targets[row, start:stop].tolist() == doc[1:]
            seen.append(int(occ["source_id"]))
    assert sorted(seen) == list(range(len(docs)))


def test_opening_and_cutting_holds_no_per_document_memory(tmp_path, monkeypatch):
    """Megatron and Arrow corpora of 100,000 documents are opened and their first
    window cut with a few hundred kB of Python/NumPy allocations and no pyarrow heap:
    the index, pointers and tokens stay memory-mapped, checked in bounded chunks."""
    import tracemalloc

    import pyarrow as pa

    from streampack.corpus import megatron, offsets

    monkeypatch.setattr(offsets, "_CHUNK", 4096)
    monkeypatch.setattr(megatron, "_CHUNK", 4096)
    count = 100_000
    lengths = np.full(count, 3)
    (tmp_path / "big.bin").write_bytes(np.arange(3 * count, dtype=np.uint16).tobytes())
    (tmp_path / "big.idx").write_bytes(megatron_index(lengths.tolist(), list(range(count + 1))))
    values = pa.array(np.arange(3 * count, dtype=np.int32) % 500)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(
                pa.array(np.arange(0, 3 * count + 1, 3, dtype=np.int32)), values
            )
        }
    )
    with (
        pa.OSFile(str(tmp_path / "big.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    del values, table
    spec = CutSpec(capacity=8, window_documents=64, window_tokens=200, shuffle=True)
    for entry in ({"megatron": ["big"]}, {"arrow": ["big.arrow"]}):
        corpus = manifest(tmp_path, **entry)
        # Once untraced first: a kernel's first compile (when no other test ran it yet)
        # allocates tens of MB that belong to Numba, not to the corpus.
        next(iter_windows(open_corpus(corpus), 0, spec))
        heap = pa.total_allocated_bytes()
        tracemalloc.start()
        source = open_corpus(corpus)
        next(iter_windows(source, 0, spec))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert source.num_documents == count
        # the shuffled epoch's permutation (8 bytes per document) is the one exception
        assert peak < 8 * count + 400_000, (entry, peak)
        assert pa.total_allocated_bytes() == heap


def test_empty_sources_are_refused(tmp_path):
    import datasets

    (tmp_path / "e.jsonl").write_bytes(b"")
    with pytest.raises(InvalidConfig, match="e.jsonl' is empty \\(0 bytes\\)"):
        open_corpus(manifest(tmp_path, jsonl=["e.jsonl"]))
    datasets.Dataset.from_dict({"input_ids": []}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(InvalidConfig, match="lists no data files: the dataset is empty"):
        open_corpus(manifest(tmp_path, arrow=["hf"]))


def test_an_arrow_column_of_text_is_a_clear_dtype_error(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"input_ids": ["not", "tokens"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(
        InvalidConfig,
        match="data-00000-of-00001.arrow': column 'input_ids' "
        "has type string; expected a list of integer",
    ):
        open_corpus(manifest(tmp_path, arrow=["hf"]))


def test_without_pyarrow_the_error_names_the_extra(tmp_path):
    import subprocess
    import sys

    write_parquet(tmp_path, documents(4), files=1)
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from streampack.corpus import open_corpus\n"
        f"open_corpus({str(tmp_path)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (
        "reading Parquet files needs pyarrow; install it with: pip install "
        "'streampack[data]'" in done.stderr
    )


def _arrow_files(root, docs, columns, files):
    """The rows as ``files`` Arrow IPC files of 16-row record batches: int64 tokens and
    the ``columns`` (name -> per-row lists of ``dtype``)."""
    import pyarrow as pa

    names = []
    for k, rows in enumerate(np.array_split(np.arange(len(docs)), files)):
        table = pa.table(
            {
                "input_ids": pa.array([docs[i] for i in rows], pa.list_(pa.int64())),
                **{
                    name: pa.array([values[i] for i in rows], pa.list_(dtype))
                    for name, (values, dtype) in columns.items()
                },
            }
        )
        names.append(f"part{k}.arrow")
        with pa.OSFile(str(root / names[-1]), "wb") as sink:
            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=16)
    return names


@pytest.mark.parametrize("supervision", [None, "completion_mask", "labels"])
def test_a_shuffled_arrow_file_is_gathered_as_one_and_reads_as_its_batches_do(
    tmp_path, supervision
):
    """The record batches of one Arrow file are views of one memory map: a shuffled
    window is found and copied in one gather over it (``offsets.Flat``). Its windows
    are those of the same rows in two files, read a record batch at a time — tokens,
    masks, ids and quarantines (a token out of the vocabulary, a mismatched label)."""
    import pyarrow as pa
    from _formats import labels, masks

    docs = documents(200, seed=11)
    docs[7][1] = 9999
    mask = masks(docs, seed=12)
    columns = {}
    if supervision == "completion_mask":
        columns = {"completion_mask": (mask, pa.uint8())}
    elif supervision == "labels":
        columns = {"labels": (labels(docs, mask), pa.int64())}
        columns["labels"][0][40][-1] = docs[40][-1] + 1
    extra = (
        {}
        if supervision is None
        else {"labels" if supervision == "labels" else "mask": supervision}
    )
    spec = CutSpec(capacity=64, window_documents=9, window_tokens=200, shuffle=True, seed=5)
    windows = {}
    for files in (1, 2):
        root = tmp_path / str(files)
        root.mkdir()
        source = open_corpus(
            manifest(root, arrow=_arrow_files(root, docs, columns, files), **extra)
        )
        assert len(source.parts) >= 13  # record batches of 16 rows
        flat = (source._flat is not None, source._mask_flat is not None)
        assert flat == (files == 1, files == 1 and supervision is not None), flat
        windows[files] = [
            (
                {k: v.tolist() for k, v in w.arrays().items()},
                [(q["source_id"], q["reason"], q["detail"]) for q in w.quarantined],
            )
            for w in iter_windows(source, 2, spec)
        ]
    assert windows[1] == windows[2]
    reasons = {r for _, quarantined in windows[1] for _, r, _ in quarantined}
    assert reasons == (
        {"out_of_vocabulary", "labels_mismatch"}
        if supervision == "labels"
        else {"out_of_vocabulary"}
    )
