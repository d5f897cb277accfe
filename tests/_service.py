"""Helpers for the end-to-end service tests: real processes on 127.0.0.1, free ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "corpus"

# Small shapes: the fixture's documents reach 257 tokens, so capacity 256 holds them all.
SMALL = {
    "capacity": 256,
    "max_rows_per_batch": 4,
    "window_documents": 40,
    "window_tokens": 3000,
}


def env() -> dict[str, str]:
    environment = dict(os.environ)
    environment.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    environment["PYTHONPATH"] = str(ROOT) + os.pathsep + environment.get("PYTHONPATH", "")
    return environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(settings: dict[str, Any]) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "streampack.cli", *args]


def start(*args: str, stdout: Any = subprocess.PIPE, stderr: Any = None) -> subprocess.Popen:
    return subprocess.Popen(
        command(*args), cwd=ROOT, env=env(), stdout=stdout, stderr=stderr, text=True
    )


def wait_healthy(endpoint: str, timeout: float = 60.0, key: str | None = None) -> dict[str, Any]:
    from streampack.service.health import check

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = check(endpoint, 1.0, key)
        if status is not None:
            return status
    raise AssertionError(f"producer at {endpoint} not healthy within {timeout}s")


def stats(endpoint: str, key: str | None = None) -> dict[str, Any]:
    from streampack.service.health import check

    status = check(endpoint, 10.0, key)
    assert status is not None, f"no status from {endpoint}"
    return status["stats"]


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> str:
    """SIGTERM, wait, and return stdout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("process did not stop within its timeout after SIGTERM") from None
    return out or ""


class Service:
    """A producer (``produce`` or ``serve``) on free ports, plus optional workers."""

    def __init__(
        self,
        corpus: Path | str,
        *,
        serve_workers: int = 0,
        worker_endpoint: str | None = None,
        consumer_endpoint: str | None = None,
        **settings: Any,
    ) -> None:
        self.worker_endpoint = worker_endpoint or f"tcp://127.0.0.1:{free_port()}"
        self.consumer_endpoint = consumer_endpoint or f"tcp://127.0.0.1:{free_port()}"
        self.settings = {"corpus": str(corpus), **SMALL, **settings}
        self.serve_workers = serve_workers
        self.workers: list[subprocess.Popen] = []
        self.producer: subprocess.Popen | None = None
        self.key: str | None = None  # the producer's CURVE public key, when it has one
        if "curve_secret_key_file" in settings:
            import zmq

            secret = Path(settings["curve_secret_key_file"]).read_bytes().strip()
            self.key = zmq.curve_public(secret).decode()

    def __enter__(self) -> Service:
        args = flags(self.settings) + [
            "--worker-endpoint",
            self.worker_endpoint,
            "--consumer-endpoint",
            self.consumer_endpoint,
        ]
        if self.serve_workers:
            self.producer = start("serve", "--workers", str(self.serve_workers), *args)
        else:
            self.producer = start("produce", *args)
        wait_healthy(self.consumer_endpoint, key=self.key)
        return self

    def add_worker(self, *extra: str) -> subprocess.Popen:
        proc = start(
            "worker",
            "--connect",
            self.worker_endpoint,
            "--heartbeat-interval",
            "0.2",
            *extra,
            stdout=subprocess.DEVNULL,
        )
        self.workers.append(proc)
        return proc

    def stats(self) -> dict[str, Any]:
        return stats(self.consumer_endpoint, self.key)

    def __exit__(self, *exc: object) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.producer is not None:
            self.output = stop(self.producer)


def consume(endpoint: str, rank: int, world_size: int, *extra: str) -> subprocess.Popen:
    return start(
        "consume",
        "--connect",
        endpoint,
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--quiet",
        "--timeout",
        "120",
        *extra,
    )


def result(proc: subprocess.Popen, timeout: float = 180.0) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}: {out}"
    return json.loads(out.strip().splitlines()[-1])


def expected(corpus: Path | str, rank: int, world_size: int, **settings: Any) -> dict[str, Any]:
    """What ``streampack digest`` computes in process, as a dict."""
    from streampack.client import StreamDigest
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    merged = {"corpus": str(corpus), **SMALL, **settings}
    digest = StreamDigest()
    batches = []
    for epoch, index, batch in rank_stream(ProducerSettings(**merged), rank, world_size):
        digest.update(batch, epoch, index)
        batches.append((epoch, index, batch.digest()))
    return {
        "digest": digest.hexdigest(),
        "batches": digest.batches,
        "fillers": digest.fillers,
        "tokens": digest.tokens,
        "list": batches,
    }


def rss_anon_bytes(pid: int) -> int:
    """Anonymous resident memory (excludes memory-mapped corpus pages)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for pid {pid}")


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (any of its threads)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


# A CURVE key pair whose public key begins with "-" (as about 1 in 80 generated ones
# does), which argparse would take for an option.
DASH_PUBLIC = "-z)z%!.TLg{UBXP=eSA#zOgud5^#7q[5jJ6DZF{+"
DASH_SECRET = "nlFllhaPVF!B/p7cH[lMRtBs^8VMd>.J.FXdZ>+!"


def drain(endpoint, rank, world_size, out, **kwargs):
    from streampack.client import BatchStream

    with BatchStream(endpoint, rank=rank, world_size=world_size, timeout=120, **kwargs) as s:
        out.extend((s.current, batch) for batch in s)


def drain_ranks(endpoint, world_size):
    """Every rank drained concurrently (threads, real sockets): {rank: [(cursor, batch)]}."""
    received = {rank: [] for rank in range(world_size)}
    threads = [
        threading.Thread(target=drain, args=(endpoint, rank, world_size, items))
        for rank, items in received.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return received


def stream_digest(items):
    from streampack.client import StreamDigest

    digest = StreamDigest()
    for (epoch, index), batch in items:
        digest.update(batch, epoch, index)
    return digest.hexdigest(), digest.batches


def next_message(router: Any, kinds: set[str] | tuple[str, ...], timeout_ms: int = 120_000) -> Any:
    """The next message of one of ``kinds`` a ROUTER standing in for the producer gets
    from its worker (others are skipped); fails the test when none comes in time."""
    from streampack import wire

    while True:
        assert router.poll(timeout_ms)
        _, *frames = router.recv_multipart()
        message = wire.decode(frames)
        if message.kind in kinds:
            return message
