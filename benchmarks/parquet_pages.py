"""``streampack.corpus.parquet_pages`` against pyarrow's ``read_row_group``, decoding
every row group's token column on one thread; prints JSON.

The documents are ``benchmarks/corpus.py``'s (``clip(lognormal(5, 1), 2, 2048)``
tokens, vocabulary 32000, 8192-row groups), written with pyarrow's defaults (Snappy,
dictionary), with no compression and no dictionary, and with Zstandard. Each decoder
takes turns per round; reported: the best of ``--repeats`` rounds in M tokens/s and
each one's time over pyarrow's. ``--before DIR`` adds another version of the page
reader, its ``parquet_pages.py`` and ``parquet_cpu.py`` in DIR (``git show
REV:streampack/corpus/parquet_pages.py > DIR/parquet_pages.py``, the same for
``streampack/kernels/parquet_cpu.py``), timed in the same rounds.

    python benchmarks/parquet_pages.py [--documents 50000] [--repeats 7] [--before DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

WRITERS: dict[str, dict[str, Any]] = {
    "snappy_dictionary": {},
    "plain_uncompressed": {"compression": "none", "use_dictionary": False},
    "zstd_dictionary": {"compression": "zstd"},
}


def load_before(folder: Path) -> ModuleType:
    """``parquet_pages`` of ``folder``, importing its own ``parquet_cpu``."""
    kernels = importlib.util.spec_from_file_location(
        "before_parquet_cpu", folder / "parquet_cpu.py"
    )
    assert kernels is not None and kernels.loader is not None
    compiled = importlib.util.module_from_spec(kernels)
    sys.modules[kernels.name] = compiled  # (Numba's cache finds it there)
    kernels.loader.exec_module(compiled)
    source = (folder / "parquet_pages.py").read_text()
    source = source.replace("from streampack.kernels import parquet_cpu", "")
    module = ModuleType("before_parquet_pages")
    module.__dict__["parquet_cpu"] = compiled
    sys.modules[module.__name__] = module  # (its dataclasses look themselves up there)
    exec(compile(source, str(folder / "parquet_pages.py"), "exec"), module.__dict__)
    return module


def decoder(pa: Any, pq: Any, path: Path, pages: ModuleType | None) -> Callable[[], int]:
    """Decoding every row group of ``path`` once: pyarrow's (``pages`` None) or that
    page reader's; returns the tokens decoded."""
    handle = pq.ParquetFile(str(path), memory_map=True)
    groups = handle.num_row_groups
    if pages is None:

        def run() -> int:
            return sum(
                handle.read_row_group(g, columns=["input_ids"], use_threads=False)[0]
                .combine_chunks()
                .values.__len__()
                for g in range(groups)
            )

        return run
    data = pages.file_bytes(path)
    try:
        plan = pages.column_plan(pa, handle, "input_ids", data)
        read = lambda g: pages.read_row_group(pa, data, plan, g)  # noqa: E731
    except TypeError:  # an earlier version: (pa, handle, column) and the handle to read
        plan = pages.column_plan(pa, handle, "input_ids")
        read = lambda g: pages.read_row_group(pa, data, handle, plan, g)  # noqa: E731

    def run() -> int:
        total = 0
        for g in range(groups):
            got = read(g)
            assert got is not None and not isinstance(got, str), got
            total += len(got[1])
        return total

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before", type=Path, default=None)
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streampack.corpus import parquet_pages

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, args.documents), 2, 2048).astype(np.int64)
    flat = rng.integers(0, 32000, int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))})
    readers: dict[str, ModuleType | None] = {"pyarrow": None, "parquet_pages": parquet_pages}
    if args.before is not None:
        readers["parquet_pages_before"] = load_before(args.before)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for writer, options in WRITERS.items():
            path = Path(tmp) / f"{writer}.parquet"
            pq.write_table(table, path, row_group_size=8192, **options)
            runs = {name: decoder(pa, pq, path, pages) for name, pages in readers.items()}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    assert run() == len(flat)
                    best[name] = min(best[name], time.perf_counter() - start)
            results[writer] = {
                name: {
                    "m_tokens_per_s": round(len(flat) / seconds / 1e6, 1),
                    "time_vs_pyarrow": round(seconds / best["pyarrow"], 3),
                }
                for name, seconds in best.items()
            }
    print(
        json.dumps(
            {
                "benchmark": "parquet_pages",
                "documents": args.documents,
                "tokens": len(flat),
                "repeats": args.repeats,
                "python": sys.version.split()[0],
                "pyarrow": pa.__version__,
                **results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
