"""What checking a batch's tokens against content digests costs, beside expanding it.

When workers serve batches to the consumers themselves (the data plane), a consumer must
detect a worker that altered a token, dropped, repeated or reordered a document, or
served another batch, before it yields the batch, and from digests that do not come
from that worker. This measures the candidate designs on the service benchmark's
documents (``benchmarks/service.py``: lengths clip(lognormal(5, 1), 2, 2049), vocabulary
50,000, so tokens travel as uint16; capacity 2048, 16 rows per batch), every figure
in nanoseconds per real token, single-threaded, best of ``--repeats``:

- ``expand``: ``CompactBatch.expand`` into reused memory, the consumer's work today
  (what its verification is compared with: the target is at most 20 % of it);
- ``batch_sha256``: one SHA-256 over a batch's compact tokens (one call per batch). Its
  expected value can only come from a process holding the tokens: the producer, which
  then reads and hashes every token (``producer_batch_sha256``: gather plus hash);
- ``document_sha256`` / ``document_blake2b``: a digest per occurrence (one call per
  document), checked against per-document digests computed once when the corpus is
  opened (``open_document_sha256``: its cost per token, once per corpus) — the design
  in which the producer reads no token at all, O(documents) per window;
- ``document_sha256_numpy_view``: the same per-document SHA-256 through memoryview
  slices without copies (the cheapest Python form of it).

    .venv/bin/python benchmarks/batch_digests.py [--documents 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["NUMBA_NUM_THREADS"] = "1"
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))

import streampack as sp  # noqa: E402
from streampack.packing import compact_batches, plan_compact  # noqa: E402

CAPACITY, ROWS_PER_BATCH, VOCAB = 2048, 16, 50_000


def corpus(documents: int, seed: int = 0) -> sp.Examples:
    """The service benchmark's documents, tokens in their wire dtype (uint16)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, documents), 2, CAPACITY + 1).astype(np.int64)
    offsets = np.zeros(documents + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return sp.Examples(
        tokens=rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32).astype(np.uint16),
        offsets=offsets,
        doc=np.arange(documents),
        start=np.zeros(documents, np.int64),
        stop=lengths,
    )


def best(repeats: int, run: Callable[[], object]) -> float:
    seconds = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds = min(seconds, time.perf_counter() - started)
    return seconds


def document_ranges(batch: sp.CompactBatch) -> list[tuple[int, int]]:
    """(first, last) byte offsets of each occurrence's tokens in the batch's compact
    tokens (occurrence i contributes stop - start + 1 tokens, in order)."""
    occurrences = batch.occurrences
    counts = (occurrences["stop"] - occurrences["start"] + 1).astype(np.int64)
    ends = np.cumsum(counts) * batch.tokens.itemsize
    return list(zip((ends - counts * batch.tokens.itemsize).tolist(), ends.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    examples = corpus(args.documents)
    binding = sp.Binding(VOCAB, "synthetic", "bench", "train")
    config = sp.PackConfig(
        capacity=CAPACITY, max_rows_per_batch=ROWS_PER_BATCH, max_metadata_bytes=1 << 40
    )
    occurrences, sizes = plan_compact(examples, binding, config)
    batches = compact_batches(examples, occurrences, sizes, binding, CAPACITY)
    real_tokens = int(examples.prediction_lengths.sum())
    ranges = [document_ranges(batch) for batch in batches]
    views = [memoryview(batch.tokens).cast("B") for batch in batches]
    block = np.empty(max(batch.expanded_nbytes for batch in batches), np.uint8)
    batches[0].expand(block)  # compile or load the cache

    def expand() -> None:
        for batch in batches:
            batch.expand(block)

    def batch_sha256() -> None:
        for batch in batches:
            hashlib.sha256(batch.tokens).digest()

    def per_document(name: str) -> Callable[[], None]:
        def run() -> None:
            new = getattr(hashlib, name)
            for view, spans in zip(views, ranges):
                for first, last in spans:
                    new(view[first:last]).digest()

        return run

    def document_sha256_copies() -> None:
        for batch, spans in zip(batches, ranges):
            data = batch.tokens.tobytes()
            for first, last in spans:
                hashlib.sha256(data[first:last]).digest()

    def producer_batch_sha256() -> None:
        # What the producer would do per batch without the workers' help: gather the
        # batch's tokens from its window, then hash them.
        for batch in batches:
            ordinal = batch.occurrences["ordinal"]
            pieces = [
                examples.tokens[examples.offsets[i] : examples.offsets[i + 1]] for i in ordinal
            ]
            hashlib.sha256(np.concatenate(pieces)).digest()

    corpus_view = memoryview(examples.tokens).cast("B")
    spans = (examples.offsets * examples.tokens.itemsize).tolist()

    def open_document_sha256() -> None:
        for first, last in zip(spans[:-1], spans[1:]):
            hashlib.sha256(corpus_view[first:last]).digest()

    measured = {
        "expand": expand,
        "batch_sha256": batch_sha256,
        "document_sha256": document_sha256_copies,
        "document_sha256_numpy_view": per_document("sha256"),
        "document_blake2b": per_document("blake2b"),
        "producer_batch_sha256": producer_batch_sha256,
        "open_document_sha256": open_document_sha256,
    }
    ns = {name: best(args.repeats, run) / real_tokens * 1e9 for name, run in measured.items()}
    consumer = ("batch_sha256", "document_sha256", "document_sha256_numpy_view")
    report = {
        "documents": args.documents,
        "real_tokens": real_tokens,
        "batches": len(batches),
        "mean_document_tokens": round(real_tokens / args.documents + 1, 1),
        "ns_per_token": {name: round(value, 3) for name, value in ns.items()},
        "ratio_to_expand": {
            name: round(ns[name] / ns["expand"], 3) for name in (*consumer, "document_blake2b")
        },
        "target": "the consumer's check <= 0.2 x its work: expand here, plus receiving "
        "(benchmarks/service.py's per_token consumers figure is the whole)",
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
