"""Content digests (``streampack.digests.range_digests``): the compiled kernel beside the
hashlib loop, in ns per token at several document lengths; prints JSON.

The same seeded tokens (``--tokens`` of them, uint16 or int32) cut into documents of
each ``--lengths`` value, with and without a uint8 mask, digested in one call by:

* ``kernel``: ``range_digests`` as it runs (OpenSSL's ``SHA256_*`` from compiled code,
  ``streampack/kernels/digest_cpu.py``), its cache warmed before timing;
* ``hashlib``: the definition's loop, one ``hashlib.sha256`` per range (the fallback).

Each best of ``--repeats`` rounds, taking turns. Both are checked equal first.
``ratio`` is hashlib's time over the kernel's (above 1: the kernel is faster).

    .venv/bin/python benchmarks/digests.py [--tokens 4000000] [--lengths 16,64,240,1024,8192]
"""

from __future__ import annotations

import argparse
import json
import time

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
    print(json.dumps({"kernel": kernel is not None, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
