"""``streampack produce``: cut the corpus into windows, collect packed batches, serve ranks.

One thread, one ``zmq.Poller`` over two ROUTER sockets::

    worker endpoint  (ROUTER) <- ready / heartbeat / packed / failed
                              -> window
    consumer endpoint (ROUTER) <- fetch{rank, world_size, epoch, index, count} / health
                               -> batch / epoch_end / stream_end / status / error

The pipeline, for epoch e (windows numbered 0, 1, ... by ``windows.iter_windows``)::

    cut ──▶ in flight {(e, w): window, worker}
              │ packed: the plans of all its batches, checked against the window;
              │ each batch's tokens taken from the window
              ▼
    assemble in window order: global index g = batches of windows < w + batch
              ▼
    ready {(e, g): compact batch}  ──fetch(e, g) from rank g % W──▶  sent, forgotten

Properties and how they hold:

- *Order and determinism.* Windows depend on the corpus and settings only; each is
  packed alone; the assembler numbers batches in window order. Which worker packed
  what, and when, cannot show in the output.
- *Exactly once.* A result is identified by (epoch, window): one that is not awaited
  (a duplicate from a reissued window, or stale after a rewind) is dropped. Plans that
  do not hold each of the window's documents exactly once, in order, with their
  ranges, are refused and the window goes to another worker.
- *Worker failure.* A worker silent for ``heartbeat_timeout`` loses its windows; they
  are reissued, lowest first. A window lost five times, or whose worker reports
  ``failed``, is quarantined whole (its documents are written to the quarantine file)
  and counts as zero batches, so the stream goes on.
- *Resume.* A rank's cursor (epoch, next index) is all it needs: a fetch for a batch
  that was already sent and forgotten *rewinds* the pipeline to the window holding it
  (found from the per-window batch counts of that epoch, or window 0 of the epoch for
  a fresh producer) and replays; replayed batches another rank has already passed
  (below its floor) are dropped on arrival.
- *Epoch tail.* Once an epoch's total T is known each rank gets ``ceil(T / W)``
  batches (``tail = "fill"``: indices T.. are all-padding batches flagged ``filler``)
  or ``floor(T / W)`` (``tail = "drop"``); a fetch past that gets ``epoch_end``.
- *Bounded memory.* A new window is cut only while the windows in flight hold at most
  ``window_budget_bytes`` and the assembled-but-unsent batches at most
  ``reorder_budget_bytes``. Results of windows already in flight are always accepted,
  so the reorder buffer can exceed its budget by at most the output of the windows in
  flight (at most ``window_budget_bytes``-worth of windows, each bounded by
  ``window_tokens``). Batches of whole documents share their window's token buffer
  (slices, not copies), which is freed with the last of them: a window partly
  served holds up to its own tokens beyond the count. ZeroMQ queues stay small
  because both directions are credit-based (workers ask for windows, consumers ask
  for batches).
- *Bad messages.* Anything ``wire.decode`` rejects, or a valid message of the wrong
  kind or with out-of-range values, is counted (``rejected_*``) and, where it came
  with an identity, answered with ``error``. The loop never dies of a message.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
import logging
import signal
import time
from typing import Any

import numpy as np
import zmq

from streampack import CompactBatch, InvalidArray, wire
from streampack.corpus import open_corpus
from streampack.errors import InvalidConfig, ProtocolError
from streampack.kernels.pack_cpu import plan_matches_window
from streampack.packing import warm_up_kernels
from streampack.settings import (
    ProducerSettings,
    add_flags,
    check_output_path,
    from_args,
    read_curve_secret,
)
from streampack.windows import CutSpec, Window, iter_windows

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 5  # a window lost this often is quarantined (it may be killing workers)
COUNTERS = (
    "workers_joined", "workers_lost", "windows_cut", "windows_issued", "windows_reissued",
    "windows_completed", "windows_failed", "batches_received", "batches_served",
    "fillers_served", "tokens_served", "duplicates_dropped", "stale_dropped",
    "replayed_dropped", "rewinds", "rejected_worker", "rejected_consumer", "quarantined",
    "audited", "audit_failures", "window_bytes_peak", "reorder_bytes_peak", "cells_served",
    "documents_split", "pairs_cut",
)
MAX_PENDING_PER_CONSUMER = 1024


@dataclasses.dataclass
class _InFlight:
    window: Window
    worker: bytes | None = None
    attempts: int = 0
    batches: dict[int, CompactBatch] = dataclasses.field(default_factory=dict)
    expected: int | None = None
    batch_bytes: int = 0


@dataclasses.dataclass
class _Worker:
    credit: int
    last_seen: float
    needs_tokens: bool = False  # it audits: windows go to it with their tokens
    windows: set[tuple[int, int]] = dataclasses.field(default_factory=set)


class Producer:
    """The producer's state machine; ``run()`` serves until ``stop()``."""

    def __init__(self, settings: ProducerSettings, *, log: Any = None) -> None:
        if settings.corpus is None:
            raise InvalidConfig(
                "corpus is not set; pass --corpus PATH or set corpus in the [producer] table"
            )
        self.settings = settings
        self.log = log or logger.info
        self.source = open_corpus(settings.corpus, allow_outside=settings.corpus_allow_outside)
        self.binding = self.source.binding.to_binding()
        self.binding_wire = wire.binding_to_wire(self.binding)
        self.spec = CutSpec.from_settings(settings)
        self.pack_config = {
            "capacity": settings.capacity,
            "max_rows_per_batch": settings.max_rows_per_batch,
            "max_cells": settings.max_cells,
            "max_metadata_bytes": settings.max_metadata_bytes,
        }
        self.limits = wire.WireLimits(max_frame_bytes=settings.max_message_bytes)
        self.curve_secret = (
            read_curve_secret(settings.curve_secret_key_file)
            if settings.curve_secret_key_file
            else None
        )
        self.stopping = False
        self.serving = False
        self.stats: dict[str, Any] = collections.defaultdict(int)
        for name in COUNTERS:
            self.stats[name] = 0
        self.quarantine_reasons: dict[str, int] = collections.defaultdict(int)
        self.tokens_by_rank: dict[int, int] = collections.defaultdict(int)  # rank < world_size
        # By mixture source (index in the manifest's sources; one source: 0).
        self.tokens_by_source: dict[int, int] = collections.defaultdict(int)
        self.documents_by_source: dict[int, int] = collections.defaultdict(int)
        self.metrics: Any = None  # service.metrics.ProducerMetrics while metrics are served
        if settings.quarantine_path:
            check_output_path("quarantine_path", settings.quarantine_path)
        self._quarantine_file = (
            open(settings.quarantine_path, "a") if settings.quarantine_path else None
        )
        self._quarantine_mark: dict[int, int] = {}  # epoch -> windows recorded

        self.workers: dict[bytes, _Worker] = {}
        self.inflight: dict[tuple[int, int], _InFlight] = {}
        self.reissue: list[tuple[int, int]] = []  # sorted keys awaiting a worker
        self.window_bytes = 0

        # Cutter: the next window to cut.
        self.cut_epoch = 0
        self.cut_next = 0
        self._cutter: Any = None
        self.windows_in_epoch: dict[int, int] = {}
        self._end_epoch: int | None = None

        # Assembler: the next window to number, and the next global index.
        self.asm_epoch = 0
        self.asm_window = 0
        self.asm_index = 0
        self.counts: dict[int, list[int]] = {}  # epoch -> batches per assembled window
        self.totals: dict[int, int] = {}  # epoch -> batches in the epoch

        self.ready: dict[tuple[int, int], tuple[CompactBatch, int, int]] = {}
        self.reorder_bytes = 0

        self.world_size: int | None = None
        self.floors: dict[int, tuple[int, int]] = {}
        self.pending: dict[tuple[int, int], list[bytes]] = {}
        self.fetched_at: dict[tuple[int, int], float] = {}  # first fetch of each pending key
        self.pending_count: dict[bytes, int] = collections.defaultdict(int)
        self.started = False
        self._filler_frames: list[Any] | None = None
        self._filler_shape: dict[str, int] = {}

    # ------------------------------------------------------------------ cutting

    def _reset_cutter(self, epoch: int, window: int) -> None:
        self.cut_epoch = epoch
        self.cut_next = window
        self._cutter = iter_windows(self.source, epoch, self.spec, start_window=window)

    def _epoch_live(self, epoch: int) -> bool:
        if self._end_epoch is not None and epoch >= self._end_epoch:
            return False  # the corpus has no documents: an unbounded stream ends at once
        return self.settings.epochs == 0 or epoch < self.settings.epochs

    def _cut_one(self) -> Window | None:
        """The next window of the pipeline, moving to the next epoch at an epoch's end."""
        while self._epoch_live(self.cut_epoch):
            if self._cutter is None:
                self._reset_cutter(self.cut_epoch, self.cut_next)
            window = next(self._cutter, None)
            if window is not None:
                self.cut_next = window.index + 1
                self._record_quarantine(window)
                return window
            self.windows_in_epoch[self.cut_epoch] = self.cut_next
            if self.cut_next == 0 and self._end_epoch is None:
                self._end_epoch = self.cut_epoch
            self._reset_cutter(self.cut_epoch + 1, 0)
            self._try_assemble()
        return None

    def _record_quarantine(self, window: Window) -> None:
        mark = self._quarantine_mark.get(window.epoch, 0)
        if window.index < mark:
            return  # replayed after a rewind; already recorded
        self._quarantine_mark[window.epoch] = window.index + 1
        self._quarantine(window.quarantined)
        # Long documents of a long_documents = "split" source: counted once, like quarantine.
        self.stats["documents_split"] += window.documents_split
        self.stats["pairs_cut"] += window.pairs_cut

    def _quarantine(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.stats["quarantined"] += 1
            self.quarantine_reasons[record["reason"]] += 1
            if self._quarantine_file is not None:
                self._quarantine_file.write(json.dumps(record) + "\n")
        if records and self._quarantine_file is not None:
            self._quarantine_file.flush()

    def _can_cut(self) -> bool:
        if not self.started or self.reissue:
            return False
        if not self._epoch_live(self.cut_epoch):
            return False
        if self.reorder_bytes >= self.settings.reorder_budget_bytes:
            return False
        return not self.inflight or self.window_bytes < self.settings.window_budget_bytes

    # ------------------------------------------------------------------ workers

    def _assign(self, socket: zmq.Socket) -> None:
        """Hand windows to workers with credit: reissues first, then new cuts."""
        for identity, worker in list(self.workers.items()):
            while worker.credit > 0:
                if self.reissue:
                    key = self.reissue.pop(0)
                    state = self.inflight.get(key)
                    if state is None or state.worker is not None:
                        continue
                    self.stats["windows_reissued"] += 1
                else:
                    if not self._can_cut():
                        return
                    window = self._cut_one()
                    if window is None:
                        return
                    self.stats["windows_cut"] += 1
                    if len(window.start) == 0:
                        self._complete_empty(window)
                        continue
                    key = (window.epoch, window.index)
                    state = _InFlight(window=window)
                    self.inflight[key] = state
                    self.window_bytes += window.nbytes
                    self.stats["window_bytes_peak"] = max(
                        self.stats["window_bytes_peak"], self.window_bytes
                    )
                state.worker = identity
                state.attempts += 1
                worker.windows.add(key)
                worker.credit -= 1
                self._send_window(socket, identity, state.window, worker.needs_tokens)
                self.stats["windows_issued"] += 1

    def _send_window(self, socket: zmq.Socket, identity: bytes, window: Window,
                     with_tokens: bool) -> None:
        arrays = window.arrays()
        if not with_tokens:  # planning needs the ranges only: half the bytes stay here
            arrays["tokens"] = arrays["tokens"][:0]
        fields = {"epoch": window.epoch, "window": window.index, "binding": self.binding_wire,
                  "config": self.pack_config, "with_tokens": with_tokens}
        self._send(socket, identity, "window", fields, arrays)

    def _complete_empty(self, window: Window) -> None:
        key = (window.epoch, window.index)
        self.inflight[key] = _InFlight(window=window, expected=0)
        self.window_bytes += window.nbytes
        self._try_assemble()

    def _forget_worker(self, identity: bytes) -> None:
        worker = self.workers.pop(identity, None)
        if worker is None:
            return
        for key in worker.windows:
            state = self.inflight.get(key)
            if state is not None and state.worker == identity:
                state.worker = None
                if state.attempts >= MAX_ATTEMPTS:
                    self._fail_window(key, f"{state.attempts} workers lost this window")
                else:
                    bisect.insort(self.reissue, key)

    def _check_heartbeats(self) -> None:
        deadline = time.monotonic() - self.settings.heartbeat_timeout
        for identity, worker in list(self.workers.items()):
            if worker.last_seen < deadline:
                self.stats["workers_lost"] += 1
                self.log(
                    f"producer: worker {identity.hex()} silent for more than "
                    f"{self.settings.heartbeat_timeout}s; reissuing {len(worker.windows)} "
                    f"window(s)"
                )
                self._forget_worker(identity)

    def _fail_window(self, key: tuple[int, int], error: str) -> None:
        state = self.inflight.get(key)
        if state is None:
            return
        self.stats["windows_failed"] += 1
        window = state.window
        self.log(f"producer: window {key} quarantined whole: {error}")
        self._quarantine(
            [
                {
                    "epoch": window.epoch,
                    "window": window.index,
                    "source_id": int(s),
                    "example_id": int(x),
                    "location": "",
                    "reason": "pack_failed",
                    "detail": error[:500],
                }
                for s, x in zip(window.source_id, window.example_id)
            ]
        )
        self.reorder_bytes -= state.batch_bytes
        state.batches.clear()
        state.batch_bytes = 0
        state.expected = 0
        self._try_assemble()

    def _on_worker(self, socket: zmq.Socket, frames: list[Any]) -> None:
        identity = bytes(frames[0].bytes) if hasattr(frames[0], "bytes") else bytes(frames[0])
        worker = self.workers.get(identity)
        if worker is not None:
            worker.last_seen = time.monotonic()
        try:
            message = wire.decode(frames[1:], self.limits)
            self._worker_message(identity, worker, message)
        except ProtocolError as exc:
            self.stats["rejected_worker"] += 1
            self.log(f"producer: rejected a worker message: {exc}")
            socket.send_multipart(
                [identity, *wire.encode("error", {"message": str(exc)[:1000]})], copy=False
            )

    def _worker_message(
        self, identity: bytes, worker: _Worker | None, message: wire.Message
    ) -> None:
        kind, fields = message.kind, message.fields
        if worker is None:
            if kind not in ("ready", "heartbeat", "packed", "failed"):
                raise ProtocolError(f"{kind!r} is not a worker message")
            worker = _Worker(credit=0, last_seen=time.monotonic())
            self.workers[identity] = worker
            self.stats["workers_joined"] += 1
            if kind == "heartbeat":
                worker.credit = min(max(fields["free"], 0), 64)
        if kind in ("ready", "heartbeat"):
            worker.needs_tokens = fields["needs_tokens"]
        if kind == "ready":
            if not 0 < fields["credit"] <= 64:
                raise ProtocolError(f"credit {fields['credit']} is outside 1..64")
            worker.credit = min(worker.credit + fields["credit"], 64)
        elif kind == "heartbeat":
            pass
        elif kind == "packed":
            self._on_packed(identity, worker, message)
        elif kind == "failed":
            key = (fields["epoch"], fields["window"])
            worker.windows.discard(key)
            if key in self.inflight and self.inflight[key].expected is None:
                self._fail_window(key, fields["error"])
        else:
            raise ProtocolError(f"{kind!r} is not a worker message")

    def _on_packed(self, identity: bytes, worker: _Worker, message: wire.Message) -> None:
        f = message.fields
        key = (f["epoch"], f["window"])
        worker.windows.discard(key)
        self.stats["audited"] += f["audited"]
        self.stats["audit_failures"] += f["audit_failures"]
        self.stats["pack_seconds"] += f["seconds"]
        if self.metrics is not None and 0.0 <= f["seconds"] <= 1e6:  # NaN fails both
            self.metrics.observe_pack(f["seconds"])
        if f["audit_error"]:
            self.stats["last_audit_error"] = f["audit_error"][:500]
            self.log(f"producer: audit failures in window {key}: {f['audit_error']}")
        state = self.inflight.get(key)
        if state is None:
            self.stats["stale_dropped"] += 1
            return
        if state.expected is not None:
            self.stats["duplicates_dropped"] += 1
            return
        try:
            batches = self._batches_of_plans(key, state.window, f, message.arrays)
        except ProtocolError:
            if state.worker == identity:  # give the window to another worker
                state.worker = None
                if state.attempts >= MAX_ATTEMPTS:
                    self._fail_window(key, f"{state.attempts} workers sent unusable plans")
                else:
                    bisect.insort(self.reissue, key)
            raise
        state.batches = dict(enumerate(batches))
        state.expected = len(batches)
        state.batch_bytes = sum(batch.nbytes for batch in batches)
        self.reorder_bytes += state.batch_bytes
        self.stats["reorder_bytes_peak"] = max(self.stats["reorder_bytes_peak"], self.reorder_bytes)
        self.stats["batches_received"] += len(batches)
        self._try_assemble()

    def _batches_of_plans(
        self, key: tuple[int, int], window: Window, f: dict[str, Any], arrays: dict[str, Any]
    ) -> list[CompactBatch]:
        """The compact batches a worker's plans describe, tokens taken from the producer's
        own copy of the window. Refused (``ProtocolError``) unless the plans hold each of
        the window's documents exactly once, in order, with their ranges and identities,
        and every batch passes the check a consumer makes: a bad worker can neither
        stall a rank nor change or lose a token."""
        occurrences, sizes = arrays["occurrences"], arrays["batch_sizes"]

        def refuse(what: str) -> ProtocolError:
            return ProtocolError(f"plans of window {key}: {what}")

        if f["capacity"] != self.settings.capacity:
            raise refuse(f"capacity {f['capacity']}; this producer packs capacity "
                         f"{self.settings.capacity}")
        documents = len(window.start)
        if not np.array_equal(occurrences["ordinal"], np.arange(documents)):
            raise refuse(f"{len(occurrences)} occurrence records do not hold each of the "
                         f"window's {documents} documents exactly once, in order")
        if not plan_matches_window(occurrences, window.start, window.stop, window.source_id,
                                   window.example_id):
            raise refuse("the occurrences' ranges or source and example ids are not those "
                         "of the window's documents")
        if sizes.ndim != 1 or len(sizes) == 0 or (sizes <= 0).any() or sizes.sum() != documents:
            raise refuse(f"batch sizes {sizes.tolist()[:8]}... must be positive and add up "
                         f"to the window's {documents} documents")
        batches = []
        ends = np.cumsum(sizes)
        for first, last in zip((ends - sizes).tolist(), ends.tolist()):
            rows = int(occurrences["row"][last - 1]) + 1
            if rows > self.settings.max_rows_per_batch:
                raise refuse(f"batch {len(batches)} has {rows} rows; max_rows_per_batch is "
                             f"{self.settings.max_rows_per_batch}")
            batch = CompactBatch(tokens=window.selected_tokens(first, last),
                                 occurrences=occurrences[first:last], rows=rows,
                                 capacity=f["capacity"], binding=self.binding,
                                 sources=window.source_index[first:last])
            try:
                batches.append(batch.checked(max_cells=rows * f["capacity"]))
            except InvalidArray as exc:
                raise refuse(f"batch {len(batches)}: {exc}") from None
        return batches

    # ------------------------------------------------------------------ ordering

    def _try_assemble(self) -> None:
        """Number the batches of complete windows, in window order."""
        while True:
            total = self.windows_in_epoch.get(self.asm_epoch)
            if total is not None and self.asm_window >= total:
                self.totals[self.asm_epoch] = self.asm_index
                if self.asm_index == 0 and self._end_epoch is None:
                    self._end_epoch = self.asm_epoch  # nothing packable: every epoch is empty
                self._drop_tail(self.asm_epoch)
                self._forget_old_epochs()
                self.asm_epoch += 1
                self.asm_window = 0
                self.asm_index = 0
                if not self._epoch_live(self.asm_epoch):
                    return
                continue
            key = (self.asm_epoch, self.asm_window)
            state = self.inflight.get(key)
            if state is None or state.expected is None or len(state.batches) < state.expected:
                return
            del self.inflight[key]
            self.window_bytes -= state.window.nbytes
            self.stats["windows_completed"] += 1
            counts = self.counts.setdefault(self.asm_epoch, [])
            if len(counts) == self.asm_window:
                counts.append(state.expected)
            for b in range(state.expected):
                batch = state.batches[b]
                index = self.asm_index + b
                gkey = (self.asm_epoch, index)
                if gkey in self.ready or self._below_floor(gkey) or self._past_tail(gkey):
                    self.reorder_bytes -= batch.nbytes
                    self.stats["replayed_dropped"] += 1
                    continue
                self.ready[gkey] = (batch, state.window.index, b)
            self.asm_index += state.expected
            self.asm_window += 1

    def _forget_old_epochs(self) -> None:
        """Drop the per-window counts and totals of epochs every rank has left behind,
        so an unbounded stream holds bookkeeping for a few epochs only. They are a
        shortcut: a replay of a forgotten epoch starts at its first window and recounts."""
        if self.world_size is None or len(self.floors) < self.world_size:
            return
        oldest = min(floor[0] for floor in self.floors.values()) - 1
        for table in (self.counts, self.totals, self.windows_in_epoch):
            for epoch in [e for e in table if e < oldest]:
                del table[epoch]

    def _below_floor(self, key: tuple[int, int]) -> bool:
        """True when no consumer of this batch's rank can still ask for it: the rank has
        moved past it and none of its pending fetches is at or before it."""
        if self.world_size is None:
            return False
        rank = key[1] % self.world_size
        floor = self.floors.get(rank)
        if floor is None or key >= floor:
            return False
        return not any(k <= key and k[1] % self.world_size == rank for k in self.pending)

    def _limit(self, epoch: int) -> int | None:
        total = self.totals.get(epoch)
        if total is None or self.world_size is None:
            return None
        w = self.world_size
        per_rank = -(-total // w) if self.settings.tail == "fill" else total // w
        return per_rank * w

    def _past_tail(self, key: tuple[int, int]) -> bool:
        limit = self._limit(key[0])
        return limit is not None and key[1] >= limit

    def _drop_tail(self, epoch: int) -> None:
        limit = self._limit(epoch)
        if limit is None:
            return
        for key in [k for k in self.ready if k[0] == epoch and k[1] >= limit]:
            batch, _, _ = self.ready.pop(key)
            self.reorder_bytes -= batch.nbytes

    def _rewind(self, epoch: int, index: int) -> None:
        """Restart the pipeline at the window of ``epoch`` that holds batch ``index``."""
        counts = self.counts.get(epoch, [])
        window, base = 0, 0
        for count in counts:
            if base + count > index:
                break
            base += count
            window += 1
        self.stats["rewinds"] += 1
        self.log(f"producer: replaying from epoch {epoch} window {window} (batch {base})")
        for state in self.inflight.values():
            self.reorder_bytes -= state.batch_bytes
        self.inflight.clear()
        self.reissue.clear()
        self.window_bytes = 0
        for worker in self.workers.values():
            worker.windows.clear()
        self.asm_epoch, self.asm_window, self.asm_index = epoch, window, base
        self._reset_cutter(epoch, window)

    # ------------------------------------------------------------------ consumers

    def _on_consumer(self, socket: zmq.Socket, frames: list[Any]) -> None:
        identity = bytes(frames[0].bytes) if hasattr(frames[0], "bytes") else bytes(frames[0])
        try:
            message = wire.decode(frames[1:], self.limits)
            if message.kind == "health":
                self._send(socket, identity, "status", {"serving": True, "stats": self.snapshot()})
                return
            if message.kind != "fetch":
                raise ProtocolError(f"a producer's consumer endpoint accepts 'fetch' and "
                                    f"'health', not {message.kind!r}")
            self._on_fetch(identity, message.fields)
        except ProtocolError as exc:
            self.stats["rejected_consumer"] += 1
            self.log(f"producer: rejected a consumer message: {exc}")
            self._send(socket, identity, "error", {"message": str(exc)[:1000]})

    def _on_fetch(self, identity: bytes, f: dict[str, Any]) -> None:
        rank, world, epoch, index = f["rank"], f["world_size"], f["epoch"], f["index"]
        count = f["count"]
        if (not (0 <= rank < world <= 1 << 16) or epoch < 0 or index < 0
                or index % world != rank or not 1 <= count <= MAX_PENDING_PER_CONSUMER):
            raise ProtocolError(
                f"fetch rank={rank} world_size={world} epoch={epoch} index={index} "
                f"count={count}: need 0 <= rank < world_size <= 65536, epoch >= 0, "
                f"index = rank mod world_size and 1 <= count <= {MAX_PENDING_PER_CONSUMER}"
            )
        if self.world_size is None:
            self.world_size = world
            for e in list(self.totals):
                self._drop_tail(e)
        elif world != self.world_size:
            raise ProtocolError(
                f"world_size {world} differs from the {self.world_size} this producer "
                f"serves; restart the producer to change the world size"
            )
        if self.pending_count[identity] + count > MAX_PENDING_PER_CONSUMER:
            raise ProtocolError(
                f"more than {MAX_PENDING_PER_CONSUMER} fetches outstanding from one consumer"
            )
        for key in [(epoch, index + k * world) for k in range(count)]:
            floor = self.floors.get(rank)
            if floor is None or key < floor:
                self.floors[rank] = key
            if key not in self.pending:
                self.fetched_at[key] = time.monotonic()
            self.pending.setdefault(key, []).append(identity)
            self.pending_count[identity] += 1
            if not self.started:
                self.started = True
                if epoch > 0 and self._epoch_live(epoch):
                    self._rewind(epoch, 0)
            elif self._epoch_live(epoch) and key not in self.ready and self._behind(key):
                if not (self._limit(epoch) is not None and key[1] >= self.totals[epoch]):
                    self._rewind(epoch, key[1])

    def _behind(self, key: tuple[int, int]) -> bool:
        return key < (self.asm_epoch, self.asm_index)

    def _send(self, socket: zmq.Socket, identity: bytes, kind: str, fields: dict[str, Any],
              arrays: dict[str, Any] | None = None) -> None:
        socket.send_multipart([identity, *wire.encode(kind, fields, arrays)], copy=False)

    def _filler(self) -> list[Any]:
        if self._filler_frames is None:
            batch = CompactBatch.filler_like(
                self.binding, self.settings.max_rows_per_batch, self.settings.capacity
            )
            self._filler_frames = list(wire.batch_arrays(batch).items())
            self._filler_shape = wire.batch_shape(batch)
        return self._filler_frames

    def _serve_pending(self, socket: zmq.Socket) -> None:
        for key in list(self.pending):
            epoch, index = key
            identities = self.pending[key]
            if not self._epoch_live(epoch):
                for identity in identities:
                    self._send(socket, identity, "stream_end", {"epochs": self.settings.epochs})
            else:
                limit = self._limit(epoch)
                if limit is not None and index >= limit:
                    per_rank = limit // self.world_size
                    for identity in identities:
                        self._send(socket, identity, "epoch_end", {
                            "epoch": epoch, "per_rank": per_rank, "total": self.totals[epoch]})
                    rank = index % self.world_size
                    nxt = (epoch + 1, rank)
                    if self.floors.get(rank, nxt) < nxt:
                        self.floors[rank] = nxt
                elif limit is not None and index >= self.totals[epoch]:
                    frames = dict(self._filler())
                    fields = {"epoch": epoch, "index": index, "window": -1, "batch": -1,
                              "filler": True, "binding": self.binding_wire} | self._filler_shape
                    for identity in identities:
                        self._send(socket, identity, "batch", fields, frames)
                    self.stats["fillers_served"] += 1
                    self._advance_floor(key)
                elif key in self.ready:
                    batch, window, number = self.ready.pop(key)
                    self.reorder_bytes -= batch.nbytes
                    fields = {"epoch": epoch, "index": index, "window": window,
                              "batch": number, "filler": False, "binding": self.binding_wire,
                              } | wire.batch_shape(batch)
                    for identity in identities:
                        self._send(socket, identity, "batch", fields, wire.batch_arrays(batch))
                    self.stats["batches_served"] += 1
                    self.stats["tokens_served"] += batch.real_tokens
                    self.stats["cells_served"] += batch.rows * batch.capacity
                    self.tokens_by_rank[index % self.world_size] += batch.real_tokens
                    self._count_sources(batch)
                    self._advance_floor(key)
                else:
                    continue
            del self.pending[key]
            asked = self.fetched_at.pop(key, None)
            if self.metrics is not None and asked is not None:
                self.metrics.observe_serve(time.monotonic() - asked)
            for identity in identities:
                self.pending_count[identity] -= 1
                if self.pending_count[identity] <= 0:
                    del self.pending_count[identity]

    def _count_sources(self, batch: CompactBatch) -> None:
        occ = batch.occurrences
        lengths = (occ["stop"] - occ["start"]).astype(np.int64)
        tokens = np.bincount(batch.sources, weights=lengths)
        documents = np.bincount(batch.sources)
        for source in np.flatnonzero(documents).tolist():
            self.tokens_by_source[source] += int(tokens[source])
            self.documents_by_source[source] += int(documents[source])

    def _advance_floor(self, key: tuple[int, int]) -> None:
        rank = key[1] % self.world_size
        nxt = (key[0], key[1] + self.world_size)
        if self.floors.get(rank, nxt) < nxt:
            self.floors[rank] = nxt

    # ------------------------------------------------------------------ loop

    def snapshot(self) -> dict[str, Any]:
        stats = dict(self.stats)
        stats.update(
            workers=len(self.workers),
            windows_in_flight=len(self.inflight),
            window_bytes=self.window_bytes,
            reorder_bytes=self.reorder_bytes,
            ready_batches=len(self.ready),
            pending_fetches=sum(len(v) for v in self.pending.values()),
            quarantine_reasons=dict(self.quarantine_reasons),
            tokens_served_by_rank={str(r): n for r, n in sorted(self.tokens_by_rank.items())},
            tokens_served_by_source={str(k): n for k, n in sorted(self.tokens_by_source.items())},
            documents_served_by_source={
                str(k): n for k, n in sorted(self.documents_by_source.items())},
            epoch=self.asm_epoch,
        )
        return {k: (float(v) if isinstance(v, float) else v) for k, v in stats.items()}

    def stop(self) -> None:
        self.stopping = True

    def run(self, *, ready_callback: Any = None, local_worker_endpoint: str | None = None) -> int:
        """Serve until ``stop()``. ``local_worker_endpoint`` (e.g. an ``ipc://`` path) is
        bound for workers in addition to the configured one: ``serve`` connects its own
        workers there, off the TCP stack."""
        # Load the kernels that check workers' plans before the first one arrives.
        examples, batch = warm_up_kernels()
        occurrences = batch.occurrences.copy()
        occurrences.flags.writeable = False  # as decoded from a worker's message
        plan_matches_window(occurrences, examples.start, examples.stop,
                            examples.source_id, examples.example_id)
        metrics_server = None
        if self.settings.metrics_port is not None:
            from streampack.service.metrics import MetricsServer, ProducerMetrics

            self.metrics = ProducerMetrics(
                self.snapshot, window_budget_bytes=self.settings.window_budget_bytes,
                reorder_budget_bytes=self.settings.reorder_budget_bytes)
            metrics_server = MetricsServer(self.metrics.registry, self.settings.metrics_port,
                                           self.settings.metrics_address)
        context = zmq.Context()
        workers = context.socket(zmq.ROUTER)
        consumers = context.socket(zmq.ROUTER)
        try:
            for socket, field, endpoint in (
                (workers, "worker_endpoint", self.settings.worker_endpoint),
                (consumers, "consumer_endpoint", self.settings.consumer_endpoint),
            ):
                wire.configure_socket(socket, self.settings.max_message_bytes)
                if self.curve_secret is not None:
                    wire.curve_server(socket, self.curve_secret)
                wire.attach(socket, endpoint, field=field, bind=True)
            if local_worker_endpoint is not None:
                wire.attach(workers, local_worker_endpoint, field="local worker endpoint",
                            bind=True)
            self.serving = True
            self.log(
                f"producer: serving workers on {workers.getsockopt(zmq.LAST_ENDPOINT).decode()} "
                f"and consumers on {consumers.getsockopt(zmq.LAST_ENDPOINT).decode()}"
            )
            if ready_callback is not None:
                ready_callback(
                    workers.getsockopt(zmq.LAST_ENDPOINT).decode(),
                    consumers.getsockopt(zmq.LAST_ENDPOINT).decode(),
                )
            poller = zmq.Poller()
            poller.register(workers, zmq.POLLIN)
            poller.register(consumers, zmq.POLLIN)
            next_check = time.monotonic()
            while not self.stopping:
                events = dict(poller.poll(100))
                for _ in range(256):
                    if workers not in events:
                        break
                    try:
                        frames = workers.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_worker(workers, frames)
                for _ in range(256):
                    if consumers not in events:
                        break
                    try:
                        frames = consumers.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_consumer(consumers, frames)
                now = time.monotonic()
                if now >= next_check:
                    self._check_heartbeats()
                    next_check = now + min(0.25, self.settings.heartbeat_timeout / 4)
                self._assign(workers)
                self._serve_pending(consumers)
        finally:
            self.serving = False
            workers.close(linger=0)
            consumers.close(linger=0)
            context.term()
            if self._quarantine_file is not None:
                self._quarantine_file.close()
            if metrics_server is not None:
                metrics_server.close()
        return 0


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
