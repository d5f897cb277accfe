"""Time to the first batch: ``streampack serve`` and one trainer rank started at the same
moment, as a job starts (and restarts, and resizes), until the rank holds its first batch.

Each try spawns ``streampack serve`` on the bundled corpus (``fixtures/corpus/``, capacity
256, 16 rows per batch) and, at the same instant, a fresh Python process playing the
trainer: it imports ``streampack.client``, creates a ``BatchStream`` (which loads its
check and expand kernels) and takes one batch. Every time is seconds from that instant
(wall clock, shared by the processes), for 1 and 2 workers and ``data_plane =
"producer"`` and ``"workers"``. The first try runs on an empty ``NUMBA_CACHE_DIR`` (cold:
every kernel compiled); every later one reuses it (warm: every kernel loaded from the
cache), and the warm tries' median and best are reported.

Where the time goes, per try (``timeline``): the trainer's imports done, its kernels
loaded, its first batch; the producer's endpoints bound and its kernels loaded; each
worker's start, imports done and kernels loaded (the service's DEBUG log lines);
``after_ready``, the first batch less the last of those readiness marks: the socket
handshakes and the first window's cut, plan and delivery; ``cpu_seconds``, the CPU each
role (producer, all workers, trainer) had spent when the trainer held its batch: the
work start-up costs, which a loaded machine stretches less than the wall time. Besides,
once per run (``imports``): each role's import time (``python -X importtime``, the sum
of its top-level imports), and (``kernels``) the seconds and CPU seconds a fresh process
takes to load the kernels from the warm cache, every one (a trainer's, an auditing
worker's) and planning and gathering only (``warm_up_kernels(expand=False)``: a
producer's, a worker's), with the number it compiled (Numba's dispatcher stats; 0 when
the cache is warm).

``--against DIR`` runs another checkout (``git archive`` of an earlier commit, say) in
the same round-robin, each of its tries right after this one's of the same
configuration, and reports the ratios this / it of the median and best seconds.

The reference (``grain``, when ``grain`` is installed: ``make bench`` installs it): the
same documents (the corpus shards' tokens) through Grain's multiprocess pipeline in a
fresh process, first-fit packed to the same capacity and rows and batched, with 1 and
2 worker processes: seconds from the process's start to its first batch.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--no-grain] [--against DIR]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "corpus"
CAPACITY = 256
ROWS = 16
CONFIGS = [(1, "producer"), (2, "producer"), (1, "workers"), (2, "workers")]
ROLES = {
    "serve": "streampack.cli, streampack.service.serve",
    "worker": "streampack.cli, streampack.service.worker",
    "trainer": "streampack.client",
    "consume": "streampack.cli, streampack.service.consume",
}

TRAINER = """
import json, sys, time
started, endpoint = float(sys.argv[1]), sys.argv[2]
marks = {"trainer_python": time.time() - started}
from streampack.client import BatchStream
marks["trainer_imported"] = time.time() - started
with BatchStream(endpoint, rank=0, world_size=1, timeout=120) as stream:
    marks["trainer_kernels"] = time.time() - started
    next(stream)
    marks["first_batch"] = time.time() - started
print(json.dumps({**marks, "cpu": time.process_time()}))
"""

KERNELS = """
import json, time
started = time.perf_counter()
from streampack.kernels import pack_cpu
from streampack.packing import warm_up_kernels
imported = time.perf_counter()
cpu = time.process_time()
warm_up_kernels(**KEYWORDS)
loaded = time.perf_counter()
cpu = time.process_time() - cpu
dispatchers = [f for f in vars(pack_cpu).values() if hasattr(f, "stats")]
print(json.dumps({
    "seconds": round(loaded - imported, 3),
    "cpu_seconds": round(cpu, 3),
    "loaded": sum(sum(f.stats.cache_hits.values()) for f in dispatchers),
    "compiled": sum(sum(f.stats.cache_misses.values()) for f in dispatchers),
}))
"""

GRAIN = """
import sys, time
started = float(sys.argv[1])
import numpy as np
import grain

