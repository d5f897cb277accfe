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
from typing import Any

from streampack.service.producer import Producer, install_stop_handlers

from streampack.errors import InvalidConfig
from streampack.logs import logging_args
from streampack.settings import ProducerSettings, add_flags, from_args

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
    """Starts, restarts and finally stops the worker processes."""

    def __init__(self, count: int, endpoint: str, worker_args: list[str], *,
                 grace: float = 5.0, slot_args: Any = None) -> None:
        self.count = count
        self.endpoint = endpoint
        self.worker_args = worker_args
        self.slot_args = slot_args or (lambda slot: [])  # arguments of one slot's worker
        self.grace = grace
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    def _spawn(self, slot: int) -> None:
        command = [sys.executable, "-m", "streampack.cli", "worker",
                   "--connect", self.endpoint, *self.worker_args, *self.slot_args(slot)]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.procs[slot] = subprocess.Popen(command, preexec_fn=preexec)
        logger.info("worker %d started as pid %d", slot, self.procs[slot].pid)

    def _loop(self) -> None:
        for slot in range(self.count):
            self._spawn(slot)
        while not self._stop.wait(0.2):
            for slot, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    self.restarts += 1
                    logger.warning("worker %d (pid %d) exited with %s; restarting", slot,
                                   proc.pid, proc.returncode)
                    self._spawn(slot)
        self._terminate()

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
    parser.add_argument("--audit-every", type=int, default=None,
                        help="workers audit every N-th batch (default: [worker] audit_every, 0)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds workers get to exit on shutdown (default: 5)")
    parser.add_argument("--local-ipc", action=argparse.BooleanOptionalAction, default=True,
                        help="connect the local workers over an ipc:// socket in a private "
                        "temporary directory instead of the worker endpoint (default: on)")
    add_flags(parser, ProducerSettings)


def main(args: argparse.Namespace) -> int:
    try:
        settings = from_args(ProducerSettings, args)
    except InvalidConfig as exc:
        raise SystemExit(f"streampack serve: {exc}") from None
    if args.workers < 1:
        raise SystemExit(f"streampack serve: --workers {args.workers}; at least 1 is needed")
    if settings.metrics_port and settings.metrics_port + args.workers > 65535:
        raise SystemExit(f"streampack serve: metrics_port {settings.metrics_port}: local "
                         f"workers serve theirs on the next {args.workers} ports, which must "
                         f"be <= 65535")
    # Workers log like serve does (format and level).
    worker_args: list[str] = logging_args(args) if hasattr(args, "log_format") else []
    if settings.curve_secret_key_file:
        import zmq

        from streampack.settings import read_curve_secret

        public = zmq.curve_public(read_curve_secret(settings.curve_secret_key_file)).decode()
        worker_args += ["--curve-server-key", public]
    if args.config:
        worker_args += ["--config", os.path.abspath(args.config)]
    if args.audit_every is not None:
        worker_args += ["--audit-every", str(args.audit_every)]
    try:
        producer = Producer(settings)
    except InvalidConfig as exc:
        raise SystemExit(f"streampack serve: {exc}") from None
    holder: dict[str, Supervisor] = {}

    def metrics_args(slot: int) -> list[str]:
        """Local worker ``slot`` serves its metrics on the producer's port + 1 + slot."""
        port = settings.metrics_port
        if port is None:
            return []
        return ["--metrics-port", str(port + 1 + slot if port else 0),
                "--metrics-address", settings.metrics_address]

    # Local workers reach the producer over a Unix-domain socket: the same messages,
    # without the TCP stack (the worker link carries every batch once).
    scratch = tempfile.TemporaryDirectory(prefix="streampack-serve-")
    local = f"ipc://{scratch.name}/workers.sock" if args.local_ipc else None

    def started(worker_endpoint: str, consumer_endpoint: str) -> None:
        supervisor = Supervisor(args.workers, local or local_endpoint(worker_endpoint),
                                worker_args, grace=args.grace, slot_args=metrics_args)
        holder["supervisor"] = supervisor
        supervisor.start()

    install_stop_handlers(producer.stop)
    try:
        code = producer.run(ready_callback=started, local_worker_endpoint=local)
    finally:
        if "supervisor" in holder:
            holder["supervisor"].stop()
        scratch.cleanup()
    stats = producer.snapshot()
    stats["worker_restarts"] = holder["supervisor"].restarts if "supervisor" in holder else 0
    print(json.dumps({"producer": stats}), flush=True)
    return code
