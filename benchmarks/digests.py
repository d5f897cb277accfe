"""Content digests (``streampack.digests.range_digests``): the compiled kernel beside the
hashlib loop, in ns per token at several document lengths; prints JSON.

The same seeded tokens (``--tokens`` of them, uint16 or int32) cut into documents of
each ``--lengths`` value, with and without a uint8 mask, digested in one call by:

* ``kernel``: ``range_digests`` as it runs (OpenSSL's ``SHA256_*`` from compiled code,
  ``streampack/kernels/digest_cpu.py``), its cache warmed before timing;
* ``hashlib``: the definition's loop, one ``hashlib.sha256`` per range (the fallback).

Each best of ``--repeats`` rounds, taking turns. Both are checked equal first.
``ratio`` is hashlib's time over the kernel's (above 1: the kernel is faster).

Then ``corpus digest`` (``streampack.corpus.tables.digest_corpus``, the per-document
table) over the same ``--documents`` (seeded lengths 16..480, mean ~248; masked but for
Megatron; Parquet in row groups of 4096) written in each format the readers open, once
warm: M tokens/s of the whole command (open, read, digest, write) and the table's bytes
per document on disk.

    .venv/bin/python benchmarks/digests.py [--tokens 4000000] [--lengths 16,64,240,1024,8192]
        [--documents 40000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streampack.digests import DIGEST_BYTES, _hashlib_digests, _kernel, range_digests


def _seconds(run, *arguments) -> float:
    started = time.perf_counter()
    run(*arguments)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--lengths", default="16,64,240,1024,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=40_000)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    kernel = _kernel()
    rows = []
    for dtype in (np.uint16, np.int32):
        tokens = rng.integers(0, 60000, args.tokens).astype(dtype)
        mask = rng.integers(0, 2, args.tokens).astype(np.uint8)
        data = tokens.view(np.uint8)
        for length in (int(x) for x in args.lengths.split(",")):
            offsets = np.arange(0, args.tokens + 1, length, dtype=np.int64)
            used = int(offsets[-1])
            for marks in (None, mask):
                out = np.empty((len(offsets) - 1, DIGEST_BYTES), np.uint8)
                fast = range_digests(tokens, offsets, marks)
                slow = _hashlib_digests(data, tokens.itemsize, offsets, marks, out)
                assert np.array_equal(fast, slow), "kernel and hashlib disagree"
                runs = {
                    "kernel": (range_digests, (tokens, offsets, marks)),
                    "hashlib": (_hashlib_digests, (data, tokens.itemsize, offsets, marks, out)),
                }
                times = dict.fromkeys(runs, float("inf"))
                for _ in range(args.repeats):  # turns: both see the same machine load
                    for name, (run, arguments) in runs.items():
                        times[name] = min(times[name], _seconds(run, *arguments))
                rows.append(
                    {
                        "dtype": np.dtype(dtype).name,
                        "masked": marks is not None,
                        "document_tokens": length,
                        "documents": len(offsets) - 1,
                        "kernel_ns_per_token": round(times["kernel"] / used * 1e9, 3),
                        "hashlib_ns_per_token": round(times["hashlib"] / used * 1e9, 3),
                        "kernel_ns_per_document": round(times["kernel"] / (len(offsets) - 1) * 1e9),
                        "ratio": round(times["hashlib"] / times["kernel"], 2),
                    }
                )
    report = {"kernel": kernel is not None, "tokens": args.tokens, "rows": rows}
    report["corpus_digest"] = _corpus_digest(args.documents, args.seed)
    print(json.dumps(report, indent=1))


def _corpus_digest(count: int, seed: int) -> list[dict]:
    """``corpus digest`` per format over the same masked documents (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _formats import (
        write_hf_dataset,
        write_jsonl,
        write_megatron,
        write_parquet,
        write_shards,
    )

    from streampack.corpus.tables import ROWS_NAME, digest_corpus

    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 481, count)
    docs = [rng.integers(0, 512, int(n)).tolist() for n in lengths]
    mask = [[0] * (len(d) // 2) + [1] * (len(d) - len(d) // 2) for d in docs]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        writers = {
            "shards": lambda root: write_shards(root, docs, supervision=mask),
            "megatron (no mask)": lambda root: write_megatron(root, docs),
            "jsonl": lambda root: write_jsonl(root, docs, supervision=mask),
            "parquet": lambda root: write_parquet(
                root, docs, supervision={"completion_mask": mask}, row_group_size=4096
            ),
            "arrow (save_to_disk)": lambda root: write_hf_dataset(
                root, docs, supervision={"completion_mask": mask}
            ),
        }
        for case, write in writers.items():
            root = Path(tmp) / str(len(out))
            root.mkdir()
            write(root)
            digest_corpus(root)  # warm: compiled kernels loaded, files in the page cache
            written = digest_corpus(root)
            out.append(
                {
                    "format": case,
                    "documents": written["documents"],
                    "m_tokens_per_second": round(written["tokens_per_second"] / 1e6, 2),
                    "seconds": written["seconds"],
                    "table_bytes_per_document": round(
                        (root / ROWS_NAME).stat().st_size / written["documents"], 2
                    ),
                }
            )
    return out


if __name__ == "__main__":
    main()
