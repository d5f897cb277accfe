"""The producer's decisions, without sockets: messages in, messages out.

``Coordinator`` ties the parts together and is the only place that trusts nothing::

    worker frames ──▶ on_worker ──▶ WorkerRegistry (who holds what, credit, deadlines)
                                    plan_check     (exactly the contract's plan)
                                    Pipeline       (cut, in flight, assemble in order)
    consumer frames ─▶ on_consumer ─▶ Delivery     (ready, pending, tail, rewind)
    tick(now)       ──▶ heartbeats, window deadlines, consumer expiry, overdue windows
    pump(now)       ──▶ hand windows to workers with credit: reissues, backups, cuts

It sends through two callables (``send_worker``, ``send_consumer``) that return
False when a peer cannot be reached; ``producer.py`` binds them to ZeroMQ
sockets, unit tests to lists. Every rule of the trust model (docs/service.md, "Trust
model") that concerns a message is enforced here:

- a message is decoded within limits, or rejected, counted and answered ``error``;
  an ``error`` message is never answered (two peers can never ping-pong errors);
- a worker may speak only about windows it holds: ``packed``/``failed`` for any other
  window is rejected and counted (or, for a window taken back from it, dropped as
  stale; for one whose backup copy was answered first, dropped as a duplicate);
  every number it reports is range-checked before it touches a counter;
- a plan is accepted only when it is exactly the contract's plan of the window;
  anything else is refused and counted, and the window goes to another worker;
- a credit offer above ``MAX_CREDIT`` is clamped (counted), never answered with an
  error; an unproven worker holds one window at a time;
- every window handed out has a deadline (``window_timeout``); a worker that misses
  one is dropped and its windows go elsewhere; before that, a window overdue against
  the windows observed gets a backup copy on another worker (``backup_after``), and
  the first answer that passes the plan check is the window's, whoever sends it;
- peer text (error strings, audit notes) reaches the log only through ``repr``, so it
  cannot forge a log line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import IO, Any

from .. import wire
from ..batch import OCCURRENCE_DTYPE, CompactBatch
from ..corpus.storage import storage_stats
from ..errors import ProtocolError
from ..settings import ProducerSettings
from ..windows import CutSpec
from .counters import ProducerCounters, check_reported
from .delivery import Delivery, Send
from .pipeline import Assembled, EpochTotal, Pipeline, WindowState
from .plan_check import check_plan
from .registry import MAX_CREDIT, WindowKey, WorkerRecord, WorkerRegistry
from .routes import Routes

logger = logging.getLogger(__name__)

#: Largest credit a ``ready``/``heartbeat`` may state before it is refused as garbage
#: (values up to it are clamped to ``MAX_CREDIT``).
MAX_STATED_CREDIT = 1 << 31
#: Longest a worker may claim to have spent on one window (seconds).
MAX_PACK_SECONDS = 1e6


@dataclasses.dataclass(frozen=True)
class Answer:
    """A ``packed``/``failed`` answer from a worker holding its window."""

    key: WindowKey
    state: WindowState
    worker: WorkerRecord
    blamed: bool  # a loss of the window here counts toward MAX_LOSSES (see registry)


def receive_limit(settings: ProducerSettings, plan_bytes: int = 0) -> int:
    """The largest message a producer can legitimately receive: a window's plans (one
    occurrence record and at most one batch size per document; ``plan_bytes`` for the
    largest window handed out, which a split long document can make larger) plus a
    header, never more than ``max_message_bytes``."""
    per_document = OCCURRENCE_DTYPE.itemsize + 8
    plans = max(settings.window_documents * per_document, plan_bytes)
    return min(settings.max_message_bytes, wire.DEFAULT_LIMITS.max_header_bytes + plans)


class Coordinator:
    """The producer's state machine (see module docstring). Plain Python."""

    def __init__(
        self,
        settings: ProducerSettings,
        source: Any,
        *,
        send_worker: Send,
        send_consumer: Send,
        quarantine_file: IO[str] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.counters = ProducerCounters()
        self.log = log or logger.info
        # What a peer did wrong, or lost work: a warning (the same callable when injected).
        self.warn = log or logger.warning
        self.send_worker = send_worker
        self.send_consumer = send_consumer
        self.quarantine_file = quarantine_file
        self.binding = source.binding.to_binding()
        self.binding_wire = wire.binding_to_wire(self.binding)
        self.config = settings.pack_config()  # what workers get with each window
        self.config_wire = self.config.to_wire()
        limit = receive_limit(settings)
        self.limits = wire.WireLimits(max_frame_bytes=limit, max_message_bytes=limit)
        self.registry = WorkerRegistry(
            heartbeat_timeout=settings.heartbeat_timeout, window_timeout=settings.window_timeout
        )
        self.pipeline = Pipeline(
            source,
            CutSpec.from_settings(settings),
            self.config,
            self.binding,
            epochs=settings.epochs,
            window_budget_bytes=settings.window_budget_bytes,
            quarantine=self._quarantine,
            counters=self.counters,
            backup_after=settings.backup_after if settings.backups else None,
            window_timeout=settings.window_timeout,
        )
        self.routes = Routes()  # data_plane = "workers": who serves which window
        workers_serve = settings.data_plane == "workers"
        self.delivery = Delivery(
            tail=settings.tail,
            reorder_budget_bytes=settings.reorder_budget_bytes,
            consumer_timeout=settings.consumer_timeout,
            send=send_consumer,
            counters=self.counters,
            binding_wire=self.binding_wire,
            filler=CompactBatch.filler_like(
                self.binding, settings.max_rows_per_batch, settings.capacity, settings.policy
            ),
            epoch_live=self.pipeline.epoch_live,
            total=self.pipeline.totals.get,
            numbered=self.pipeline.numbered,
            accumulation=settings.accumulation,
            route=self.routes.endpoint if workers_serve else None,
        )
        self.started = False  # nothing is cut before the first fetch says where to start
        self.metrics: Any = None  # service.metrics.ProducerMetrics, while metrics are served
        self._clamp_logged: set[bytes] = set()
        self._budget_warned = False  # the reorder budget cannot hold a drop tail's group
        self._backup_threshold = self.pipeline.backup_threshold()
        self._worker_handlers: dict[str, Callable[[bytes, wire.Message, float], None]] = {
            "error": self._on_worker_error,
            "ready": self._on_credit,
            "heartbeat": self._on_credit,
            "packed": self._on_packed,
            "failed": self._on_failed,
            "serving": self._on_serving,
        }

    # -- workers -------------------------------------------------------------------

    def on_worker(self, identity: bytes, frames: Sequence[Any], now: float) -> None:
        """One message from the worker endpoint: decoded, then handled by the method its
        kind names in ``_worker_handlers``."""
        self.delivery.now = now
        if self.registry.is_dropped(identity, now):
            self.counters.add("rejected_worker")  # it missed a deadline: ignored a while
            return
        try:
            message = wire.decode(frames, self.limits)
            handler = self._worker_handlers.get(message.kind)
            if handler is None:
                raise ProtocolError(f"{message.kind!r} is not a worker message")
            handler(identity, message, now)
        except ProtocolError as exc:
            self.counters.add("rejected_worker")
            self.warn(f"producer: rejected a message from worker {identity.hex()}: {exc}")
            self.send_worker(identity, "error", {"message": str(exc)[:1000]}, None)

    def _on_worker_error(self, identity: bytes, message: wire.Message, now: float) -> None:
        """Our message was refused; answering would start a ping-pong."""
        self.counters.add("peer_errors")
        self.warn(
            f"producer: worker {identity.hex()} refused a message: "
            f"{message.fields['message'][:500]!r}"
        )

    def _on_credit(self, identity: bytes, message: wire.Message, now: float) -> None:
        """``ready`` (credit offered) or ``heartbeat`` (alive; re-registers after a
        producer restart with the credit it states as free)."""
        ready = message.kind == "ready"
        fields = message.fields
        stated = fields["credit"] if ready else fields["free"]
        check_reported("credit" if ready else "free", stated, MAX_STATED_CREDIT)
        if ready and stated == 0:
            raise ProtocolError("credit 0: a ready message offers at least 1 window")
        known = self.registry.get(identity) is not None
        worker = self.registry.register(identity, now)
        if worker is None:
            raise ProtocolError(
                f"this producer already serves {len(self.registry)} workers; try again later"
            )
        if not known:
            self.counters.add("workers_joined")
        worker.needs_tokens = fields["needs_tokens"]
        if (ready or not known) and not self.registry.offer(worker, stated):
            self.counters.add("credit_clamped")
            if identity not in self._clamp_logged and len(self._clamp_logged) < 1024:
                self._clamp_logged.add(identity)
                self.warn(
                    f"producer: worker {identity.hex()} offered credit {stated}; "
                    f"a worker holds at most {MAX_CREDIT} windows (clamped)"
                )

    def _on_serving(self, identity: bytes, message: wire.Message, now: float) -> None:
        """The worker serves the batches of the windows it packs with tokens (routes)."""
        self.routes.announce(identity, message.fields["endpoint"])

    def _answered(self, identity: bytes, message: wire.Message, now: float) -> Answer | None:
        """The window a ``packed``/``failed`` answer is about, which ``identity`` holds;
        None when the answer is to be dropped (stale: the window was taken back from
        it; a duplicate: another copy was answered first). Raises ``ProtocolError``
        when ``identity`` does not hold that window."""
        worker = self.registry.get(identity)
        if worker is not None:
            worker.last_seen = now
        key = (message.fields["epoch"], message.fields["window"])
        held = self.registry.answer(identity, key)
        if held == "stale":
            self.counters.add("stale_dropped")
            return None
        if held == "duplicate":
            self.counters.add("duplicates_dropped")
            return None
        state = self.pipeline.inflight.get(key)
        if held == "foreign" or state is None or identity not in state.holders:
            raise ProtocolError(
                f"window {key} was not given to this worker (or was "
                f"answered already); a worker may only answer its windows"
            )
        assert worker is not None  # it held the window
        # See registry: what a loss may count against.
        return Answer(key, state, worker, blamed=worker.proven and held == "oldest")

    def _on_failed(self, identity: bytes, message: wire.Message, now: float) -> None:
        """The holder could not pack its window. The contract plans it (the producer
        checked), so the window goes elsewhere."""
        answer = self._answered(identity, message, now)
        if answer is None:
            return
        error = message.fields["error"]
        self.counters.add("windows_failed_by_worker")
        self.warn(
            f"producer: worker {identity.hex()} failed window {answer.key}: "
            f"{error[:500]!r}; the contract plans it, so it goes elsewhere"
        )
        self._release(answer.key, identity, loss=answer.blamed, why=f"reported {error[:200]!r}")
        self._assemble()

    def _on_packed(self, identity: bytes, message: wire.Message, now: float) -> None:
        """A plan: accepted only when it is exactly the contract's plan of the window."""
        fields = message.fields
        for name in ("audited", "audit_failures"):
            check_reported(name, fields[name], 1 << 31)
        check_reported("seconds", fields["seconds"], MAX_PACK_SECONDS)
        answer = self._answered(identity, message, now)
        if answer is None:
            return
        key, state = answer.key, answer.state
        batches = state.plan.batches
        if not fields["audited"] <= batches or not fields["audit_failures"] <= fields["audited"]:
            self._release(key, identity, loss=False, why="out-of-range audit counts")
            raise ProtocolError(
                f"audited={fields['audited']} audit_failures="
                f"{fields['audit_failures']}: need audit_failures <= audited "
                f"<= {batches} (the window's batches)"
            )
        try:
            check_plan(
                key,
                state.plan,
                self.config.capacity,
                message.arrays["occurrences"],
                message.arrays["batch_sizes"],
                fields["capacity"],
            )
        except ProtocolError:
            self.counters.add("plans_refused")
            self._release(key, identity, loss=False, why="refused plan")
            raise
        answer.worker.completed += 1
        self.counters.add("audited", fields["audited"])
        self.counters.add("audit_failures", fields["audit_failures"])
        self.counters.pack_seconds += fields["seconds"]
        if self.metrics is not None:
            self.metrics.observe_pack(fields["seconds"])
        if fields["audit_error"]:
            self.counters.last_audit_error = fields["audit_error"][:500]
            self.warn(f"producer: audit failures in window {key}: {fields['audit_error'][:1000]!r}")
        self.routes.accepted(key, identity, answer.worker.needs_tokens)
        self.counters.add("batches_received", self.pipeline.accept(key, identity, now))
        self._outrun(key)
        self.counters.peak("reorder_bytes_peak", self.reorder_bytes)
        self._assemble()

    def _release(self, key: WindowKey, identity: bytes, *, loss: bool, why: str) -> None:
        """``identity`` no longer packs ``key`` (see ``Pipeline.release``)."""
        self.pipeline.release(key, identity, loss=loss, why=why)
        self._outrun(key)  # quarantined whole: copies still held elsewhere are duplicates

    def _outrun(self, key: WindowKey) -> None:
        for other in self.pipeline.outrun(key):
            self.registry.outrun(other, key)

    # -- consumers -----------------------------------------------------------------

    def on_consumer(self, identity: bytes, frames: Sequence[Any], now: float) -> None:
        """One message from the consumer endpoint."""
        self.delivery.now = now
        if self.metrics is not None and self.delivery.on_answer is None:
            self.delivery.on_answer = self.metrics.observe_serve
        try:
            message = wire.decode(frames, self.limits)
            if message.kind == "health":
                self.send_consumer(
                    identity, "status", {"serving": True, "stats": self.stats()}, None
                )
                return
            if message.kind == "error":
                self.counters.add("peer_errors")
                self.warn(
                    f"producer: consumer {identity.hex()} refused a message: "
                    f"{message.fields['message'][:500]!r}"
                )
                return
            if message.kind == "reroute":
                rewind_to = self._on_reroute(identity, message.fields, now)
            elif message.kind == "fetch":
                rewind_to = self.delivery.fetch(
                    identity, message.fields, now, self.pipeline.assembly_point
                )
            else:
                raise ProtocolError(
                    f"a producer's consumer endpoint accepts 'fetch', 'reroute' and "
                    f"'health', not {message.kind!r}"
                )
        except ProtocolError as exc:
            self.counters.add("rejected_consumer")
            self.warn(f"producer: rejected a message from consumer {identity.hex()}: {exc}")
            self.send_consumer(identity, "error", {"message": str(exc)[:1000]}, None)
            return
        if not self.started:
            self.started = True
            epoch = message.fields["epoch"]
            if epoch > 0 and self.pipeline.epoch_live(epoch):
                # A fresh producer starts where its first consumer is: at the epoch's
                # first window (its counts are not known yet). Nothing was cut, so this
                # is a start, not a replay: not counted among the rewinds.
                self.pipeline.rewind(epoch, message.fields["index"])
        if rewind_to is not None:
            self.rewind(rewind_to)

    def _on_reroute(
        self, identity: bytes, fields: dict[str, Any], now: float
    ) -> tuple[int, int] | None:
        """A route failed: send the batch with its tokens (a replay if it is gone), and
        refuse the worker's endpoint when its frames did not match the digest."""
        reason, endpoint = fields["reason"], fields["endpoint"]
        if reason not in wire.REROUTE_REASONS:
            raise ProtocolError(
                f"reroute reason {reason!r}; expected one of {', '.join(wire.REROUTE_REASONS)}"
            )
        fetch = {name: fields[name] for name in ("rank", "world_size", "epoch", "index", "base")}
        rewind_to = self.delivery.fetch(
            identity, fetch | {"count": 1}, now, self.pipeline.assembly_point, direct=True
        )
        self.counters.add("batches_rerouted")
        if reason == "digest":
            self.counters.add("worker_batches_refused")
            if self.routes.refuse(endpoint):
                self.counters.add("workers_refused_serving")
                self.warn(
                    f"producer: a consumer found a batch from {endpoint!r} that does not "
                    "match its digest; that worker is no longer routed to"
                )
        return rewind_to

    def rewind(self, key: tuple[int, int]) -> None:
        """Replay from the window holding batch ``key`` (see pipeline, delivery)."""
        base, taken = self.pipeline.rewind(*key)
        for identity, window in taken:
            self.registry.take_back(identity, window)
        self.delivery.drop_from((key[0], base))
        self.counters.add("rewinds")
        self.log(f"producer: replaying from epoch {key[0]} batch {base} (asked for batch {key[1]})")

    # -- time and flow -------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Heartbeats, window deadlines, consumer expiry."""
        self.delivery.now = now
        for identity in self.registry.silent(now):
            self.counters.add("workers_lost")
            self.routes.lost(identity)
            held, blamed = self.registry.forget(identity)
            self.warn(
                f"producer: worker {identity.hex()} silent for more than "
                f"{self.settings.heartbeat_timeout}s; reissuing {len(held)} window(s)"
            )
            self._release_all(identity, held, blamed, "silent")
        for identity, key in self.registry.overdue(now):
            if self.registry.get(identity) is None:
                continue  # dropped with an earlier overdue window of the same worker
            self.counters.add("windows_overdue")
            self.counters.add("workers_dropped")
            self.routes.lost(identity)
            held, blamed = self.registry.drop(identity, now, self.settings.window_timeout)
            self.warn(
                f"producer: worker {identity.hex()} missed the deadline of window {key} "
                f"({self.settings.window_timeout}s); dropped, reissuing {len(held)} "
                f"window(s)"
            )
            self._release_all(identity, held, blamed, "missed its deadline")
        self.delivery.expire(now)
        self._backup_threshold = self.pipeline.plan_backups(now)

    def _release_all(
        self, identity: bytes, held: list[WindowKey], blamed: WindowKey | None, why: str
    ) -> None:
        for key in held:
            self._release(key, identity, loss=key == blamed, why=why)
        self._assemble()

    def pump(self, now: float) -> None:
        """Hand windows to workers with credit: reissues first, then backup copies of
        overdue windows (to workers not lagging themselves), then new cuts."""
        workers = self.registry.with_capacity()
        # A reissue prefers another worker than the last holder, when one has room: a
        # registered worker without credit (a hung one, say) must not keep it waiting.
        alone = len(workers) == 1
        for identity, worker in workers:
            while worker.capacity > 0:
                state = self.pipeline.next_reissue(identity, alone)
                if state is not None:
                    self.counters.add("windows_reissued")
                    backup = False
                else:
                    state = self._next_backup(identity, now)
                    backup = state is not None
                if state is None:
                    if not self.started or not self._room_to_cut():
                        return
                    state = self.pipeline.cut()
                    if state is None:  # an epoch's end: it may be whole now
                        self._assemble()
                        if self.pipeline.epoch_live(self.pipeline.cut_epoch):
                            continue
                        return
                    self.counters.add("windows_cut")
                    self.counters.peak("window_bytes_peak", self.pipeline.window_bytes)
                    if state.batches is not None:  # empty, or quarantined whole
                        self._assemble()
                        continue
                    self._fit_limits(state.plan.occurrences.nbytes + 8 * state.plan.batches)
                key = (state.window.epoch, state.window.index)
                if not self._send_window(identity, state.window, worker.needs_tokens):
                    # Gone: every window it held goes elsewhere, this one too (a
                    # reissue or a cut has no other holder; a backup copy keeps its).
                    held, _ = self.registry.forget(identity)
                    self._release_all(identity, [*held, key], None, "unreachable")
                    break
                self.pipeline.hand_to(state, identity, now, backup=backup)
                self.registry.give(identity, key, now)
                self.counters.add("windows_issued")

    def _next_backup(self, identity: bytes, now: float) -> WindowState | None:
        """A backup copy for ``identity``, unless it lags itself: a worker that has held
        a window as long as the threshold may be the slow one."""
        if not self.pipeline.backups or self.registry.lagging(
            identity, now, self._backup_threshold
        ):
            return None
        return self.pipeline.next_backup(identity)

    def _room_to_cut(self) -> bool:
        budget = self.settings.reorder_budget_bytes
        if self.pipeline.may_cut(self.delivery.ready_bytes, budget):
            return True
        if (
            self.pipeline.received_bytes + self.delivery.ready_bytes >= budget
            and self.delivery.waits_ahead(self.pipeline.assembly_point)
        ):
            # Someone waits for a batch not cut yet: the buffer must not block it.
            self.delivery.make_room(budget - self.pipeline.received_bytes)
            # What is left is asked for. Batches a drop tail holds back wait for the ones
            # that complete their group: up to one budget of them does not count (see
            # delivery), or a budget below W batches would wedge every rank.
            held = self.delivery.held_for_share()
            if self.pipeline.may_cut(self.delivery.ready_bytes - min(held, budget), budget):
                return True
            if held and not self._budget_warned:
                self._budget_warned = True
                self.warn(
                    f"producer: reorder_budget_bytes = {budget} is too small for the "
                    f"{held} bytes of batches a drop tail or the step targets hold back "
                    f"until their groups of world_size (x accumulation) batches are "
                    f"complete; ranks wait. Raise reorder_budget_bytes above {held}, or "
                    f"use tail = 'fill' and a smaller accumulation"
                )
        return False

    def _fit_limits(self, plan_bytes: int) -> None:
        """Receive limits that admit the plans of every window handed out (they only grow)."""
        limit = receive_limit(self.settings, plan_bytes)
        if limit > self.limits.max_message_bytes:
            self.limits = wire.WireLimits(max_frame_bytes=limit, max_message_bytes=limit)

    def _send_window(self, identity: bytes, window: Any, with_tokens: bool) -> bool:
        arrays = window.arrays()
        if not with_tokens:  # planning needs the ranges only: half the bytes stay here
            arrays["tokens"] = arrays["tokens"][:0]
            arrays["mask"] = arrays["mask"][:0]  # and the supervision mask of the tokens
        fields = {
            "epoch": window.epoch,
            "window": window.index,
            "binding": self.binding_wire,
            "config": self.config_wire,
            "with_tokens": with_tokens,
        }
        return self.send_worker(identity, "window", fields, arrays)

    def _assemble(self) -> None:
        for event in self.pipeline.assemble():
            if isinstance(event, Assembled):
                self.delivery.on_batch(event)
            elif isinstance(event, EpochTotal):
                self.delivery.on_total(event.epoch)
        self.delivery.after_assembly()

    def _quarantine(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.counters.quarantine(record["reason"])
            if self.quarantine_file is not None:
                self.quarantine_file.write(json.dumps(record) + "\n")
        if records and self.quarantine_file is not None:
            self.quarantine_file.flush()

    # -- status --------------------------------------------------------------------

    @property
    def reorder_bytes(self) -> int:
        return self.pipeline.received_bytes + self.delivery.ready_bytes

    def stats(self) -> dict[str, Any]:
        """Counters plus the current sizes of every table (what ``health`` reports)."""
        return (
            self.counters.as_dict()
            | self.delivery.stats()
            | {
                "workers": len(self.registry),
                "windows_in_flight": len(self.pipeline.inflight),
                "window_bytes": self.pipeline.window_bytes,
                "reorder_bytes": self.reorder_bytes,
                "epoch": self.pipeline.asm_epoch,
                "storage": storage_stats(),  # remote corpus reads, by scheme
            }
        )
