"""``streampack produce``: cut the corpus into windows, collect packed batches, serve ranks.

One thread, one ``zmq.Poller`` over two ROUTER sockets::

    worker endpoint  (ROUTER) <- ready / heartbeat / packed / failed
                              -> window / error
    consumer endpoint (ROUTER) <- fetch{rank, world_size, epoch, index, count} / health
                               -> batch / epoch_end / stream_end / status / error

This module is only the socket loop. The decisions live in plain-Python parts that
unit tests drive without sockets:

    coordinator.py  messages in, messages out; every trust rule about a message
    registry.py     pack workers: credit, heartbeats, windows held, deadlines
    plan_check.py   a worker's plan must be exactly the contract's plan of its window
    pipeline.py     cut windows, windows in flight, number batches in window order, rewind
    delivery.py     ready batches, pending fetches, consumers, the epoch tail, budgets
    counters.py     every counter, in one object

Properties and where they hold:

- *Order and determinism* (pipeline). Windows depend on the corpus and settings only;
  each is packed alone; batches are numbered in window order. Which worker packed
  what, and when, cannot show in the output.
- *The contract, not the worker* (plan_check). The producer computes each window's
  plan with ``plan_ranges`` and accepts only that exact plan; batches are built from
  its own plan and its own copy of the tokens.
- *Exactly once* (pipeline, registry). A result counts only from the worker holding
  the window; a late one (after a rewind or a deadline) is dropped as stale, one
  about a window the peer never held is rejected.
- *Worker failure* (registry, coordinator). A worker silent for ``heartbeat_timeout``
  loses its windows; a window not answered within ``window_timeout`` goes elsewhere
  and its worker is dropped. Long before that, a window overdue against the windows
  observed gets a backup copy on another worker (pipeline, ``backup_after``): the
  first answer that passes the plan check wins, so a hung or slow worker costs the
  stream about a second. A window whose packing killed ``MAX_LOSSES`` proven
  workers is quarantined whole (see registry: peers that merely connect and leave
  cannot reach that rule). A window the contract cannot pack is quarantined at once.
- *Resume and any world size* (delivery). A consumer's cursor (epoch, next index) is
  all it needs; ``world_size`` comes with each fetch. A fetch for a batch already
  sent rewinds the pipeline to the window holding it; the rewind frees every ready
  batch past that point, and the replay numbers the same batches again.
- *Epoch tail* (delivery.rank_share, shared with ``digest``). With total T each of W
  ranks gets ``ceil(T / W)`` (filler batches) or ``floor(T / W)`` (``tail = "drop"``).
- *Bounded memory* (pipeline, delivery, registry). A new window is cut only while the
  windows in flight hold at most ``window_budget_bytes`` and the batches received and
  not yet sent at most ``reorder_budget_bytes``; when a consumer waits for a batch not
  cut yet, ready batches nobody can still ask for, then the farthest ahead, make room.
  Every table keyed by a peer is bounded and expires. A message the producer receives
  is a plan or a request: the receive limit is derived from ``window_documents``.
- *Bad messages* (coordinator). Anything ``wire.decode`` rejects, a message of the
  wrong kind, a number out of range or a claim about a window the peer does not hold
  is counted (``rejected_*``) and answered with ``error``; an ``error`` is never
  answered. The loop never dies of a message.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import time
from typing import IO, Any

import zmq

from .. import wire
from ..corpus import open_corpus
from ..errors import InvalidConfig
from ..packing import warm_up_kernels
from ..settings import (
    ProducerSettings,
    add_flags,
    check_output_path,
    from_args,
    read_curve_secret,
)
from .coordinator import Coordinator

logger = logging.getLogger(__name__)

#: Messages handled per socket before the loop turns to the other one.
BATCH_OF_MESSAGES = 256


class Producer:
    """The producer process: two ROUTER sockets around a ``Coordinator``."""

    def __init__(self, settings: ProducerSettings, *, log: Any = None) -> None:
        if settings.corpus is None:
            raise InvalidConfig(
                "corpus is not set; pass --corpus PATH or set corpus in the [producer] table"
            )
        self.settings = settings
        self.log = log or logger.info
        self.curve_secret = (
            read_curve_secret(settings.curve_secret_key_file)
            if settings.curve_secret_key_file
            else None
        )
        if settings.quarantine_path:
            check_output_path("quarantine_path", settings.quarantine_path)
        source = open_corpus(
            settings.corpus,
            allow_outside=settings.corpus_allow_outside,
            storage=settings.storage(),
        )
        self._quarantine_file: IO[str] | None = (
            open(settings.quarantine_path, "a") if settings.quarantine_path else None
        )
        self._sockets: dict[str, zmq.Socket] = {}
        self.coordinator = Coordinator(
            settings,
            source,
            send_worker=lambda *message: self._send("workers", *message),
            send_consumer=lambda *message: self._send("consumers", *message),
            quarantine_file=self._quarantine_file,
            log=log,
        )  # None: logged with levels
        self.stopping = False
        self.serving = False

    def _send(
        self,
        which: str,
        identity: bytes,
        kind: str,
        fields: dict[str, Any],
        arrays: dict[str, Any] | None,
    ) -> bool:
        """Send without blocking; False when the peer is gone or not reading (the
        sockets are ROUTER_MANDATORY, so an unknown identity is an error, not a drop)."""
        socket = self._sockets.get(which)
        if socket is None:
            return False
        frames = wire.encode(kind, fields, arrays)
        try:
            socket.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return False
            raise
        self.coordinator.counters.add(f"bytes_sent_to_{which}", sum(len(f) for f in frames))
        return True

    def snapshot(self) -> dict[str, Any]:
        return self.coordinator.stats()

    def stop(self) -> None:
        self.stopping = True

    def _bind(self, context: zmq.Context, field: str, endpoint: str, max_bytes: int) -> zmq.Socket:
        socket = context.socket(zmq.ROUTER)
        wire.configure_socket(socket, max_bytes)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.curve_secret is not None:
            wire.curve_server(socket, self.curve_secret)
        wire.attach(socket, endpoint, field=field, bind=True)
        return socket

    def run(self, *, ready_callback: Any = None, local_worker_endpoint: str | None = None) -> int:
        """Serve until ``stop()``. ``local_worker_endpoint`` (e.g. an ``ipc://`` path) is
        bound for workers in addition to the configured one: ``serve`` connects its own
        workers there, off the TCP stack."""
        metrics_server = None
        if self.settings.metrics_port is not None:
            from .metrics import MetricsServer, ProducerMetrics

            metrics = ProducerMetrics(
                self.snapshot,
                window_budget_bytes=self.settings.window_budget_bytes,
                reorder_budget_bytes=self.settings.reorder_budget_bytes,
            )
            self.coordinator.metrics = metrics
            metrics_server = MetricsServer(
                metrics.registry, self.settings.metrics_port, self.settings.metrics_address
            )
        context = zmq.Context()
        # Frames up to max_message_bytes reach the coordinator, which refuses any message
        # larger than the plans of a window it handed out (see receive_limit).
        worker_limit = self.settings.max_message_bytes
        # Consumers send fetch and health requests only: a header, nothing more.
        consumer_limit = wire.DEFAULT_LIMITS.max_header_bytes
        try:
            workers = self._bind(
                context, "worker_endpoint", self.settings.worker_endpoint, worker_limit
            )
            self._sockets["workers"] = workers
            consumers = self._bind(
                context, "consumer_endpoint", self.settings.consumer_endpoint, consumer_limit
            )
            self._sockets["consumers"] = consumers
            if local_worker_endpoint is not None:
                wire.attach(
                    workers, local_worker_endpoint, field="local worker endpoint", bind=True
                )
            self.serving = True
            worker_at = workers.getsockopt_string(zmq.LAST_ENDPOINT)
            consumer_at = consumers.getsockopt_string(zmq.LAST_ENDPOINT)
            self.log(f"producer: serving workers on {worker_at} and consumers on {consumer_at}")
            if ready_callback is not None:
                ready_callback(worker_at, consumer_at)
            # The contract's plans need the planning kernels. Loaded once the endpoints
            # are bound (a port in use fails at once) and after ``serve`` started its
            # workers, which load theirs meanwhile: the first batch comes that much sooner.
            loading = time.perf_counter()
            warm_up_kernels(expand=False)  # it plans and gathers, never expands
            logger.debug("producer: kernels loaded in %.3f s", time.perf_counter() - loading)
            self._loop(workers, consumers)
        finally:
            self.serving = False
            for socket in self._sockets.values():
                socket.close(linger=0)
            self._sockets.clear()
            context.term()
            if self._quarantine_file is not None:
                self._quarantine_file.close()
            if metrics_server is not None:
                metrics_server.close()
        return 0

    def _loop(self, workers: zmq.Socket, consumers: zmq.Socket) -> None:
        coordinator = self.coordinator
        poller = zmq.Poller()
        poller.register(workers, zmq.POLLIN)
        poller.register(consumers, zmq.POLLIN)
        tick_every = min(
            0.25, self.settings.heartbeat_timeout / 4, self.settings.window_timeout / 4
        )
        next_tick = time.monotonic()
        while not self.stopping:
            events = dict(poller.poll(100))
            for socket, handle in (
                (workers, coordinator.on_worker),
                (consumers, coordinator.on_consumer),
            ):
                for _ in range(BATCH_OF_MESSAGES if socket in events else 0):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    handle(bytes(frames[0].bytes), frames[1:], time.monotonic())
            now = time.monotonic()
            if now >= next_tick:
                coordinator.tick(now)
                next_tick = now + tick_every
            coordinator.pump(now)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file; its [producer] table is read")
    add_flags(parser, ProducerSettings)


def install_stop_handlers(stop: Any) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(args: argparse.Namespace) -> int:
    producer = Producer(from_args(ProducerSettings, args))
    install_stop_handlers(producer.stop)
    code = producer.run()
    print(json.dumps({"producer": producer.snapshot()}), flush=True)
    return code
