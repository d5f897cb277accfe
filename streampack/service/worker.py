"""``streampack worker``: a pack worker.

A worker connects a DEALER socket to the producer's worker endpoint and loops::

    warm up (compile/load the packing kernels on a tiny window)
    send ready{credit: prefetch, needs_tokens: auditing}
    repeat:
        window{epoch, window, binding, config, with_tokens} + frames
            -> plan_ranges(ranges, PackConfig.from_wire(config))  (validated)
               or, with tokens, plan_compact(Examples, binding, config), then audits
            -> packed{epoch, window, capacity, seconds, audit...} + the plans of all
               its batches (occurrence records + records per batch), one message
            -> ready{credit: 1, needs_tokens}
        every heartbeat_interval seconds: heartbeat{free, needs_tokens}

The worker holds no settings of the stream: binding and packing configuration come
with each window, so any worker can pack any producer's windows. Only a worker that
audits asks for the windows' tokens: planning needs the documents' ranges alone (the
producer, which holds the tokens, checks every batch it assembles from a plan). A
window that fails to pack is answered with ``failed`` (the producer quarantines it) and
the worker keeps serving. A malformed message is counted and answered with ``error``.

A worker given ``serve_endpoint`` also serves consumers (the data plane, version 9):
it binds a ROUTER there, announces the endpoint (``serving``, before its first
``ready``), keeps the compact batches of every window it receives with tokens in a
bounded ``BatchStore`` (``store_bytes``, ``store_seconds``) and answers ``get`` with
``part`` (the batch's frames, dropped from the store) or ``missing``. A consumer checks
what it gets against the producer's route digest of the batch, so a worker serves what it
likes at no risk to the stream; without ``serve_endpoint`` nothing of this runs.

Warming up before announcing credit keeps the first window's compile time from
looking like a dead worker to the producer's heartbeat timeout; after that, a window
is bounded by ``window_tokens`` and packs in milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import time
from typing import Any

import zmq

from .. import wire
from ..config import PackConfig
from ..errors import StreampackError
from ..examples import Examples
from ..packing import compact_batches, plan_compact, warm_up_kernels
from ..settings import WorkerSettings, add_flags, from_args
from .plan_check import ranges_plan
from .store import BatchStore

# A consumer's ``get`` is a header of three ints: a serving socket accepts nothing larger.
GET_LIMIT = 1 << 12

logger = logging.getLogger(__name__)


def _warm_up(audit: Any = None) -> str:
    """Compile (or load from the Numba cache) every kernel a window will need.

    Returns "" or, when the audit itself cannot run, why (the worker then packs
    without auditing and reports every skipped audit as a failure).
    """
    # Only an audit expands batches here (a consumer checks and expands its own).
    examples, batch = warm_up_kernels(expand=audit is not None)
    if audit is not None:
        try:
            audit(batch.expand(), examples=examples)
        except Exception as exc:  # an audit bug must not stop packing
            return f"audit unavailable: {type(exc).__name__}: {exc}"
    return ""


class Worker:
    """One pack worker process's loop; ``run()`` returns when stopped."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.limits = wire.WireLimits(max_frame_bytes=settings.max_message_bytes)
        self.stopping = False
        self.counters = {
            "windows": 0,
            "batches": 0,
            "failed": 0,
            "rejected": 0,
            "refused": 0,
            "audited": 0,
            "audit_failures": 0,
        }
        self._audit_seen = 0
        self._audit_fn: Any = None
        self._audit_broken = ""
        self._next_beat = 0.0
        # Planning alone needs no tokens: auditing does, and so does serving the batches.
        self.needs_tokens = bool(settings.audit_every) or settings.serve_endpoint is not None
        self.store = BatchStore(settings.store_bytes, settings.store_seconds)
        self.serve_limits = wire.WireLimits(max_message_bytes=GET_LIMIT, max_header_bytes=GET_LIMIT)
        self.advertised = ""
        self.served = {"gets": 0, "parts": 0, "missing": 0, "rejected": 0}
        self.metrics: Any = None
        if settings.metrics_port is not None:
            from .metrics import WorkerMetrics

            self.metrics = WorkerMetrics(self.counters)
        if settings.audit_every:
            # Imported only by workers that audit: the decoder is not needed to pack.
            from ..auditing import audit

            self._audit_fn = audit

    def _send(
        self,
        socket: zmq.Socket,
        kind: str,
        fields: dict[str, Any],
        arrays: dict[str, Any] | None = None,
    ) -> None:
        socket.send_multipart(wire.encode(kind, fields, arrays), copy=False)

    def _audit(self, batch: Any, examples: Examples) -> tuple[int, int, str]:
        """Audit every N-th batch this worker packs; returns (audited, failures, note)."""
        self._audit_seen += 1
        if self._audit_seen % self.settings.audit_every:
            return 0, 0, ""
        if self._audit_broken:
            return 1, 1, self._audit_broken
        try:
            report = self._audit_fn(batch.expand(), examples=examples)
        except Exception as exc:  # counted as a failed audit; packing goes on
            return 1, 1, f"audit raised {type(exc).__name__}: {exc}"[:1000]
        if report.passed:
            return 1, 0, ""
        return 1, 1, "; ".join(report.notes)[:1000] or "audit failed"

    def handle_window(self, socket: zmq.Socket, message: wire.Message) -> None:
        fields = message.fields
        epoch, window = fields["epoch"], fields["window"]
        started = time.perf_counter()
        arrays = message.arrays
        try:
            binding = wire.binding_from_wire(fields["binding"])
            config = PackConfig.from_wire(fields["config"])
            if fields["with_tokens"]:
                examples = wire.window_examples(arrays)
                occurrences, sizes = plan_compact(examples, binding, config)
            else:
                examples = None
                occurrences, sizes = ranges_plan(arrays, config)
        except StreampackError as exc:
            self.counters["failed"] += 1
            logger.warning("window %d/%d failed to pack: %s", epoch, window, exc)
            self._send(socket, "failed", {"epoch": epoch, "window": window, "error": str(exc)})
            return
        audited = failures = 0
        notes = []
        serves = self.settings.serve_endpoint is not None and examples is not None
        batches = None
        if serves or (self.settings.audit_every and examples is not None):
            assert examples is not None
            batches = compact_batches(
                examples, occurrences, sizes, binding, config.capacity, config.policy
            )
        if serves:
            assert batches is not None
            now = time.monotonic()
            # Served in the producer's token dtype (uint16 when the vocabulary fits): the
            # frames the producer's digest covers, and half the bytes of int32.
            dtype = wire.token_dtype(binding.vocab_size)
            for index, batch in enumerate(batches):
                if batch.tokens.dtype != dtype:
                    batch = dataclasses.replace(batch, tokens=batch.tokens.astype(dtype))
                self.store.put((epoch, window, index), batch, now)
        if self.settings.audit_every and examples is None:
            # Asked for with needs_tokens, so only a faulty producer gets here.
            audited = failures = len(sizes)
            notes.append("the window came without its tokens; nothing could be audited")
        elif self.settings.audit_every and batches is not None:  # only audits need tokens
            assert examples is not None
            for index, batch in enumerate(batches):
                a, f, note = self._audit(batch, examples)
                audited += a
                failures += f
                if note:
                    notes.append(f"batch {index}: {note}")
                self._beat_if_due(socket)  # audits are slow: stay visibly alive
        self.counters["windows"] += 1
        self.counters["batches"] += len(sizes)
        self.counters["audited"] += audited
        self.counters["audit_failures"] += failures
        if self.metrics is not None:
            self.metrics.observe_pack(time.perf_counter() - started)
        self._send(
            socket,
            "packed",
            {
                "epoch": epoch,
                "window": window,
                "capacity": config.capacity,
                "seconds": time.perf_counter() - started,
                "audited": audited,
                "audit_failures": failures,
                "audit_error": "; ".join(notes)[:2000],
            },
            {"occurrences": occurrences, "batch_sizes": sizes},
        )

    def handle_get(self, serving: zmq.Socket) -> None:
        """Answer one consumer's ``get`` with the batch's frames (``part``) or ``missing``;
        a malformed message is answered ``error``. Never blocks: a consumer that does not
        read only fills its own queue, which ZeroMQ drops past its high-water mark."""
        identity, *frames = serving.recv_multipart(copy=False)
        try:
            message = wire.decode(frames, self.serve_limits)
            if message.kind != "get":
                raise wire.ProtocolError(f"a serving worker accepts 'get', not {message.kind!r}")
        except wire.ProtocolError as exc:
            self.served["rejected"] += 1
            self._send_to(serving, identity, wire.encode("error", {"message": str(exc)[:1000]}))
            return
        self.served["gets"] += 1
        key = message.fields
        batch = self.store.take((key["epoch"], key["window"], key["batch"]), time.monotonic())
        if batch is None:
            self.served["missing"] += 1
            self._send_to(serving, identity, wire.encode("missing", key))
            return
        self.served["parts"] += 1
        self._send_to(serving, identity, wire.encode("part", key, wire.batch_arrays(batch)))

    def _send_to(self, serving: zmq.Socket, identity: Any, frames: list[Any]) -> None:
        try:
            serving.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the consumer does not read: its answer is dropped
            self.served["rejected"] += 1

    def _beat_if_due(self, socket: zmq.Socket) -> None:
        if time.monotonic() >= self._next_beat:
            if self.advertised:  # a restarted producer learns the endpoint again too
                self._send(socket, "serving", {"endpoint": self.advertised})
            self._send(
                socket,
                "heartbeat",
                {"free": self.settings.prefetch, "needs_tokens": self.needs_tokens},
            )
            self._next_beat = time.monotonic() + self.settings.heartbeat_interval

    def _bind_serving(self, context: zmq.Context) -> zmq.Socket | None:
        """The ROUTER consumers fetch batches from, bound to ``serve_endpoint`` (None when
        the worker does not serve); sets ``advertised``, the endpoint it announces."""
        if self.settings.serve_endpoint is None:
            return None
        serving = context.socket(zmq.ROUTER)
        wire.configure_socket(serving, GET_LIMIT)
        serving.setsockopt(zmq.SNDHWM, 64)  # a consumer that never reads holds few answers
        wire.attach(serving, self.settings.serve_endpoint, field="serve_endpoint", bind=True)
        bound = serving.getsockopt_string(zmq.LAST_ENDPOINT)
        self.advertised = self.settings.serve_advertise or bound
        logger.info("serving batches to consumers at %s", self.advertised)
        return serving

    def run(self) -> int:
        loading = time.perf_counter()
        self._audit_broken = _warm_up(self._audit_fn)
        logger.debug(
            "worker %d: kernels loaded in %.3f s", os.getpid(), time.perf_counter() - loading
        )
        if self._audit_broken:
            logger.error("%s; packing continues, audits count as failed", self._audit_broken)
        metrics_server = None
        if self.metrics is not None and self.settings.metrics_port is not None:
            from .metrics import MetricsServer

            metrics_server = MetricsServer(
                self.metrics.registry, self.settings.metrics_port, self.settings.metrics_address
            )
        context = zmq.Context()
        serving = self._bind_serving(context)
        socket = context.socket(zmq.DEALER)
        wire.configure_socket(socket, self.settings.max_message_bytes)
        if self.settings.curve_server_key:
            wire.curve_client(socket, self.settings.curve_server_key)
        wire.attach(socket, self.settings.connect, field="connect", bind=False)
        if serving is not None:
            self._send(socket, "serving", {"endpoint": self.advertised})
        self._send(
            socket, "ready", {"credit": self.settings.prefetch, "needs_tokens": self.needs_tokens}
        )
        self._next_beat = time.monotonic() + self.settings.heartbeat_interval
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        if serving is not None:
            poller.register(serving, zmq.POLLIN)
        try:
            while not self.stopping:
                timeout = max(0.0, self._next_beat - time.monotonic())
                events = dict(poller.poll(int(timeout * 1000) + 1))
                if serving is not None and serving in events:
                    for _ in range(64):  # a burst of gets, without starving the producer
                        self.handle_get(serving)
                        if not serving.poll(0, zmq.POLLIN):
                            break
                    self.store.expire(time.monotonic())
                if socket in events:
                    frames = socket.recv_multipart(copy=False)
                    try:
                        message = wire.decode(frames, self.limits)
                        if message.kind == "error":
                            # The producer refused something this worker sent. Answering
                            # an error with an error would never end: log it, go on.
                            self.counters["refused"] += 1
                            logger.warning(
                                "the producer refused a message: %r",
                                message.fields["message"][:500],
                            )
                            continue
                        if message.kind != "window":
                            raise wire.ProtocolError(
                                f"a worker accepts 'window' messages, not {message.kind!r}"
                            )
                        wire.check_window_frames(message.arrays)  # malformed otherwise
                    except wire.ProtocolError as exc:
                        self.counters["rejected"] += 1
                        logger.warning("rejected a message: %s", exc)
                        self._send(socket, "error", {"message": str(exc)[:1000]})
                        continue
                    self.handle_window(socket, message)
                    self._send(socket, "ready", {"credit": 1, "needs_tokens": self.needs_tokens})
                self._beat_if_due(socket)
        finally:
            socket.close(linger=0)
            if serving is not None:
                serving.close(linger=0)
            context.term()
            if metrics_server is not None:
                metrics_server.close()
        return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file; its [worker] table is read")
    add_flags(parser, WorkerSettings)


def main(args: argparse.Namespace) -> int:
    settings = from_args(WorkerSettings, args)
    worker = Worker(settings)

    def stop(signum: int, frame: Any) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info("worker %d connecting to %s", os.getpid(), settings.connect)
    return worker.run()
