"""``streampack serve``: the producer plus N local pack workers under one supervisor.

The producer runs in this process; each worker is a child process
(``python -m streampack.cli worker --connect ...``). A supervisor thread restarts a
worker that exits (the producer reissues the windows it held, so nothing is lost), and
on SIGTERM/SIGINT the producer stops, every worker gets SIGTERM (SIGKILL after
``--grace`` seconds) and is reaped before ``serve`` exits. On Linux the workers also
ask the kernel to SIGTERM them if ``serve`` itself dies, so no worker outlives it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from ..errors import InvalidConfig, StreampackError
from ..logs import logging_args
from ..settings import (
    ProducerSettings,
    WorkerSettings,
    add_flags,
    check_number,
    from_args,
    read_curve_secret,
)
from .producer import Producer, install_stop_handlers

_PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def local_endpoint(endpoint: str) -> str:
    """Where a local worker connects when the producer binds ``endpoint``."""
    return endpoint.replace("//0.0.0.0:", "//127.0.0.1:").replace("//*:", "//127.0.0.1:")


class Supervisor:
    """Starts, restarts and finally stops the worker processes.

    A worker that exits is started again, after a pause that doubles with each exit in
    a row that came within ``healthy_after`` seconds of its start (from ``backoff[0]``
    up to ``backoff[1]`` seconds): a worker that cannot start (a bad setting, a missing
    library) is not restarted in a tight loop. After ``max_failures`` such exits in a
    row the supervisor gives up: ``failure`` says why, every worker is stopped and
    ``on_give_up`` is called (``serve`` stops the producer and exits non-zero).
    """

    def __init__(
        self,
        count: int,
        command: Callable[[int], list[str]],
        *,
        grace: float = 5.0,
        max_failures: int = 5,
        backoff: tuple[float, float] = (0.2, 10.0),
        healthy_after: float = 10.0,
        on_give_up: Callable[[], None] | None = None,
    ) -> None:
        self.count = count
        self.command = command
        self.grace = grace
        self.max_failures = max_failures
        self.backoff = backoff
        self.healthy_after = healthy_after
        self.on_give_up = on_give_up
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.started_at = [0.0] * count
        self.failures = [0] * count  # exits in a row soon after starting, per slot
        self.restart_at: list[float | None] = [None] * count
        self.restarts = 0
        self.failure = ""  # why the supervisor gave up, when it did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    def _spawn(self, slot: int) -> None:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        proc = subprocess.Popen(self.command(slot), preexec_fn=preexec)
        self.procs[slot] = proc
        self.started_at[slot] = time.monotonic()
        self.restart_at[slot] = None
        logger.info("worker %d started as pid %d", slot, proc.pid)

    def _on_exit(self, slot: int, proc: subprocess.Popen[bytes]) -> None:
        """Schedule the restart of the worker in ``slot``, or give up."""
        now = time.monotonic()
        early = now - self.started_at[slot] < self.healthy_after
        self.failures[slot] = self.failures[slot] + 1 if early else 0
        if self.failures[slot] >= self.max_failures:
            self.failure = (
                f"worker {slot} exited {self.failures[slot]} times in a row within "
                f"{self.healthy_after:g}s of starting (last exit status {proc.returncode}); "
                f"giving up: see the worker's error above"
            )
            return
        delay = min(self.backoff[1], self.backoff[0] * 2 ** max(0, self.failures[slot] - 1))
        self.restart_at[slot] = now + delay
        self.restarts += 1
        logger.warning(
            "worker %d (pid %d) exited with %s; restarting in %.1fs",
            slot,
            proc.pid,
            proc.returncode,
            delay,
        )

    def _loop(self) -> None:
        for slot in range(self.count):
            self._spawn(slot)
        while not self.failure and not self._stop.wait(0.05):
            for slot, proc in enumerate(self.procs):
                if proc is None or self.failure:
                    continue
                if self.restart_at[slot] is None and proc.poll() is not None:
                    self._on_exit(slot, proc)
                restart_at = self.restart_at[slot]
                if restart_at is not None and time.monotonic() >= restart_at:
                    self._spawn(slot)
        self._terminate()
        if self.failure and self.on_give_up is not None:
            self.on_give_up()

    def _terminate(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file ([producer] and [worker] tables)")
    parser.add_argument("--workers", type=int, default=2, help="local pack workers (default: 2)")
    parser.add_argument(
        "--audit-every",
        type=int,
        default=None,
        help="workers audit every N-th batch (default: [worker] audit_every, 0)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds workers get to exit on shutdown (default: 5)",
    )
    parser.add_argument(
        "--local-ipc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="connect the local workers over an ipc:// socket in a private "
        "temporary directory instead of the worker endpoint (default: on)",
    )
    add_flags(parser, ProducerSettings)


def main(args: argparse.Namespace) -> int:
    settings = from_args(ProducerSettings, args)
    check_number("--workers", args.workers, minimum=1, integer=True)
    check_number("--grace", args.grace, minimum=0)
    if settings.metrics_port and settings.metrics_port + args.workers > 65535:
        raise InvalidConfig(
            f"metrics_port {settings.metrics_port}: local workers serve "
            f"theirs on the next {args.workers} ports, which must be <= 65535"
        )
    # The workers' own settings are checked here, once, not by workers that would fail
    # to start over and over.
    worker_settings = from_args(
        WorkerSettings, argparse.Namespace(config=args.config, audit_every=args.audit_every)
    )
    # Workers log like serve does (format and level).
    worker_args: list[str] = logging_args(args) if hasattr(args, "log_format") else []
    if settings.curve_secret_key_file:
        import zmq

        public = zmq.curve_public(read_curve_secret(settings.curve_secret_key_file)).decode()
        worker_args += ["--curve-server-key", public]
    if args.config:
        worker_args += ["--config", os.path.abspath(args.config)]
    if args.audit_every is not None:
        worker_args += ["--audit-every", str(args.audit_every)]
    if settings.data_plane == "workers" and worker_settings.serve_endpoint is None:
        # Local workers serve their batches on loopback, each on a port of its own.
        worker_args += ["--serve-endpoint", "tcp://127.0.0.1:*"]
    producer = Producer(settings)
    holder: dict[str, Supervisor] = {}

    def metrics_args(slot: int) -> list[str]:
        """Local worker ``slot`` serves its metrics on the producer's port + 1 + slot."""
        port = settings.metrics_port
        if port is None:
            return []
        return [
            "--metrics-port",
            str(port + 1 + slot if port else 0),
            "--metrics-address",
            settings.metrics_address,
        ]

    # Local workers reach the producer over a Unix-domain socket: the same messages,
    # without the TCP stack (the worker link carries every batch once).
    scratch = tempfile.TemporaryDirectory(prefix="streampack-serve-")
    local = f"ipc://{scratch.name}/workers.sock" if args.local_ipc else None

    def started(worker_endpoint: str, consumer_endpoint: str) -> None:
        def command(slot: int) -> list[str]:
            flags = [
                "--connect",
                local or local_endpoint(worker_endpoint),
                *worker_args,
                *metrics_args(slot),
            ]
            # Each flag goes as --flag=value, so that a value beginning with "-" (a Z85
            # key may) is not taken for an option.
            return [sys.executable, "-m", "streampack.cli", "worker"] + [
                f"{flag}={value}" for flag, value in zip(flags[::2], flags[1::2])
            ]

        supervisor = Supervisor(args.workers, command, grace=args.grace, on_give_up=producer.stop)
        holder["supervisor"] = supervisor
        supervisor.start()

    install_stop_handlers(producer.stop)
    try:
        code = producer.run(ready_callback=started, local_worker_endpoint=local)
    finally:
        if "supervisor" in holder:
            holder["supervisor"].stop()
        scratch.cleanup()
    if "supervisor" in holder and holder["supervisor"].failure:
        raise StreampackError(holder["supervisor"].failure)
    stats = producer.snapshot()
    stats["worker_restarts"] = holder["supervisor"].restarts if "supervisor" in holder else 0
    print(json.dumps({"producer": stats}), flush=True)
    return code
