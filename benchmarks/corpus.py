"""Reading one corpus in every format through the window cut and screen; prints JSON.

The same documents (``clip(lognormal(5, 1), 2, 2048)`` tokens, vocabulary 32000) are
written as token shards, JSON Lines, Parquet, an Arrow IPC file and a Megatron
``.bin``/``.idx`` pair, then each is read whole with ``iter_windows`` — what the
producer does per epoch — in corpus order and shuffled (a permutation for random-access
formats, the shuffle buffer for streamed ones). The ``*_masked`` rows read the same
documents with a supervision mask (the first third of each document context, the rest
trained): shards with ``NAME.mask.npy``, Arrow with a ``completion_mask`` column,
Parquet with a ``labels`` column, JSON Lines with a ``mask`` field. Reported: tokens
per second of each, its ratio to token shards in the same order, and that every format
yielded the same token count. Best of ``--repeats`` rounds, formats taking turns.

``parquet_decode_alone`` is pyarrow's ``read_row_group`` of every row group (the token
column) and nothing else, on one thread and on two at once (a file handle each);
``parquet_pages_alone`` the same for ``streampack.corpus.parquet_pages``, which the
reader uses for such a file: the ceiling the Parquet rows stand under.

    python benchmarks/corpus.py [--documents 50000] [--repeats 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

VOCAB = 32000
BINDING = {
    "vocab_size": VOCAB,
    "tokenizer": "bench",
    "split_receipt": "bench",
    "partition": "train",
}


def write_all(root: Path, docs: list[np.ndarray]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = np.array([len(d) for d in docs])
    flat = np.concatenate(docs).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    paths = {}

    def manifest(name: str, **entry: object) -> Path:
        path = root / f"{name}.json"
        path.write_text(
            json.dumps({"format": "streampack-corpus", "version": 1, "binding": BINDING, **entry})
        )
        return path

    np.save(root / "s.tokens.npy", flat.astype(np.uint16))
    np.save(root / "s.offsets.npy", offsets)
    paths["shards"] = manifest("shards", shards=["s"])
    with open(root / "d.jsonl", "w") as handle:
        for d in docs:
            handle.write(json.dumps({"tokens": d.tolist()}) + "\n")
    paths["jsonl"] = manifest("jsonl", jsonl=["d.jsonl"])
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
    table = pa.table({"input_ids": lists})
    pq.write_table(table, root / "d.parquet", row_group_size=8192)
    paths["parquet"] = manifest("parquet", parquet=["d.parquet"])
    with (
        pa.OSFile(str(root / "d.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=1000)  # as datasets writes: 1000 rows
    paths["arrow"] = manifest("arrow", arrow=["d.arrow"])
    (root / "m.bin").write_bytes(flat.astype(np.uint16).tobytes())
    count = len(docs)
    (root / "m.idx").write_bytes(
        b"".join(
            [
                b"MMIDIDX\x00\x00",
                struct.pack("<QBQQ", 1, 8, count, count + 1),
                lengths.astype(np.int32).tobytes(),
                (offsets[:-1] * 2).astype(np.int64).tobytes(),
                np.arange(count + 1, dtype=np.int64).tobytes(),
            ]
        )
    )
    paths["megatron"] = manifest("megatron", megatron=["m"])
    # The same documents with masks: 0 for the first third (at least one token), then 1.
    prompt = np.maximum(lengths // 3, 1)
    mask = np.arange(len(flat)) - np.repeat(offsets[:-1], lengths) >= np.repeat(prompt, lengths)
    mask = mask.astype(np.uint8)
    np.save(root / "sm.tokens.npy", flat.astype(np.uint16))
    np.save(root / "sm.offsets.npy", offsets)
    np.save(root / "sm.mask.npy", mask)
    paths["shards_masked"] = manifest("shards_masked", shards=["sm"])
    list_offsets = pa.array(offsets.astype(np.int32))
    masked = table.append_column(
        "completion_mask", pa.ListArray.from_arrays(list_offsets, pa.array(mask))
    )
    with (
        pa.OSFile(str(root / "dm.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, masked.schema) as writer,
    ):
        writer.write_table(masked, max_chunksize=1000)
    paths["arrow_masked"] = manifest("arrow_masked", arrow=["dm.arrow"], mask="completion_mask")
    labels = np.where(mask == 1, flat, -100).astype(np.int64)
    labelled = table.append_column(
        "labels", pa.ListArray.from_arrays(list_offsets, pa.array(labels))
    )
    pq.write_table(labelled, root / "dl.parquet", row_group_size=8192)
    paths["parquet_masked"] = manifest("parquet_masked", parquet=["dl.parquet"], labels="labels")
    with open(root / "dm.jsonl", "w") as handle:
        for d, lo, hi in zip(docs, offsets[:-1], offsets[1:], strict=True):
            handle.write(json.dumps({"tokens": d.tolist(), "mask": mask[lo:hi].tolist()}) + "\n")
    paths["jsonl_masked"] = manifest("jsonl_masked", jsonl=["dm.jsonl"], mask="mask")
    return paths


def read(path: Path, shuffle: bool) -> tuple[float, int]:
    spec = CutSpec(
        capacity=2048, window_documents=1024, window_tokens=1 << 18, shuffle=shuffle, seed=1
    )
    start = time.perf_counter()
    tokens = 0
    for window in iter_windows(open_corpus(path), 0, spec):
        tokens += len(window.tokens)
    return time.perf_counter() - start, tokens


def decode_parquet(path: Path, threads: int, ours: bool = False) -> float:
    """Seconds pyarrow alone (or, ``ours``, parquet_pages alone) takes to decode every
    row group of ``path``'s token column, ``threads`` row groups at once (each thread
    with its own handle)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    from streampack.corpus import parquet_pages

    handles = [pq.ParquetFile(str(path), memory_map=True) for _ in range(threads)]
    groups = handles[0].num_row_groups
    data = parquet_pages.file_bytes(path)
    plan = parquet_pages.column_plan(pa, handles[0], "input_ids", data)

    def decode(k: int) -> None:
        for group in range(k, groups, threads):
            if ours:
                read = parquet_pages.read_row_group(pa, data, plan, group)
                assert not isinstance(read, str), read
            else:
                handles[k].read_row_group(group, columns=["input_ids"], use_threads=False)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(decode, range(threads)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, args.documents), 2, 2048).astype(int)
    docs = [rng.integers(0, VOCAB, n, dtype=np.int32) for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_all(Path(tmp), docs)
        best: dict[tuple[str, int], float] = {}  # (format, shuffled) or (decode, threads)
        counts = set()
        for _ in range(args.repeats):
            for shuffle in (False, True):
                for name, path in paths.items():
                    seconds, tokens = read(path, shuffle)
                    counts.add(tokens)
                    key = (name, int(shuffle))
                    best[key] = min(best.get(key, float("inf")), seconds)
            for threads in (1, 2):
                for ours in (False, True):
                    seconds = decode_parquet(Path(tmp) / "d.parquet", threads, ours)
                    decode = ("parquet_pages_alone" if ours else "parquet_decode_alone", threads)
                    best[decode] = min(best.get(decode, float("inf")), seconds)
    total = int(lengths.sum())
    results = {}
    for shuffle in (False, True):
        order = "shuffled" if shuffle else "in_order"
        base = best[("shards", False)]
        results[order] = {
            name: {
                "seconds": round(best[(name, shuffle)], 4),
                "m_tokens_per_s": round(total / best[(name, shuffle)] / 1e6, 2),
                "time_vs_shards_in_order": round(best[(name, shuffle)] / base, 2),
            }
            for name in paths
        }
    print(
        json.dumps(
            {
                "benchmark": "corpus_read",
                "documents": args.documents,
                "tokens": total,
                "same_tokens_everywhere": counts == {total},
                "repeats": args.repeats,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                **results,
                **{
                    f"{decoder}_m_tokens_per_s": {
                        f"{threads}_thread{'s' if threads > 1 else ''}": round(
                            total / best[(decoder, threads)] / 1e6, 2
                        )
                        for threads in (1, 2)
                    }
                    for decoder in ("parquet_decode_alone", "parquet_pages_alone")
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
