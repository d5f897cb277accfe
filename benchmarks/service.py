"""Service throughput: ``serve`` with 1 and 2 workers, 1 and 2 consumers, beside in-process
``pack_examples`` on the same corpus, in one run.

Corpus: the synthetic corpus of ``benchmarks/pack.py`` (lengths clip(lognormal(5, 1), 2,
2049), seeded; vocabulary 50,000; capacity 2048; 16 rows per batch), written as one
int32 token shard. Every process runs Numba single-threaded (``NUMBA_NUM_THREADS=1``),
so the in-process figure is the single-core rate. Each service run waits until its
workers are warm, then starts the consumers, which drain their ranks as fast as they
can; the delivered rate is all real tokens (prediction pairs) received divided by the
slowest consumer's time, first request to last batch. Each service try is paired with
an in-process measurement (best of 3) taken just before it, and its ratio is to that:
these machines' speed drifts by tens of percent over a run, and a ratio of figures
taken minutes apart measures the drift as much as the service. Each configuration
reports the best and the median of ``--repeats`` tries' ratios (each try listed too).

With ``--backups both`` every configuration runs with backup windows (the default) and
without (``--no-backups``), the two tries of each pair back to back, so the cost of
backups on a healthy service is read off one run: on a healthy service no window is
ever overdue, so the two should agree within the machine's noise.

The 2-worker runs are repeated over ``ipc://`` endpoints (Unix-domain sockets), the
cheaper transport when everything runs on one machine. Where the time goes is reported
per run as CPU seconds spent while the consumers ran: producer, workers, consumers
(including their start-up, about 1.5 s each of interpreter and Numba loading), and the
wall seconds the workers spent handling windows (above their CPU seconds when cores
are oversubscribed).

Per token (``per_token`` of each run): each role's CPU nanoseconds per delivered token
and its capacity (million tokens per CPU-second; a consumer's is the CPU its process
spent from its first request to its last batch, as ``consume`` reports it: start-up
not included), and the bytes the producer's sockets
sent per delivered token, to workers and to consumers (its ``bytes_sent_to_*``
counters). ``time_to_first_batch``: seconds from starting ``serve`` to a rank's first
batch, with 1 and 2 workers and a warm Numba cache, the rank asking from the start (a
trainer already running: its client's kernels loaded).

``corpora`` serves the same documents in three forms, 2 workers and 2 consumers each:
the token shards above; the shards with a supervision mask (``NAME.mask.npy``: a
prompt of a random share of each document, then the response, as the masked rows of
``benchmarks/pack.py``); and one Parquet file (``input_ids`` list<int32>, row groups
of 8192 documents). The three tries of a repeat run back to back (the order rotating),
and each repeat's ratios are masked / shards and Parquet / shards (targets: >= 0.8).

``--compare data_plane`` serves the shards to 2 consumers with ``data_plane =
"producer"`` (2 workers) and ``"workers"`` (1, 2 and 4 workers), the tries of each
repeat back to back (the order alternating), and reports per configuration the best
try's ``per_token`` (``consumers_verifying``: the CPU the consumers spent recomputing
route digests, ``consume``'s ``verify_seconds``; ``consumer_verify_share`` its share
of their CPU) and the ratios workers / producer, at 2 workers, of the producer's CPU
and bytes sent per delivered token.

    .venv/bin/python benchmarks/service.py [--documents 100000] [--repeats 3]
                                           [--backups on|off|both]
                                           [--compare workers|corpora|both|data_plane]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["NUMBA_NUM_THREADS"] = "1"
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))

import streampack as sp  # noqa: E402
from streampack.service.health import check  # noqa: E402

CAPACITY, ROWS_PER_BATCH, VOCAB = 2048, 16, 50_000


BINDING = {
    "vocab_size": VOCAB,
    "tokenizer": "synthetic",
    "split_receipt": "bench",
    "partition": "train",
}
#: The forms of the corpus ``corpora`` compares, each a directory of ``write_corpora``.
CORPORA = ("shards", "shards_masked", "parquet")


def write_corpora(root: Path, documents: int, seed: int = 0) -> sp.Examples:
    """The pack benchmark's corpus as Examples, and under ``root`` in each form of
    ``CORPORA`` (a directory each; the masked shards hard-link the plain ones' files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.pack import with_prompt_masks

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, documents), 2, CAPACITY + 1).astype(np.int64)
    offsets = np.zeros(documents + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
    examples = sp.Examples(
        tokens=tokens,
        offsets=offsets,
        doc=np.arange(documents),
        start=np.zeros(documents, np.int64),
        stop=lengths,
    )
    for name in CORPORA:
        (root / name).mkdir()
    shards, masked, parquet = (root / name for name in CORPORA)
    np.save(shards / "bench.tokens.npy", tokens)
    np.save(shards / "bench.offsets.npy", offsets)
    for suffix in (".tokens.npy", ".offsets.npy"):
        os.link(shards / f"bench{suffix}", masked / f"bench{suffix}")
    np.save(masked / "bench.mask.npy", with_prompt_masks(examples).mask)
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    pq.write_table(pa.table({"input_ids": lists}), parquet / "bench.parquet", row_group_size=8192)
    for directory, entry in (
        (shards, {"shards": ["bench"]}),
        (masked, {"shards": ["bench"]}),
        (parquet, {"parquet": ["bench.parquet"]}),
    ):
        manifest = {"format": "streampack-corpus", "version": 1, "binding": BINDING, **entry}
        (directory / "manifest.json").write_text(json.dumps(manifest))
    return examples


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    corpus: Path,
    workers: int,
    window_tokens: int,
    worker_endpoint: str,
    consumer_endpoint: str,
    backups: bool = True,
    data_plane: str = "producer",
) -> list[str]:
    """``streampack serve`` of the benchmark's shapes on ``corpus``."""
    return [
        sys.executable,
        "-m",
        "streampack.cli",
        "serve",
        "--corpus",
        str(corpus),
        "--workers",
        str(workers),
        "--capacity",
        str(CAPACITY),
        "--max-rows-per-batch",
        str(ROWS_PER_BATCH),
        "--window-documents",
        "65536",
        "--window-tokens",
        str(window_tokens),
        "--max-metadata-bytes",
        str(1 << 32),
        "--worker-endpoint",
        worker_endpoint,
        "--consumer-endpoint",
        consumer_endpoint,
        "--backups" if backups else "--no-backups",
        "--data-plane",
        data_plane,
    ]


