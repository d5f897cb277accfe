"""Compile streampack's cached Numba kernels once, on the paths the service takes.

The image runs this at build time (as the runtime user, with ``NUMBA_CACHE_DIR`` set),
so that a container loads every kernel from the cache instead of compiling it at start.
Numba compiles one specialization per argument type, and a worker's arrays are not
the same types as a test's: they come out of ``wire.decode`` (read-only views of the
received frames) in the protocol dtypes. So the warm-up goes the whole way a window
goes — a small corpus on disk, ``sources.iter_windows``, the wire round trip,
``pack_window`` and the audit — and also packs the undecoded arrays the in-process
``streampack digest`` uses, and the worked example of ``streampack trace``.

Usage: ``python warmup.py`` (prints one JSON line with what it ran).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from streampack import PackConfig, wire
from streampack.audit import audit
from streampack.cli import main as cli_main
from streampack.settings import ProducerSettings
from streampack.sources import CutSpec, iter_windows, open_corpus
from workers.worker import pack_window

VOCAB_SIZE = 512


def _write_corpus(directory: Path, seed: int = 0) -> None:
    """A JSON Lines corpus of a few dozen short documents (BOS 0 ... EOS 1)."""
    rng = np.random.default_rng(seed)
    with open(directory / "documents.jsonl", "w") as handle:
        for length in rng.integers(3, 40, size=48):
            body = rng.integers(2, VOCAB_SIZE, size=int(length) - 2).tolist()
            handle.write(json.dumps({"tokens": [0, *body, 1]}) + "\n")
    manifest = {
        "format": "streampack-corpus",
        "version": 1,
        "binding": {
            "vocab_size": VOCAB_SIZE,
            "tokenizer": "warm-up",
            "split_receipt": "warm-up",
            "partition": "train",
        },
        "jsonl": ["documents.jsonl"],
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def main() -> int:
    started = time.perf_counter()
    windows = batches = audited = 0
    with tempfile.TemporaryDirectory(prefix="streampack-warmup-") as tmp:
        _write_corpus(Path(tmp))
        settings = ProducerSettings(
            corpus=tmp, capacity=64, max_rows_per_batch=4, window_documents=16
        )
        source = open_corpus(settings.corpus)
        binding = source.binding.to_binding()
        config = PackConfig(capacity=settings.capacity, max_rows_per_batch=4)
        for window in iter_windows(source, 0, CutSpec.from_settings(settings)):
            if len(window.start) == 0:
                continue
            windows += 1
            # In process (`streampack digest`): the window's own arrays.
            pack_window(window.arrays(), binding, config)
            # In a worker: the arrays as decoded from the producer's message.
            frames = wire.encode(
                "window",
                {
                    "epoch": window.epoch,
                    "window": window.index,
                    "binding": wire.binding_to_wire(binding),
                    "config": {"capacity": settings.capacity, "max_rows_per_batch": 4},
                },
                window.arrays(),
            )
            message = wire.decode([bytes(frame) for frame in frames])
            examples, packed = pack_window(message.arrays, binding, config)
            batches += len(packed)
            for batch in packed:
                report = audit(batch, examples=examples)
                if not report.passed:
                    raise SystemExit(f"warm-up audit failed: {report.notes}")
                audited += 1
    # `streampack trace`: the worked example, through the command itself.
    with contextlib.redirect_stdout(io.StringIO()):
        cli_main(["trace"])
    print(json.dumps({
        "warmup": "ok",
        "windows": windows,
        "batches": batches,
        "audited": audited,
        "seconds": round(time.perf_counter() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
