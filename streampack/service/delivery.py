"""Delivery: numbered batches to the consumers that ask for them. Plain Python, no sockets.

A consumer asks for global batches by key ``(epoch, g)``; ``rank`` and ``world_size``
come with each fetch and only say which keys it may ask for (``g % world_size ==
rank``) and how the epoch's tail is shared (``rank_share``). Nothing is fixed by the
first fetch: any consumer may ask for any key, at any world size, at any time.

State::

    ready     {(e, g): ReadyBatch}    numbered, not yet asked for (``ready_bytes``)
    pending   {(e, g): {identity}}    asked for, not yet numbered (deduplicated)
    consumers {identity: Consumer}    rank, world size, its pending keys, where it is

How a fetch for key k is answered, at once or when it becomes possible:

- epoch e does not exist (past the last epoch): ``stream_end``;
- e's total T is known and g >= rank_share(T, W) * W: ``epoch_end``;
- T known and T <= g < that limit (``tail = "fill"``): an all-padding filler batch;
- k is ready: the batch, and it is forgotten (a batch is sent once; asking again
  replays it);
- otherwise k waits in ``pending``; if k lies behind the pipeline's assembly point
  (it was numbered before and is gone: a consumer resuming from a checkpoint, or a
  stale fetch) the caller is asked to *rewind* to k.

Bounds and why nothing wedges:

- Every consumer is heard from at least every few seconds while it waits (the client
  resends outstanding fetches after silence), so one silent for ``consumer_timeout``
  is forgotten with its fetches. A resend of a pending key is a no-op, and so is a
  resend that crosses its answer: a fetch for a key the same consumer was answered
  less than ``RESEND_WINDOW`` seconds before (one of its last ``RECENT_ANSWERS``) is
  dropped and counted (``resends_dropped``), so it neither replays a window nor counts
  a batch twice. Later than that, the answer may have been lost with a connection:
  the fetch is served again, by a replay. The tables are bounded, and strangers cannot
  crowd a rank out of them:

  - at most ``MAX_PENDING_PER_CONSUMER`` keys per consumer, ``MAX_PENDING`` in all.
    Past that, the consumer holding the *most* keys is forgotten first (the least
    recently heard among equals): a per-identity share, so a consumer holding at most
    ``FAIR_SHARE = MAX_PENDING // MAX_CONSUMERS`` keys (64; a client asks for 4) is
    never forgotten for room, however many strangers ask for whatever;
  - at most ``MAX_CONSUMERS`` consumers. Past that, the least recently heard consumer
    that was never answered a batch goes first, and a consumer that was (a rank at
    work) only when no such stranger is left; a newcomer is never refused.
- A rewind frees every ready batch at or past the rewind point: the replay numbers
  the very same batches again, so holding them would only keep the budget full.
- The reorder budget never blocks a batch someone waits for. When cutting is stopped
  by the budget while a pending key lies ahead of the assembly point (or is ready but
  waits, under ``tail = "drop"``, for later batches to show it is in the share), ``make_room``
  first drops ready batches no consumer can still ask for (*passed*: for every world
  size in use, the consumers of the rank that owns the key have all moved past it),
  then evicts the ready batch with the highest key until there is room. An evicted
  batch that is asked for later is replayed, like any batch already sent.
- What a drop tail holds back is not counted against the budget, up to one budget more
  (``held_for_share``): those batches are asked for, cannot be evicted, and wait for
  the batches that complete their group, which only cutting brings — a budget below a
  group of ``W`` batches would otherwise wedge every rank.
- Step targets (``steps.py``): a batch goes out carrying the loss-eligible targets of
  its optimizer step (``W`` ranks x ``accumulation`` micro-batches), so it is served
  once every batch of that step is numbered (or the epoch's total cuts the step
  short). Until then it is held back exactly like a drop tail's batch, and a rewind
  goes to the first batch of the step, so that each of its counts is numbered again.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import wire
from ..batch import CompactBatch
from ..errors import ProtocolError
from ..loss import step_range
from .counters import ProducerCounters
from .pipeline import Assembled
from .planned import PlannedBatch
from .steps import StepTargets

Key = tuple[int, int]  # (epoch, global batch index)
#: Sends one message to a consumer; False when it cannot be delivered (gone, or
#: not reading), which forgets that consumer.
Send = Callable[[bytes, str, dict[str, Any], dict[str, Any] | None], bool]

MAX_PENDING_PER_CONSUMER = 1024
MAX_CONSUMERS = 1024
MAX_PENDING = 1 << 16
#: Keys a consumer may hold and never be forgotten to make room for others' (see above).
FAIR_SHARE = MAX_PENDING // MAX_CONSUMERS
MAX_WORLD_SIZE = 1 << 16
#: Largest epoch or batch index a fetch may name (keeps every key a small integer).
MAX_KEY = 1 << 48
#: Answers a consumer's resend may cross: keys answered to it within RESEND_WINDOW
#: seconds, at most RECENT_ANSWERS of them (a client resends at most its ``prefetch``
#: outstanding fetches, 4 by default, after 5 s of silence).
RECENT_ANSWERS = FAIR_SHARE
RESEND_WINDOW = 10.0


def rank_share(total: int, world_size: int, tail: str) -> int:
    """Batches each rank receives of an epoch of ``total``: ``ceil(total / W)`` with
    ``tail = "fill"`` (the missing ones are filler batches), ``floor(total / W)`` with
    ``tail = "drop"``. The one tail rule, used by the producer and ``digest``."""
    if tail == "fill":
        return -(-total // world_size)
    return total // world_size


@dataclasses.dataclass
class ReadyBatch:
    batch: PlannedBatch
    window: int
    number: int


@dataclasses.dataclass
class Consumer:
    """One consumer socket identity: a rank of a world size, fetching keys."""

    rank: int
    world_size: int
    last_heard: float
    pending: dict[Key, float] = dataclasses.field(default_factory=dict)  # key -> asked at
    after: Key | None = None  # the key after the last one it was answered
    # Epoch -> base of the rank's share in it (an elastic resume; 0 when absent).
    bases: dict[int, int] = dataclasses.field(default_factory=dict)
    served: bool = False  # it was answered a batch: a rank at work, not a stranger
    # Key -> when it was answered, the last RECENT_ANSWERS (oldest first): a fetch for
    # one of them is a resend that crossed its answer.
    recent: dict[Key, float] = dataclasses.field(default_factory=dict)
    # Keys it asked the producer to send itself (``reroute``): a route failed for them.
    direct: set[Key] = dataclasses.field(default_factory=set)

    def floor(self) -> Key | None:
        """The lowest key it may still ask for (None: it asked for nothing live)."""
        if self.pending:
            return min(self.pending)
        return self.after

    def base(self, epoch: int) -> int:
        return self.bases.get(epoch, 0)

    def share(self, epoch: int, total: int, tail: str) -> tuple[int, int]:
        """(per_rank, limit): its share of an epoch of ``total`` batches, and the first
        index past it."""
        base = self.base(epoch)
        per_rank = rank_share(max(0, total - base), self.world_size, tail)
        return per_rank, base + per_rank * self.world_size

    def answered(self, key: Key, now: float) -> float | None:
        """``key`` was sent to it at ``now``: forget the key; returns when it was asked
        for (None: it was not pending)."""
        self.served = True
        self.recent.pop(key, None)
        self.recent[key] = now
        if len(self.recent) > RECENT_ANSWERS:
            del self.recent[next(iter(self.recent))]
        asked = self.pending.pop(key, None)
        nxt = (key[0], key[1] + self.world_size)
        if self.after is None or nxt > self.after:
            self.after = nxt
        return asked

    def resent(self, key: Key, now: float) -> bool:
        """Whether a fetch for ``key`` now is a resend that crossed its answer."""
        at = self.recent.get(key)
        return at is not None and now - at < RESEND_WINDOW


class Delivery:
    """Ready batches, pending fetches and consumers (see module docstring)."""

    def __init__(
        self,
        *,
        tail: str,
        reorder_budget_bytes: int,
        consumer_timeout: float,
        send: Send,
        counters: ProducerCounters,
        binding_wire: dict[str, Any],
        filler: CompactBatch,
        epoch_live: Callable[[int], bool],
        total: Callable[[int], int | None],
        numbered: Callable[[int], int],
        accumulation: int = 1,
        route: Callable[[int, int], str | None] | None = None,
    ) -> None:
        self.tail = tail
        self.steps = StepTargets(accumulation)
        self.reorder_budget_bytes = reorder_budget_bytes
        self.consumer_timeout = consumer_timeout
        self.send = send
        self.counters = counters
        self.binding_wire = binding_wire
        self._filler_fields = {
            "filler": True,
            "window": -1,
            "batch": -1,
            "binding": binding_wire,
        } | wire.batch_shape(filler)
        self._filler_arrays = wire.batch_arrays(filler)
        self.epoch_live = epoch_live
        self.total = total
        self.numbered = numbered  # batches of an epoch numbered so far
        # data_plane = "workers": the endpoint of the worker that serves the batches of
        # window (epoch, w), or None (the batch goes with its tokens).
        self.route = route
        self.now = 0.0  # the time of the message or tick being handled (set by the caller)
        #: Called with the seconds from a fetch's arrival to its answer (metrics).
        self.on_answer: Callable[[float], None] | None = None
        self.ready: dict[Key, ReadyBatch] = {}
        self.ready_bytes = 0
        self.pending: dict[Key, set[bytes]] = {}
        self.pending_count = 0
        self.consumers: collections.OrderedDict[bytes, Consumer] = collections.OrderedDict()

    # -- fetches -------------------------------------------------------------------

    def fetch(
        self,
        identity: bytes,
        fields: dict[str, Any],
        now: float,
        assembly_point: Key,
        *,
        direct: bool = False,
    ) -> Key | None:
        """Take one ``fetch`` message. Returns the key to rewind to, if any. ``direct``
        (a ``reroute``): a route for these keys failed, so they are sent with their
        tokens, and are not a resend even if just answered (with a route).

        Raises ``ProtocolError`` for a fetch out of range (nothing is changed then).
        """
        rank, world, epoch, index, count, base = (
            fields["rank"],
            fields["world_size"],
            fields["epoch"],
            fields["index"],
            fields["count"],
            fields["base"],
        )
        if (
            not 0 <= rank < world <= MAX_WORLD_SIZE
            or not 0 <= epoch < MAX_KEY
            or not 0 <= base <= index < MAX_KEY
            or (index - base) % world != rank
            or not 1 <= count <= MAX_PENDING_PER_CONSUMER
        ):
            raise ProtocolError(
                f"fetch rank={rank} world_size={world} epoch={epoch} index={index} "
                f"count={count} base={base}: need 0 <= rank < world_size <= "
                f"{MAX_WORLD_SIZE}, 0 <= epoch < 2**48, 0 <= base <= index < 2**48, "
                f"index = base + rank mod world_size and "
                f"1 <= count <= {MAX_PENDING_PER_CONSUMER}"
            )
        consumer = self.consumers.get(identity)
        if consumer is None or (consumer.rank, consumer.world_size) != (rank, world):
            if consumer is not None:
                self._forget_consumer(identity)
            consumer = Consumer(rank=rank, world_size=world, last_heard=now)
        asked = [(epoch, index + k * world) for k in range(count)]
        fresh = [key for key in asked if key not in consumer.pending]
        if direct:
            consumer.direct.update(fresh)
        crossed = [key for key in fresh if not direct and consumer.resent(key, now)]
        if crossed:
            # Its answers were on the way when it asked again: nothing to do, nothing
            # to replay or count twice.
            self.counters.add("resends_dropped", len(crossed))
            fresh = [key for key in fresh if key not in crossed]
        if len(consumer.pending) + len(fresh) > MAX_PENDING_PER_CONSUMER:
            raise ProtocolError(
                f"more than {MAX_PENDING_PER_CONSUMER} fetches outstanding from one consumer"
            )
        self.consumers[identity] = consumer
        self.consumers.move_to_end(identity)
        consumer.last_heard = now
        if base or epoch in consumer.bases:
            consumer.bases[epoch] = base
            while len(consumer.bases) > 4:  # the resumed epoch and the few after it
                del consumer.bases[min(consumer.bases)]
        rewind_to = None
        for key in fresh:
            consumer.pending[key] = now
            self.pending.setdefault(key, set()).add(identity)
            self.pending_count += 1
            outcome = self._answer(identity, consumer, key)
            if outcome == "ended" or identity not in self.consumers:
                break
            if outcome == "wait":
                behind = key < assembly_point and key not in self.ready
                behind = behind or self._step_lost(key, consumer)
                # From the first batch of its step: the replay numbers (and counts) all.
                first = (key[0], step_range(key[1], world, self.steps.accumulation, base)[0])
                if behind and (rewind_to is None or first < rewind_to):
                    rewind_to = first
        if not self._bound_pending(identity):
            return None  # it was itself forgotten for room: nothing to replay for it
        return rewind_to

    def _answer(self, identity: bytes, consumer: Consumer, key: Key) -> str:
        """Answer ``key`` now if possible: "sent", "ended" (stream or epoch end: the
        rest of this fetch needs no answer) or "wait"."""
        epoch, index = key
        if not self.epoch_live(epoch):
            self._send_end(identity, consumer, key, stream=True)
            return "ended"
        total = self.total(epoch)
        if total is not None:
            _, limit = consumer.share(epoch, total, self.tail)
            if index >= limit:
                self._send_end(identity, consumer, key, stream=False)
                return "ended"
            if index >= total:
                if self._step_targets(key, consumer) is None:
                    return "wait"  # its step's counts are gone: ``fetch`` rewinds for them
                self._send_filler(identity, consumer, key)
                return "sent"
        if key in self.ready and self._servable(key, consumer):
            self._serve(key, sorted(self.pending.get(key, {identity})))
            return "sent" if key not in consumer.pending else "wait"
        return "wait"

    def _within_share(self, key: Key, consumer: Consumer) -> bool:
        """Whether batch ``key`` is certainly part of the consumer's share of its epoch.
        With ``tail = "drop"`` the last ``T mod W`` batches are not, so before the total
        T is known a batch is served only once ``W - rank`` more have been numbered."""
        epoch, index = key
        total = self.total(epoch)
        if total is not None:
            return index < consumer.share(epoch, total, self.tail)[1]
        if self.tail == "fill":
            return True
        return self.numbered(epoch) >= index - consumer.rank + consumer.world_size

    def _step_targets(self, key: Key, consumer: Consumer) -> int | None:
        """The loss-eligible targets of ``key``'s step for this consumer's world size, or
        None while some batch of the step is not numbered."""
        epoch = key[0]
        total = self.total(epoch)
        end = None if total is None else min(total, consumer.share(epoch, total, self.tail)[1])
        return self.steps.of_step(epoch, key[1], consumer.world_size, consumer.base(epoch), end)

    def _step_lost(self, key: Key, consumer: Consumer) -> bool:
        """Every batch of ``key``'s step was numbered, yet a count is gone (its epoch had
        been left by every consumer there was): only a replay brings it back."""
        epoch = key[0]
        _, stop = step_range(
            key[1], consumer.world_size, self.steps.accumulation, consumer.base(epoch)
        )
        total = self.total(epoch)
        if total is not None:
            stop = min(stop, total, consumer.share(epoch, total, self.tail)[1])
        return stop <= self.numbered(epoch) and self._step_targets(key, consumer) is None

    def _servable(self, key: Key, consumer: Consumer) -> bool:
        """In the consumer's share, and its step's targets known."""
        return self._within_share(key, consumer) and self._step_targets(key, consumer) is not None

    def _send_end(self, identity: bytes, consumer: Consumer, key: Key, *, stream: bool) -> None:
        epoch = key[0]
        if stream:
            sent = self.send(identity, "stream_end", {"epochs": epoch}, None)
            consumer.after = None
            self._cancel(identity, consumer, lambda k: k[0] >= epoch)
        else:
            total = self.total(epoch) or 0
            per_rank, limit = consumer.share(epoch, total, self.tail)
            sent = self.send(
                identity, "epoch_end", {"epoch": epoch, "per_rank": per_rank, "total": total}, None
            )
            consumer.after = (epoch + 1, consumer.rank)
            # Keys past the limit need no other answer; those before it still get theirs.
            self._cancel(identity, consumer, lambda k: k[0] == epoch and k[1] >= limit)
        if not sent:
            self._forget_consumer(identity)

    def _send_filler(self, identity: bytes, consumer: Consumer, key: Key) -> None:
        fields = {"epoch": key[0], "index": key[1]} | self._filler_fields
        fields["step_targets"] = self._step_targets(key, consumer)
        if self.send(identity, "batch", fields, self._filler_arrays):
            self.counters.add("fillers_served")
            self._unpend(identity, key)
            self._observe(consumer.answered(key, self.now))
        else:
            self._forget_consumer(identity)

    def _serve(self, key: Key, identities: list[bytes]) -> None:
        """Send ready batch ``key`` to each identity it can go to now; forget it once
        one took it and none still waits for it."""
        entry = self.ready[key]
        fields = {
            "epoch": key[0],
            "index": key[1],
            "window": entry.window,
            "batch": entry.number,
            "filler": False,
            "binding": self.binding_wire,
        } | wire.batch_shape(entry.batch)
        endpoint = None if self.route is None else self.route(key[0], entry.window)
        routed: dict[str, Any] | None = None
        arrays: dict[str, Any] | None = None  # gathered only for a consumer it goes to
        delivered = False
        delivered_to: int | None = None  # the rank of the first consumer that took it
        for identity in identities:
            consumer = self.consumers.get(identity)
            if consumer is None or not self._servable(key, consumer):
                continue
            fields["step_targets"] = self._step_targets(key, consumer)
            rerouted = key in consumer.direct
            if endpoint is not None and not rerouted:
                if routed is None:  # from the producer's window, nothing gathered
                    digest = entry.batch.route_digest().hex()
                    routed = {"endpoint": endpoint, "digest": digest}
                sent = self.send(identity, "route", fields | routed, None)
            else:
                if arrays is None:
                    arrays = wire.batch_arrays(entry.batch.compact())
                sent = self.send(identity, "batch", fields, arrays)
            if sent:
                consumer.direct.discard(key)
                if endpoint is not None and not rerouted:
                    self.counters.add("batches_routed")
                delivered = True
                # A rerouted batch was counted when its route was sent.
                if delivered_to is None and not rerouted:
                    delivered_to = consumer.rank
                self._unpend(identity, key)
                self._observe(consumer.answered(key, self.now))
            else:
                self._forget_consumer(identity)
        if delivered:
            if not self.pending.get(key):  # kept while another asker waits for its step
                del self.ready[key]
                self.ready_bytes -= entry.batch.nbytes
            if delivered_to is not None:
                self._count_served(entry.batch, delivered_to)

    def _count_served(self, batch: PlannedBatch, rank: int) -> None:
        """Count a batch once, however many consumers took it: in total, for the rank
        it was first delivered to, and by the mixture source of each occurrence (from
        its records and the window's columns: what the rank reads, nothing gathered)."""
        occurrences = batch.occurrences
        pairs = (occurrences["stop"] - occurrences["start"]).astype(np.int64)
        supervised = batch.supervised_targets_by_occurrence()
        real_tokens, supervised_targets = int(pairs.sum()), int(supervised.sum())
        self.counters.add("batches_served")
        self.counters.add("tokens_served", real_tokens)
        self.counters.add("supervised_targets_served", supervised_targets)
        self.counters.add("cells_served", batch.rows * batch.capacity)
        self.counters.served_to_rank(rank, real_tokens, supervised_targets)
        self.counters.served_by_source(batch.sources, pairs, supervised)

    def _cancel(self, identity: bytes, consumer: Consumer, which: Callable[[Key], bool]) -> None:
        """Drop the pending keys of one consumer that an end answer covered."""
        for key in [k for k in consumer.pending if which(k)]:
            self._observe(consumer.pending.pop(key))
            self._unpend(identity, key)

    def _observe(self, asked: float | None) -> None:
        if self.on_answer is not None and asked is not None:
            self.on_answer(max(0.0, self.now - asked))

    def _unpend(self, identity: bytes, key: Key) -> None:
        waiting = self.pending.get(key)
        if waiting is not None and identity in waiting:
            waiting.discard(identity)
            self.pending_count -= 1
            if not waiting:
                del self.pending[key]

    # -- what the pipeline numbers -------------------------------------------------

    def on_batch(self, event: Assembled) -> None:
        key = (event.epoch, event.index)
        self.steps.record(event.epoch, event.index, event.batch.supervised_targets)
        if key in self.ready:
            self.counters.add("duplicates_dropped")
            return
        self.ready[key] = ReadyBatch(event.batch, event.window, event.number)
        self.ready_bytes += event.batch.nbytes
        waiting = self.pending.get(key)
        if waiting:
            self._serve(key, sorted(waiting))

    def after_assembly(self) -> None:
        """Serve the waiting fetches of ready batches that more numbered batches have
        just shown to be within their rank's share (``tail = "drop"``) or completed
        the step of (step targets)."""
        for key in [k for k in self.pending if k in self.ready]:
            waiting = self.pending.get(key)  # serving one key may forget a consumer
            if waiting and key in self.ready:
                self._serve(key, sorted(waiting))

    def on_total(self, epoch: int) -> None:
        """Epoch ``epoch``'s total is known: answer the fetches it decides — past the
        total (a filler or the end) and, with ``tail = "drop"``, past a rank's share
        though below the total (the end: those batches may be ready and never served)."""
        if self.total(epoch) is None:
            return
        for key in sorted(k for k in self.pending if k[0] == epoch):
            for identity in sorted(self.pending.get(key, ())):
                consumer = self.consumers.get(identity)
                if consumer is None or key not in consumer.pending:
                    continue
                self._answer(identity, consumer, key)  # a filler, or the epoch's end
        # An epoch without batches ends an unbounded stream: later epochs do not exist.
        for key in sorted(k for k in self.pending if not self.epoch_live(k[0])):
            for identity in sorted(self.pending.get(key, ())):
                consumer = self.consumers.get(identity)
                if consumer is not None and key in consumer.pending:
                    self._send_end(identity, consumer, key, stream=True)

    # -- rewinds, budget, expiry ---------------------------------------------------

    def drop_from(self, key: Key) -> None:
        """A rewind to ``key``: free every ready batch at or past it (replayed anyway)."""
        for k in [k for k in self.ready if k >= key]:
            self.ready_bytes -= self.ready.pop(k).batch.nbytes

    def waits_ahead(self, assembly_point: Key) -> bool:
        """Whether some consumer waits for what only more cutting brings: a batch not
        numbered yet, or (``tail = "drop"``) the later batches or the epoch's total that
        decide whether a ready batch is part of its share."""
        return any(
            key >= assembly_point or (key in self.ready and self.total(key[0]) is None)
            for key in self.pending
        )

    def held_for_share(self) -> int:
        """Bytes of ready batches that are asked for but wait, before the epoch's total
        is known, for the batches that complete their group of ``W`` (``tail =
        "drop"``) or their step: at most one step of batches per consumer."""
        return sum(
            self.ready[key].batch.nbytes
            for key in self.pending
            if key in self.ready and self.total(key[0]) is None
        )

    def _passed(self) -> Callable[[Key], bool]:
        """A test for keys no consumer can still ask for (see module docstring)."""
        floors: dict[int, dict[int, Key]] = {}
        for consumer in self.consumers.values():
            floor = consumer.floor()
            if floor is None:
                continue
            by_rank = floors.setdefault(consumer.world_size, {})
            if consumer.rank not in by_rank or floor < by_rank[consumer.rank]:
                by_rank[consumer.rank] = floor

        def passed(key: Key) -> bool:
            if not floors:
                return False
            for world, by_rank in floors.items():
                floor = by_rank.get(key[1] % world)
                if floor is None or key >= floor:
                    return False
            return True

        return passed

    def make_room(self, room: int) -> None:
        """Free ready batches until ``ready_bytes < room``: first those no consumer can
        still ask for, then the highest keys (never one that is asked for)."""
        passed = self._passed()
        for key in [k for k in self.ready if passed(k)]:
            self.ready_bytes -= self.ready.pop(key).batch.nbytes
            self.counters.add("replayed_dropped")
        if self.ready_bytes < room:
            return
        for key in sorted(self.ready, reverse=True):
            if self.ready_bytes < room:
                break
            if key in self.pending:
                continue
            self.ready_bytes -= self.ready.pop(key).batch.nbytes
            self.counters.add("evicted")

    def expire(self, now: float) -> None:
        """Forget consumers silent for ``consumer_timeout`` (with their fetches), and the
        step counts of epochs every consumer has left."""
        limit = now - self.consumer_timeout
        while self.consumers:
            identity, consumer = next(iter(self.consumers.items()))
            if consumer.last_heard >= limit:
                break
            self._forget_consumer(identity)
        floors = [c.floor() for c in self.consumers.values()]
        epochs = [floor[0] for floor in floors if floor is not None]
        if epochs and len(epochs) == len(floors):  # one epoch kept for a late rank
            self.steps.forget_before(min(epochs) - 1)

    def _forget_consumer(self, identity: bytes) -> None:
        consumer = self.consumers.pop(identity, None)
        if consumer is None:
            return
        self.counters.add("consumers_dropped")
        for key in consumer.pending:
            self._unpend(identity, key)

    def _bound_pending(self, keep: bytes) -> bool:
        """Hold the tables to their bounds (see module docstring) after a fetch from
        ``keep``. Returns False when ``keep`` itself was forgotten: it held the most."""
        while len(self.consumers) > MAX_CONSUMERS:
            others = [i for i in self.consumers if i != keep]  # least recently heard first
            self._forget_consumer(
                next((i for i in others if not self.consumers[i].served), others[0])
            )
        while self.pending_count > MAX_PENDING:
            # max() keeps the first of equals: the least recently heard.
            self._forget_consumer(max(self.consumers, key=lambda i: len(self.consumers[i].pending)))
        return keep in self.consumers

    def stats(self) -> dict[str, int]:
        return {
            "ready_batches": len(self.ready),
            "pending_fetches": self.pending_count,
            "consumers": len(self.consumers),
        }
