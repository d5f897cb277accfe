"""Cost of auditing one batch, beside the cost of packing that same batch, in one run.

A pack worker audits a sample of its batches (packed vs separate execution under the
reference decoder, :func:`streampack.audit`). This measures what one audit costs for a
batch of capacity 2048 and 16 rows, against ``pack_examples`` over exactly the
examples of that batch, so the ratio says how many batches' worth of packing one audit
costs. Occurrences longer than the profile's ``max_positions`` are audited on a prefix
(as the audit itself does), so the cost follows the occurrence count, not the row
width; by default the audit relabels the batch's distinct tokens to a compact
vocabulary, and ``small_full_vocabulary`` shows what the binding's full vocabulary
would cost instead.

Corpus: document lengths clip(lognormal(5, 1), 2, 2049) and uniform tokens (seeded),
as in ``benchmarks/pack.py``. Times are the best of ``--repeats`` after a warm-up run.

    .venv/bin/python benchmarks/audit.py [--vocab 50000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

import streampack as sp
from streampack.auditing import audit, select_examples
from streampack.decoder import DecoderConfig

CAPACITY, ROWS_PER_BATCH = 2048, 16


def first_batch(vocab: int, seed: int) -> tuple[sp.Examples, sp.PackedBatch]:
    """The examples of one full batch and that batch."""
    rng = np.random.default_rng(seed)
    documents = 2000
    lengths = np.clip(rng.lognormal(5.0, 1.0, documents), 2, CAPACITY + 1).astype(np.int64)
    offsets = np.zeros(documents + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(0, vocab, int(offsets[-1]), dtype=np.int32)
    examples = sp.Examples(
        tokens=tokens,
        offsets=offsets,
        doc=np.arange(documents),
        start=np.zeros(documents, np.int64),
        stop=lengths,
    )
    binding = sp.Binding(vocab, "synthetic", "benchmark", "train")
    config = sp.PackConfig(capacity=CAPACITY, max_rows_per_batch=ROWS_PER_BATCH)
    batch = sp.pack_examples(examples, binding, config).batches[0]
    if batch.rows != ROWS_PER_BATCH:
        raise SystemExit(f"corpus too small: first batch has {batch.rows} rows")
    return select_examples(examples, batch.occurrences["ordinal"]), batch


def best_of(repeats: int, run: Callable[[], object]) -> float:
    run()  # warm-up: compiled kernels load from the cache, BLAS threads start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    examples, batch = first_batch(args.vocab, args.seed)
    binding = batch.binding
    config = sp.PackConfig(capacity=CAPACITY, max_rows_per_batch=ROWS_PER_BATCH)
    pack_seconds = best_of(args.repeats, lambda: sp.pack_examples(examples, binding, config))
    result: dict[str, object] = {
        "capacity": CAPACITY,
        "rows": batch.rows,
        "occurrences": int(len(batch.occurrences)),
        "real_targets": int(np.count_nonzero(batch.loss_mask)),
        "vocab_size": args.vocab,
        "threads": os.cpu_count(),
        "pack_examples_seconds": pack_seconds,
        "audits": {},
    }
    runs = (
        ("small", DecoderConfig.small(), True),
        ("large", DecoderConfig.large(), True),
        ("small_full_vocabulary", DecoderConfig.small(), False),
    )
    for name, profile, compact in runs:

        def run(profile: DecoderConfig = profile, compact: bool = compact) -> object:
            return audit(batch, config=profile, compact_vocabulary=compact)

        report = run()
        seconds = best_of(args.repeats, run)
        result["audits"][name] = {
            "seconds": seconds,
            "ratio_to_pack_examples": seconds / pack_seconds,
            "passed": report.passed,
            "comparisons": report.comparisons,
            "cropped_occurrences": report.cropped,
            "max_positions": report.max_positions,
            "decoder_vocab_size": report.vocab_size,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