class Documents:
    def __init__(self, folder):
        self.documents = []
        for shard in ("shard-000", "shard-001"):
            tokens = np.load(f"{folder}/{shard}.tokens.npy", mmap_mode="r")
            offsets = np.load(f"{folder}/{shard}.offsets.npy")
            ends = list(offsets[1:]) + [len(tokens)]
            self.documents += [(tokens, a, b) for a, b in zip(offsets, ends) if b > a]
    def __len__(self):
        return len(self.documents)
    def __getitem__(self, index):
        tokens, start, stop = self.documents[index]
        return {"tokens": np.asarray(tokens[start:stop][:CAPACITY], np.int32)}

if __name__ == "__main__":
    dataset = (
        grain.MapDataset.source(Documents(sys.argv[2])).to_iter_dataset()
    )
    dataset = grain.experimental.FirstFitPackIterDataset(
        dataset, length_struct={"tokens": CAPACITY}, num_packing_bins=ROWS, shuffle_bins=False
    ).batch(ROWS)
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(sys.argv[3])))
    batch = next(iter(dataset))
    print(time.time() - started)
""".replace("CAPACITY", str(CAPACITY)).replace("ROWS", str(ROWS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """The CPU seconds (user + system) process ``pid`` has spent so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pids(log: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"worker \d+ started as pid (\d+)", log)]


def log_marks(log: str, started: float) -> dict[str, float]:
    """The service's readiness marks, seconds after ``started``, from its JSON log."""
    marks: dict[str, float] = {}
    patterns = {
        "producer_bound": re.compile(r"^producer: serving"),
        "producer_kernels": re.compile(r"^producer: kernels loaded"),
        "worker{}_started": re.compile(r"^worker (\d+) started as pid"),
        "worker_imported": re.compile(r"^worker \d+ connecting"),
        "worker_kernels": re.compile(r"^worker \d+: kernels loaded"),
    }
    counts: dict[str, int] = {}
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        at = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()
        for name, pattern in patterns.items():
            found = pattern.match(record["message"])
            if not found:
                continue
            if "{}" in name:
                name = name.format(found.group(1))
            elif name.startswith("worker"):  # one mark per worker, in the order they came
                counts[name] = counts.get(name, 0) + 1
                name = name.replace("worker", f"worker{counts[name] - 1}")
            marks.setdefault(name, round(at - started, 3))
    return marks


def one_try(workers: int, plane: str, cache: Path, root: Path = ROOT) -> dict:
    """One start of ``serve`` and a trainer at the same instant, both running the
    checkout at ``root``; the timeline."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    consumer_endpoint = f"tcp://127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "streampack.cli", "serve", "--corpus", str(CORPUS),
        "--workers", str(workers), "--capacity", str(CAPACITY),
        "--max-rows-per-batch", str(ROWS), "--data-plane", plane,
        "--worker-endpoint", f"tcp://127.0.0.1:{free_port()}",
        "--consumer-endpoint", consumer_endpoint,
        "--log-format", "json", "--log-level", "DEBUG",
    ]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        started = time.time()
        serve = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            trainer = subprocess.run(
                [sys.executable, "-c", TRAINER, repr(started), consumer_endpoint],
                cwd=root, env=env, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            # Each role's CPU to the first batch: the processes are still running.
            log.seek(0)
            text = log.read()
            cpu = {"producer": cpu_seconds(serve.pid)}
            cpu["workers"] = sum(cpu_seconds(pid) for pid in worker_pids(text))
        finally:
            serve.terminate()
            serve.wait(timeout=60)
        if trainer.returncode != 0:
            raise SystemExit(f"the trainer failed:\n{trainer.stderr}")
        marks = {**log_marks(text, started), **json.loads(trainer.stdout)}
        cpu["trainer"] = marks.pop("cpu")
    # Ready: the trainer, the producer and the first worker to have loaded its kernels.
    workers_ready = min(v for k, v in marks.items() if k.startswith("worker") and "kernels" in k)
    ready = max(marks["trainer_kernels"], marks["producer_kernels"], workers_ready)
    timeline = {k: round(v, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    return {
        **timeline,
        "after_ready": round(marks["first_batch"] - ready, 3),
        "cpu_seconds": {role: round(seconds, 3) for role, seconds in cpu.items()},
    }


def import_seconds(modules: str) -> float:
    """Seconds of a fresh interpreter's imports of ``modules`` (``-X importtime``)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {modules}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    total = 0
    for line in run.stderr.splitlines():
        parts = line.split("|")
        # Top-level imports only: their cumulative time holds everything under them.
        if len(parts) == 3 and parts[2].startswith(" ") and not parts[2].startswith("  "):
            if parts[1].strip().isdigit():
                total += int(parts[1])
    return round(total / 1e6, 3)


