"""What one hung pack worker costs a trainer: the longest wait for a batch.

A real producer (``streampack produce``, default ``window_timeout`` of 60 s unless told
otherwise), one real pack worker, and one *hung* worker: a raw ZeroMQ peer that says
``ready``, heartbeats every 0.2 s and never answers the windows it takes (after
answering its first ``--honest`` windows correctly, so it can be a proven worker that
hangs, as a real process whose heartbeat thread outlives its packing thread does). One
trainer (the real ``BatchStream``, in this process) reads the whole stream and times
every ``next()``; the longest of those waits is what the hung worker cost.

    .venv/bin/python benchmarks/hung_worker.py                  # backups on (the default)
    .venv/bin/python benchmarks/hung_worker.py --no-backups     # only the hard deadline

Prints one JSON line: the longest and total wait, the batches, whether the stream
equals ``streampack digest``'s, and the producer's counters that tell the story.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))

from streampack import wire  # noqa: E402
from streampack.client import BatchStream, StreamDigest  # noqa: E402
from streampack.service.digest import rank_stream  # noqa: E402
from streampack.service.health import check  # noqa: E402
from streampack.settings import ProducerSettings  # noqa: E402

FIXTURE = ROOT / "fixtures" / "corpus"
# The shapes of the service tests: 49 batches in 15 windows of the fixture corpus.
SHAPE = {"capacity": 256, "max_rows_per_batch": 4, "window_documents": 40, "window_tokens": 3000}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{name}" if value else f"--no-{name}")
        else:
            out += [f"--{name}", str(value)]
    return out


def hung_worker(endpoint: str, honest: int, credit: int, stop: threading.Event, log: list) -> None:
    """Register, heartbeat every 0.2 s, answer the first ``honest`` windows, then never."""
    from streampack.config import PackConfig
    from streampack.service.plan_check import ranges_plan

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    socket.send_multipart(wire.encode("ready", {"credit": credit, "needs_tokens": False}))
    answered = 0
    next_beat = 0.0
    try:
        while not stop.is_set():
            if time.monotonic() >= next_beat:
                socket.send_multipart(wire.encode("heartbeat", {"free": 1, "needs_tokens": False}))
                next_beat = time.monotonic() + 0.2
            if not socket.poll(50):
                continue
            message = wire.decode(socket.recv_multipart())
            if message.kind != "window":
                continue
            key = (message.fields["epoch"], message.fields["window"])
            if answered >= honest:
                log.append(f"took window {key} and hangs on it")
                continue
            occurrences, sizes = ranges_plan(
                message.arrays, PackConfig.from_wire(message.fields["config"])
            )
            fields = {
                "epoch": key[0],
                "window": key[1],
                "capacity": message.fields["config"]["capacity"],
                "seconds": 0.0,
                "audited": 0,
                "audit_failures": 0,
                "audit_error": "",
            }
            arrays = {"occurrences": occurrences, "batch_sizes": sizes}
            socket.send_multipart(wire.encode("packed", fields, arrays))
            socket.send_multipart(wire.encode("ready", {"credit": 1, "needs_tokens": False}))
            answered += 1
            log.append(f"answered window {key}")
    finally:
        socket.close(linger=0)
        context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backups", action=argparse.BooleanOptionalAction, default=True, help="(default: on)"
    )
    parser.add_argument("--window-timeout", type=float, default=60.0)
    parser.add_argument("--honest", type=int, default=0, help="windows answered before hanging")
    parser.add_argument("--credit", type=int, default=2, help="windows the hung worker asks for")
    parser.add_argument("--timeout", type=float, default=120.0, help="the trainer's timeout")
    args = parser.parse_args()

    settings = {
        "corpus": str(FIXTURE),
        **SHAPE,
        "window_timeout": args.window_timeout,
        "backups": args.backups,
    }
    worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
    consumer_endpoint = f"tcp://127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "streampack.cli"]
    with tempfile.TemporaryDirectory(prefix="streampack-hung-") as scratch:
        errors = open(Path(scratch) / "producer.err", "w")
        producer = subprocess.Popen(
            [*cli, "produce", *flags(settings), "--worker-endpoint", worker_endpoint]
            + ["--consumer-endpoint", consumer_endpoint],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        stop, log = threading.Event(), []
        hung = threading.Thread(
            target=hung_worker, args=(worker_endpoint, args.honest, args.credit, stop, log)
        )
        worker = None
        try:
            while check(consumer_endpoint, 1.0) is None:
                if producer.poll() is not None:
                    raise SystemExit(f"the producer exited {producer.returncode}")
            hung.start()  # first: it is the first worker with credit
            worker = subprocess.Popen(
                [*cli, "worker", "--connect", worker_endpoint, "--heartbeat-interval", "0.2"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            while check(consumer_endpoint, 1.0)["stats"]["workers"] < 2:
                time.sleep(0.05)
            digest, waits = StreamDigest(), []
            started = time.monotonic()
            with BatchStream(consumer_endpoint, rank=0, world_size=1, timeout=args.timeout) as s:
                while True:
                    asked = time.monotonic()
                    try:
                        batch = next(s)
                    except StopIteration:
                        break
                    waits.append(time.monotonic() - asked)
                    digest.update(batch, *s.current)
            seconds = time.monotonic() - started
            stats = check(consumer_endpoint, 10.0)["stats"]
        finally:
            stop.set()
            if worker is not None:
                worker.kill()
                worker.wait()
            producer.terminate()
            producer.communicate(timeout=30)
            hung.join(5)
            errors.close()
    want = StreamDigest()
    for epoch, index, batch in rank_stream(ProducerSettings(**settings), 0, 1):
        want.update(batch, epoch, index)
    keep = (
        "windows_backed_up",
        "backup_wins",
        "duplicates_dropped",
        "windows_overdue",
        "workers_dropped",
        "windows_issued",
    )
    print(
        json.dumps(
            {
                "backups": args.backups,
                "window_timeout": args.window_timeout,
                "honest_windows": args.honest,
                "batches": len(waits),
                "longest_wait_s": round(max(waits), 3),
                "waits_over_0.5_s": [round(w, 2) for w in waits if w > 0.5],
                "stream_seconds": round(seconds, 2),
                "digest_matches": digest.hexdigest() == want.hexdigest(),
                "hung_worker": log,
                "producer": {k: stats[k] for k in keep if k in stats},
            }
        )
    )


if __name__ == "__main__":
    main()