def run_service(
    corpus: Path,
    workers: int,
    consumers: int,
    window_tokens: int,
    transport: str = "tcp",
    backups: bool = True,
    data_plane: str = "producer",
) -> dict:
    if transport == "ipc":
        worker_endpoint = f"ipc://{corpus}/workers.sock"
        consumer_endpoint = f"ipc://{corpus}/consumers.sock"
    else:
        worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        consumer_endpoint = f"tcp://127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "streampack.cli"]
    serve = subprocess.Popen(
        serve_command(
            corpus, workers, window_tokens, worker_endpoint, consumer_endpoint, backups, data_plane
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            status = check(consumer_endpoint, 1.0)
            if status is not None and status["stats"]["workers"] >= workers:
                ready = status["stats"]
                break
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not become ready")
        worker_pids = children(serve.pid)
        producer_cpu0 = cpu_seconds(serve.pid)
        worker_cpu0 = sum(cpu_seconds(pid) for pid in worker_pids)
        procs = [
            subprocess.Popen(
                [
                    *cli,
                    "consume",
                    "--connect",
                    consumer_endpoint,
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(consumers),
                    "--quiet",
                    "--prefetch",
                    "8",
                    "--no-digest",
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(consumers)
        ]
        outputs, consumer_cpu = [], 0.0
        for proc in procs:
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = 0
            consumer_cpu += usage.ru_utime + usage.ru_stime
            outputs.append(json.loads(proc.stdout.read().strip().splitlines()[-1]))
        stats = check(consumer_endpoint, 10.0)["stats"]
        sent = {
            peer: stats[f"bytes_sent_to_{peer}"] - ready[f"bytes_sent_to_{peer}"] for peer in PEERS
        }
        producer_cpu = cpu_seconds(serve.pid) - producer_cpu0
        worker_cpu = sum(cpu_seconds(pid) for pid in worker_pids) - worker_cpu0
    finally:
        serve.terminate()
        serve.communicate(timeout=30)
    tokens = sum(o["tokens"] for o in outputs)
    batches = sum(o["batches"] for o in outputs)
    seconds = max(o["seconds"] for o in outputs)
    consumer_span_cpu = sum(o["cpu_seconds"] for o in outputs)
    verify = sum(o["verify_seconds"] for o in outputs)
    return {
        "workers": workers,
        "consumers": consumers,
        "transport": transport,
        "backups": backups,
        "data_plane": data_plane,
        "batches_routed": stats["batches_routed"],
        "batches_rerouted": stats["batches_rerouted"],
        "windows_backed_up": stats["windows_backed_up"],
        "seconds": round(seconds, 3),
        "million_tokens_per_s": round(tokens / seconds / 1e6, 2),
        "batches_per_s": round(batches / seconds, 1),
        "cpu_seconds": {
            "producer": round(producer_cpu, 2),
            "workers": round(worker_cpu, 2),
            "workers_handling_windows_wall": round(stats["pack_seconds"], 2),
            "consumers": round(consumer_cpu, 2),
        },
        "per_token": per_token(
            tokens,
            {
                "producer": producer_cpu,
                "workers": worker_cpu,
                "consumers": consumer_span_cpu,
                "consumers_verifying": verify,
            },
            sent,
        ),
        # The digest check's share of the consumers' CPU (data_plane = "workers").
        "consumer_verify_share": round(verify / consumer_span_cpu, 3) if consumer_span_cpu else 0,
        "tokens": tokens,
        "batches": batches,
    }


#: The peers of the producer's two sockets, as its ``bytes_sent_to_*`` counters name them.
PEERS = ("workers", "consumers")


def per_token(tokens: int, cpu: dict[str, float], sent: dict[str, int]) -> dict:
    """Each role's CPU per delivered token (ns, and its capacity: million tokens per
    CPU-second) and the bytes the producer sent per delivered token, to each peer."""
    return {
        "cpu_ns": {role: round(seconds / tokens * 1e9, 2) for role, seconds in cpu.items()},
        "million_tokens_per_cpu_second": {
            role: round(tokens / seconds / 1e6, 1) if seconds > 0 else None
            for role, seconds in cpu.items()
        },
        "producer_bytes_sent": {peer: round(sent[peer] / tokens, 3) for peer in PEERS},
    }


def time_to_first_batch(corpus: Path, workers: int, window_tokens: int) -> dict:
    """Seconds from starting ``serve`` to a rank's first batch, the rank (a trainer
    already running, its client's kernels loaded) asking from the first moment; the
    Numba cache is warm. Also when the producer first answered a health check."""
    from streampack.client import BatchStream

    consumer_endpoint = f"tcp://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    serve = subprocess.Popen(
        serve_command(
            corpus, workers, window_tokens, f"tcp://127.0.0.1:{free_port()}", consumer_endpoint
        ),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with BatchStream(consumer_endpoint, rank=0, world_size=1, timeout=120) as stream:
            next(stream)
            first = time.perf_counter() - started
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    return {"workers": workers, "seconds_to_first_batch": round(first, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--window-tokens", type=int, default=1 << 18)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="tries of each configuration, each paired with its own "
        "in-process measurement (default: 3)",
    )
    parser.add_argument(
        "--backups",
        choices=("on", "off", "both"),
        default="on",
        help="backup windows on (the default setting), off, or both side by side",
    )
    parser.add_argument(
        "--compare",
        choices=("workers", "corpora", "both", "data_plane"),
        default="both",
        help="the worker/consumer/transport table, the corpus forms (masked, Parquet) "
        "beside token shards, or both (the default)",
    )
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.backups]
    if args.compare == "data_plane":
        with tempfile.TemporaryDirectory(prefix="streampack-bench-") as scratch:
            write_corpora(Path(scratch), args.documents)
            report = compare_data_planes(Path(scratch) / "shards", args.repeats, args.window_tokens)
        report = {"documents": args.documents, "cores": os.cpu_count(), **report}
        print(json.dumps(report, indent=1))
        return

    with tempfile.TemporaryDirectory(prefix="streampack-bench-") as scratch:
        examples = write_corpora(Path(scratch), args.documents)
        shards = Path(scratch) / "shards"
        binding = sp.Binding(VOCAB, "synthetic", "bench", "train")
        config = sp.PackConfig(
            capacity=CAPACITY, max_rows_per_batch=ROWS_PER_BATCH, max_metadata_bytes=1 << 40
        )
        real_tokens = int(examples.prediction_lengths.sum())
        sp.pack_examples(examples, binding, config)  # compile or load the cache

        def in_process_seconds() -> float:
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                epoch = sp.pack_examples(examples, binding, config)
                best = min(best, time.perf_counter() - started)
                del epoch
            return best

        configurations = [(w, c, "tcp") for w in (1, 2) for c in (1, 2)]
        # Unix-domain sockets for the same-machine case (no TCP stack on the data path).
        configurations += [(2, c, "ipc") for c in (1, 2)]
        if args.compare == "corpora":
            configurations = []
        runs, in_process_best = [], float("inf")
        for workers, consumers, transport in configurations:
            tries: dict[bool, list[dict]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):
                # Pairs alternate which goes first, so a drift favours neither.
                for backups in modes if repeat % 2 == 0 else modes[::-1]:
                    baseline = in_process_seconds()
                    in_process_best = min(in_process_best, baseline)
                    run = run_service(
                        shards,
                        workers,
                        consumers,
                        args.window_tokens,
                        transport,
                        backups,
                    )
                    run["in_process_million_tokens_per_s"] = round(real_tokens / baseline / 1e6, 2)
                    run["ratio_to_in_process"] = round(
                        run["million_tokens_per_s"] / run["in_process_million_tokens_per_s"], 3
                    )
                    tries[backups].append(run)
            for mode in modes:
                best_run = max(tries[mode], key=lambda run: run["ratio_to_in_process"])
                ratios = [run["ratio_to_in_process"] for run in tries[mode]]
                best_run["ratio_of_each_try"] = ratios
                best_run["median_ratio"] = round(float(np.median(ratios)), 3)
                best_run["seconds_of_each_try"] = [run["seconds"] for run in tries[mode]]
                runs.append(best_run)
        if args.compare != "workers":
            in_process_best = min(in_process_best, in_process_seconds())
        corpora = (
            compare_corpora(Path(scratch), args.repeats, args.window_tokens)
            if args.compare != "workers"
            else None
        )
        in_process = real_tokens / in_process_best / 1e6
        # The rank's client loaded its kernels before serve starts (a trainer at work).
        from streampack.client import BatchStream

        BatchStream("tcp://127.0.0.1:9", rank=0, world_size=1).close()
        first_batch = [
            time_to_first_batch(shards, workers, args.window_tokens)
            for workers in (1, 2)
            for _ in range(args.repeats)
        ]
    report = {
        "documents": args.documents,
        "real_tokens": real_tokens,
        "capacity": CAPACITY,
        "rows_per_batch": ROWS_PER_BATCH,
        "window_tokens": args.window_tokens,
        "cores": os.cpu_count(),
        "in_process_pack_examples_million_tokens_per_s": round(in_process, 2),
    }
    if runs:
        report["service"] = runs
        report["target"] = "2 workers >= 0.5 x in-process single-core rate"
    if corpora is not None:
        report["corpora"] = corpora
    report["time_to_first_batch"] = {}
    for workers in (1, 2):
        seconds = [t["seconds_to_first_batch"] for t in first_batch if t["workers"] == workers]
        report["time_to_first_batch"][f"{workers}_workers"] = {
            "seconds_of_each_try": seconds,
            "median_seconds": round(float(np.median(seconds)), 3),
        }
    print(json.dumps(report, indent=1))


#: The configurations ``--compare data_plane`` runs: (data_plane, workers).
DATA_PLANE_RUNS = (("producer", 2), ("workers", 1), ("workers", 2), ("workers", 4))


def compare_data_planes(shards: Path, repeats: int, window_tokens: int) -> dict:
    """2 consumers; ``data_plane`` producer with 2 workers beside workers with 1, 2 and 4,
    the tries of each repeat back to back (the order alternating). Per configuration
    the best try by delivered rate, the producer's CPU per token of each try, and the
    consumers' verification share (``verify_seconds`` of their CPU); then the ratios
    workers / producer at 2 workers of the producer's CPU (medians) and bytes sent per
    delivered token."""
    tries: dict[tuple[str, int], list[dict]] = {run: [] for run in DATA_PLANE_RUNS}
    for repeat in range(repeats):
        for plane, workers in DATA_PLANE_RUNS if repeat % 2 == 0 else DATA_PLANE_RUNS[::-1]:
            run = run_service(shards, workers, 2, window_tokens, data_plane=plane)
            tries[(plane, workers)].append(run)
    out: dict[str, Any] = {}
    for (plane, workers), runs in tries.items():
        best = max(runs, key=lambda run: run["million_tokens_per_s"])
        best["producer_cpu_ns_per_token_of_each_try"] = [
            run["per_token"]["cpu_ns"]["producer"] for run in runs
        ]
        out[f"{plane}_{workers}_workers"] = best
    cpu = {
        plane: float(np.median(out[f"{plane}_2_workers"]["producer_cpu_ns_per_token_of_each_try"]))
        for plane in ("producer", "workers")
    }
    sent = {
        plane: out[f"{plane}_2_workers"]["per_token"]["producer_bytes_sent"]
        for plane in ("producer", "workers")
    }
    out["workers_over_producer"] = {
        "producer_cpu_per_token_median": round(cpu["workers"] / cpu["producer"], 3),
        "producer_bytes_to_consumers_per_token": round(
            sent["workers"]["consumers"] / sent["producer"]["consumers"], 4
        ),
        "producer_bytes_to_all_per_token": round(
            sum(sent["workers"].values()) / sum(sent["producer"].values()), 3
        ),
    }
    return out


def compare_corpora(root: Path, repeats: int, window_tokens: int) -> dict:
    """Each form of ``CORPORA`` served by 2 workers to 2 consumers, the forms of one
    repeat back to back (their order rotating, so a drift favours none), and each
    repeat's delivered rate of a form over that of the plain shards."""
    tries: dict[str, list[dict]] = {name: [] for name in CORPORA}
    for repeat in range(repeats):
        shift = repeat % len(CORPORA)
        for name in CORPORA[shift:] + CORPORA[:shift]:
            tries[name].append(run_service(root / name, 2, 2, window_tokens))
    out: dict[str, dict] = {}
    for name in CORPORA:
        rates = [run["million_tokens_per_s"] for run in tries[name]]
        plain = [run["million_tokens_per_s"] for run in tries["shards"]]
        out[name] = {
            "million_tokens_per_s_of_each_try": rates,
            "cpu_seconds_of_best_try": max(
                tries[name], key=lambda run: run["million_tokens_per_s"]
            )["cpu_seconds"],
        }
        if name != "shards":
            ratios = [rate / base for rate, base in zip(rates, plain)]
            out[name]["ratio_to_shards_of_each_try"] = [round(r, 3) for r in ratios]
            out[name]["best_ratio_to_shards"] = round(max(ratios), 3)
            out[name]["median_ratio_to_shards"] = round(float(np.median(ratios)), 3)
    out["target"] = "shards_masked and parquet >= 0.8 x shards (2 workers, 2 consumers)"
    return out


if __name__ == "__main__":
    main()