def kernel_load(cache: Path, keywords: str = "") -> dict:
    """A fresh process's ``warm_up_kernels(keywords)`` from the cache ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    code = KERNELS.replace("**KEYWORDS", keywords)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return json.loads(run.stdout)


def grain_try(workers: int) -> float | None:
    run = subprocess.run(
        [sys.executable, "-c", GRAIN, repr(time.time()), str(CORPUS), str(workers)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"the Grain pipeline failed:\n{run.stderr}")
    return round(float(run.stdout.split()[-1]), 3)


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "best": min(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="warm tries per configuration")
    parser.add_argument("--no-grain", action="store_true", help="skip the Grain reference")
    parser.add_argument(
        "--against",
        type=Path,
        help="another checkout (e.g. `git archive` of an earlier commit), run in the same "
        "round-robin: its warm tries are reported beside, with the ratios this / it",
    )
    args = parser.parse_args()
    grain_there = not args.no_grain and importlib.util.find_spec("grain") is not None
    cache = Path(tempfile.mkdtemp(prefix="streampack-startup-cache-"))
    other_cache = Path(tempfile.mkdtemp(prefix="streampack-startup-cache-"))
    report: dict = {"corpus": str(CORPUS.relative_to(ROOT)), "repeats": args.repeats}
    try:
        report["cold"] = {f"{w}_workers_{p}": one_try(w, p, cache) for w, p in CONFIGS[:1]}
        # Every kernel (a trainer's, an auditing worker's), and planning and gathering only
        # (a producer's, a worker's), back to back, three times each.
        report["kernels"] = {
            name: min(
                (kernel_load(cache, keywords) for _ in range(3)), key=lambda k: k["cpu_seconds"]
            )
            for name, keywords in (("all", ""), ("planning", "expand=False"))
        }
        report["imports"] = {role: import_seconds(mods) for role, mods in ROLES.items()}
        roots = {"warm": ROOT}
        if args.against is not None:
            roots["against"] = args.against.resolve()
            one_try(*CONFIGS[0], other_cache, roots["against"])  # fills its cache
        tries = {key: {f"{w}_workers_{p}": [] for w, p in CONFIGS} for key in roots}
        grains: dict[str, list[float]] = {"1_workers": [], "2_workers": []}
        for _ in range(args.repeats):
            # Round-robin over the configurations (and checkouts, one try of each back to
            # back), so a drift of the machine favours none.
            for workers, plane in CONFIGS:
                for key, root in roots.items():
                    where = cache if key == "warm" else other_cache
                    tries[key][f"{workers}_workers_{plane}"].append(
                        one_try(workers, plane, where, root)
                    )
            if grain_there:
                for workers in (1, 2):
                    grains[f"{workers}_workers"].append(grain_try(workers))
        for key in roots:
            report[key] = {
                name: {
                    "seconds_to_first_batch": summary([t["first_batch"] for t in runs]),
                    "after_ready": summary([t["after_ready"] for t in runs]),
                    # Each role's CPU to the first batch, median over the tries: the work
                    # start-up costs, which a loaded machine stretches less than the wall.
                    "cpu_seconds": {
                        role: round(statistics.median(t["cpu_seconds"][role] for t in runs), 3)
                        for role in runs[0]["cpu_seconds"]
                    },
                    "tries": runs,
                }
                for name, runs in tries[key].items()
            }
        if args.against is not None:
            report["ratio_this_to_against"] = {
                name: {
                    which: round(
                        report["warm"][name]["seconds_to_first_batch"][which]
                        / report["against"][name]["seconds_to_first_batch"][which],
                        3,
                    )
                    for which in ("median", "best")
                }
                for name in tries["warm"]
            }
        if grain_there:
            report["grain"] = {
                name: {**summary(seconds), "tries": seconds} for name, seconds in grains.items()
            }
        else:
            report["grain"] = "not installed (make bench installs it): skipped"
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(other_cache, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
