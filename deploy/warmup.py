"""Compile streampack's cached Numba kernels once, on the paths the service takes.

The image runs this at build time (as the runtime user, with ``NUMBA_CACHE_DIR`` set),
so that a container loads every kernel from the cache instead of compiling it at start.
Numba compiles one specialization per argument type, and the types a process meets
depend on its path (arrays decoded from messages are read-only views, for one), so the
warm-up does not call internals: it runs the real commands on a small corpus —
``streampack serve`` with an auditing worker, ``streampack consume`` against it,
``streampack digest`` in process, ``streampack corpus digest`` (the compiled content
digests) and ``streampack trace`` — and checks on the way that the served stream
equals the in-process one and that every audit passed.

Usage: ``python warmup.py`` (prints one JSON line with what it ran).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB_SIZE = 512
SETTINGS = [
    "--capacity",
    "64",
    "--max-rows-per-batch",
    "4",
    "--window-documents",
    "16",
    "--epochs",
    "1",
]


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


def _streampack(*args: str, timeout: float = 600) -> dict:
    """Run one streampack command; its last stdout line, parsed as JSON."""
    result = subprocess.run(
        [sys.executable, "-m", "streampack.cli", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streampack-warmup-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        _write_corpus(corpus)
        # ipc endpoints: nothing to collide with on the build host's network.
        consumers = f"ipc://{tmp}/consumers"
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streampack.cli",
                "serve",
                "--corpus",
                str(corpus),
                "--workers",
                "1",
                "--audit-every",
                "1",
                *SETTINGS,
                "--worker-endpoint",
                f"ipc://{tmp}/workers",
                "--consumer-endpoint",
                consumers,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            served = _streampack(
                "consume",
                "--connect",
                consumers,
                "--rank",
                "0",
                "--world-size",
                "1",
                "--quiet",
            )
            status = _streampack("health", "--connect", consumers, "--timeout", "30")
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                _, errors = serve.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
                _, errors = serve.communicate()
        if serve.returncode != 0:
            raise SystemExit(f"warm-up: serve exited with {serve.returncode}:\n{errors}")
        in_process = _streampack(
            "digest", "--corpus", str(corpus), "--rank", "0", "--world-size", "1", *SETTINGS
        )
        # The per-document table: the compiled content digests (corpus/tables.py).
        table = _streampack("corpus", "digest", str(corpus))
    stats = status["stats"]
    if served["digest"] != in_process["digest"] or served["batches"] == 0:
        raise SystemExit(f"warm-up: served {served} but in process {in_process}")
    if table["documents"] == 0:
        raise SystemExit(f"warm-up: corpus digest wrote no rows: {table}")
    if stats.get("audited", 0) == 0 or stats.get("audit_failures", 0):
        raise SystemExit(f"warm-up: audits did not all pass: {stats}")
    subprocess.run(
        [sys.executable, "-m", "streampack.cli", "trace"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=600,
    )
    print(
        json.dumps(
            {
                "warmup": "ok",
                "batches": served["batches"],
                "audited": stats["audited"],
                "digest": served["digest"],
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
