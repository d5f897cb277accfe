"""The producer's pipeline: cut windows, track them in flight, number their batches in order.

Plain Python, no sockets: the producer's socket loop drives it, and so do unit tests.
For epoch ``e`` (windows numbered 0, 1, ... by ``sources.iter_windows``)::

    cut (epoch, w) ──▶ in flight {(e, w): WindowState}
       │ its contract plan computed at once (plan_check.contract_plan): a window the
       │ contract cannot pack, or with no document left, never goes to a worker
       ▼
    a worker answers with exactly that plan ──▶ the window's batches (their plans
       │ over the producer's own copy of the window: planned.py, nothing gathered)
       ▼
    assemble in window order: global index g = batches of windows < w + batch number
       ──▶ Assembled(e, g, batch, w, b) events for the delivery part

State (every field below is all there is):

- ``cut_epoch``/``cut_next``: the next window to cut; ``windows_in_epoch[e]``: how
  many windows epoch ``e`` has, once cut to its end.
- ``inflight``: windows cut and not yet numbered, each with the workers holding it
  and since when; ``reissue``: those of them waiting for a worker (sorted, lowest
  first); ``backups``: those overdue for a backup copy (see below), the one the
  stream waits on first. ``window_bytes`` (windows and their plans) and
  ``received_bytes`` (batches of answered windows not yet numbered) are what they
  hold. ``durations``: how long the last ``RECENT_WINDOWS`` answered windows took,
  from hand-out to the first answer that passed the plan check.
- ``asm_epoch``/``asm_window``/``asm_index``: the next window to number and the global
  index its first batch gets (the *assembly point*). ``counts[e]``: batches per
  numbered window; ``totals[e]``: the batches of a finished epoch. Both are kept for
  a few recent epochs only; they are a shortcut for a rewind, which without them
  starts at the epoch's first window.

A *rewind* to (epoch, index) restarts the pipeline at the window holding that batch:
windows in flight are forgotten (their late answers are stale), and numbering replays
identically, because windows depend on the corpus and settings alone.

*Backups* (speculative copies, as MapReduce's backup tasks and Spark's speculation):
a window whose latest copy was handed out ``backup_threshold()`` seconds ago or more
— ``BACKUP_P95_FACTOR`` times the p95 of ``durations``, at least ``backup_after`` —
goes to one more worker, up to ``MAX_COPIES`` at once, the window at the assembly
point (the one the ordered stream waits on) first. The first answer that passes the
plan check is the window's; the others are duplicates. Any answer that passes is the
contract's plan, so which copy wins never shows in the output::

    t=0    window 7 ─▶ worker A            (A hangs, heartbeating)
    t=1.0  7 overdue: a copy ─▶ worker B   windows_backed_up += 1
    t=1.0+ B answers, the plan passes      backup_wins += 1; 7 is numbered
    later  A answers: a duplicate, dropped (duplicates_dropped) — or A never does,
           and at window_timeout it is dropped for the deadline, as without backups
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from ..config import PackConfig
from ..examples import Binding
from ..windows import CutSpec, Window, iter_windows
from .counters import ProducerCounters
from .plan_check import ContractPlan, contract_plan
from .planned import PlannedBatch, plan_batches
from .registry import MAX_LOSSES

WindowKey = tuple[int, int]
#: Epochs whose per-window batch counts are kept for rewinds.
KEPT_EPOCHS = 4
#: Epochs whose batch totals are kept (the tail answers of consumers far behind).
KEPT_TOTALS = 1024
#: Workers that may hold one window at once: the first and up to two backup copies.
MAX_COPIES = 3
#: Answered windows whose durations decide when a window is overdue for a backup.
RECENT_WINDOWS = 64
#: A window is overdue for a backup at this many times the recent p95 (or backup_after).
BACKUP_P95_FACTOR = 4.0


@dataclasses.dataclass
class WindowState:
    """One window cut and not yet numbered."""

    window: Window
    plan: ContractPlan
    # The workers packing it, each with when it was handed the window (at most
    # MAX_COPIES); those that got it as a backup copy are also in ``backups``.
    holders: dict[bytes, float] = dataclasses.field(default_factory=dict)
    backups: set[bytes] = dataclasses.field(default_factory=set)
    last_holder: bytes | None = None  # reissues prefer another worker
    losses: int = 0  # proven workers that died, failed or overran while packing it
    batches: list[PlannedBatch] | None = None  # once answered (or known empty)
    batch_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + self.plan.nbytes

    @property
    def awaited(self) -> bool:
        """Held by some worker and not answered yet."""
        return bool(self.holders) and self.batches is None


@dataclasses.dataclass(frozen=True)
class Assembled:
    """Global batch ``index`` of ``epoch``: batch ``number`` of window ``window``."""

    epoch: int
    index: int
    batch: PlannedBatch
    window: int
    number: int


@dataclasses.dataclass(frozen=True)
class EpochTotal:
    """Epoch ``epoch`` has ``total`` batches (all numbered)."""

    epoch: int
    total: int


class Pipeline:
    """Cutting, windows in flight and assembly in window order (see module docstring)."""

    def __init__(
        self,
        source: Any,
        spec: CutSpec,
        config: PackConfig,
        binding: Binding,
        *,
        epochs: int,
        window_budget_bytes: int,
        quarantine: Callable[[list[dict[str, Any]]], None],
        counters: ProducerCounters,
        backup_after: float | None = None,
        window_timeout: float = math.inf,
    ) -> None:
        self.source = source
        self.counters = counters
        self.spec = spec
        self.config = config
        self.binding = binding
        self.epochs = epochs
        self.window_budget_bytes = window_budget_bytes
        self.quarantine = quarantine  # receives quarantine records, once per document
        self.backup_after = backup_after  # None: no backup copies
        self.window_timeout = window_timeout  # a backup later than the deadline is no backup

        self.cut_epoch = 0
        self.cut_next = 0
        self._cutter: Iterator[Window] | None = None
        self.windows_in_epoch: dict[int, int] = {}
        self.end_epoch: int | None = None  # set when the corpus turns out to be empty
        self._quarantine_mark: dict[int, int] = {}  # epoch -> windows recorded

        self.inflight: dict[WindowKey, WindowState] = {}
        self.reissue: list[WindowKey] = []
        self.backups: list[WindowKey] = []
        self.durations: collections.deque[float] = collections.deque(maxlen=RECENT_WINDOWS)
        self.window_bytes = 0
        self.received_bytes = 0

        self.asm_epoch = 0
        self.asm_window = 0
        self.asm_index = 0
        self.counts: dict[int, list[int]] = {}
        self.totals: dict[int, int] = {}

    # -- questions -----------------------------------------------------------------

    def epoch_live(self, epoch: int) -> bool:
        """Whether the stream has an epoch ``epoch`` at all."""
        if self.end_epoch is not None and epoch >= self.end_epoch:
            return False  # the corpus has no documents: an unbounded stream ends at once
        return self.epochs == 0 or epoch < self.epochs

    @property
    def assembly_point(self) -> tuple[int, int]:
        """(epoch, index) of the next batch to be numbered: everything before it has
        been numbered (and handed to delivery) since the last rewind."""
        return self.asm_epoch, self.asm_index

    def may_cut(self, ready_bytes: int, reorder_budget_bytes: int) -> bool:
        """A new window may be cut: nothing waits for reissue, the epoch exists, and the
        budgets have room (a first window always fits the window budget)."""
        if self.reissue or not self.epoch_live(self.cut_epoch):
            return False
        if self.received_bytes + ready_bytes >= reorder_budget_bytes:
            return False
        return not self.inflight or self.window_bytes < self.window_budget_bytes

    # -- cutting -------------------------------------------------------------------

    def _reset_cutter(self, epoch: int, window: int) -> None:
        self.cut_epoch = epoch
        self.cut_next = window
        self._cutter = iter_windows(self.source, epoch, self.spec, start_window=window)

    def cut(self) -> WindowState | None:
        """Cut the next window. None at the end of an epoch (assemble, then cut again:
        an epoch without batches ends the stream) and at the end of the stream. A
        window with no document left, or that the contract cannot pack (quarantined
        whole), comes back already complete (``batches == []``): no worker is needed."""
        if self.epoch_live(self.cut_epoch):
            if self._cutter is None:
                self._reset_cutter(self.cut_epoch, self.cut_next)
            assert self._cutter is not None
            window = next(self._cutter, None)
            if window is None:
                self.windows_in_epoch[self.cut_epoch] = self.cut_next
                if self.cut_next == 0 and self.end_epoch is None:
                    self.end_epoch = self.cut_epoch
                self._reset_cutter(self.cut_epoch + 1, 0)
                return None
            self.cut_next = window.index + 1
            self._record_screening(window)
            plan = contract_plan(window, self.config)
            state = WindowState(window=window, plan=plan)
            key = (window.epoch, window.index)
            self.inflight[key] = state
            self.window_bytes += state.nbytes
            if len(window.start) == 0:
                state.batches = []
            elif plan.error:
                self._quarantine_whole(state, plan.error)
            return state
        return None

    def _record_screening(self, window: Window) -> None:
        """Quarantine the documents screening dropped and count the documents split,
        once per window (not on replay)."""
        mark = self._quarantine_mark.get(window.epoch, 0)
        if window.index < mark:
            return
        self._quarantine_mark[window.epoch] = window.index + 1
        self.quarantine(window.quarantined)
        # Long documents of a long_documents = "split" source: counted once, like quarantine.
        self.counters.add("documents_split", window.documents_split)
        self.counters.add("pairs_cut", window.pairs_cut)
        self.counters.add("ranges_unsupervised", window.ranges_unsupervised)

    def _quarantine_whole(self, state: WindowState, error: str) -> None:
        window = state.window
        self.counters.add("windows_failed")
        self.quarantine(
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
        self.received_bytes -= state.batch_bytes
        state.batches = []
        state.batch_bytes = 0

    # -- windows and workers -------------------------------------------------------

    def next_reissue(self, identity: bytes, alone: bool) -> WindowState | None:
        """The lowest window awaiting reissue that ``identity`` may take: not one it
        was last given, unless it is the only worker with room (``alone``)."""
        for position, key in enumerate(self.reissue):
            state = self.inflight.get(key)
            if state is None or state.holders or state.batches is not None:
                continue
            if state.last_holder == identity and not alone:
                continue
            del self.reissue[position]
            return state
        self.reissue = [
            k
            for k in self.reissue
            if k in self.inflight
            and not self.inflight[k].holders
            and self.inflight[k].batches is None
        ]
        return None

    def backup_threshold(self) -> float:
        """Seconds after which a window's latest copy is overdue for another:
        ``BACKUP_P95_FACTOR`` times the p95 of the recent windows, at least
        ``backup_after`` (infinite when backups are off)."""
        if self.backup_after is None:
            return math.inf
        if not self.durations:
            return self.backup_after
        recent = sorted(self.durations)
        p95 = recent[math.ceil(0.95 * len(recent)) - 1]
        return max(self.backup_after, BACKUP_P95_FACTOR * p95)

    def plan_backups(self, now: float) -> float:
        """List the windows overdue for a backup copy (``backups``): the one at the
        assembly point first, then in window order. Returns the threshold used."""
        threshold = self.backup_threshold()
        if threshold >= self.window_timeout:
            self.backups = []  # the deadline comes first: it reissues the window
            return threshold
        head = (self.asm_epoch, self.asm_window)
        self.backups = sorted(
            (
                key
                for key, state in self.inflight.items()
                if state.awaited
                and len(state.holders) < MAX_COPIES
                and now - max(state.holders.values()) >= threshold
            ),
            key=lambda key: (key != head, key),
        )
        return threshold

    def next_backup(self, identity: bytes) -> WindowState | None:
        """The first window overdue for a backup that ``identity`` does not hold."""
        for position, key in enumerate(self.backups):
            state = self.inflight.get(key)
            if (
                state is None
                or not state.awaited
                or len(state.holders) >= MAX_COPIES
                or identity in state.holders
            ):
                continue
            del self.backups[position]
            return state
        return None

    def hand_to(self, state: WindowState, identity: bytes, now: float, *, backup: bool) -> None:
        """``identity`` packs the window from ``now`` (a ``backup`` copy: others hold it)."""
        state.holders[identity] = now
        state.last_holder = identity
        if backup:
            state.backups.add(identity)
            self.counters.add("windows_backed_up")

    def release(self, key: WindowKey, identity: bytes, *, loss: bool, why: str) -> None:
        """``identity`` lost ``key`` (died, overran its deadline, reported failure, sent
        an unusable plan). With ``loss`` (a proven worker, see registry) it counts
        toward ``MAX_LOSSES``: the window is quarantined whole when it reaches it, else
        it is reissued once no other worker holds a copy."""
        state = self.inflight.get(key)
        if state is None or state.batches is not None:
            return
        state.holders.pop(identity, None)
        state.backups.discard(identity)
        if loss:
            state.losses += 1
            if state.losses >= MAX_LOSSES:
                self._quarantine_whole(
                    state, f"{state.losses} workers were lost packing this window; last: {why}"
                )
                return
        if not state.holders and key not in self.reissue:
            bisect.insort(self.reissue, key)

    def accept(self, key: WindowKey, identity: bytes, now: float) -> int:
        """``identity`` answered ``key`` first, with the contract's plan: its batches
        are built from the producer's own plan and window. Returns how many."""
        state = self.inflight[key]
        batches = plan_batches(
            state.window,
            state.plan,
            self.binding,
            self.config.capacity,
            self.config.max_rows_per_batch,
            self.config.policy,
        )
        self.durations.append(max(0.0, now - state.holders.pop(identity)))
        if identity in state.backups:
            self.counters.add("backup_wins")
        state.batches = batches
        state.batch_bytes = sum(batch.nbytes for batch in batches)
        self.received_bytes += state.batch_bytes
        return len(batches)

    def outrun(self, key: WindowKey) -> list[bytes]:
        """The workers still holding ``key`` once it is answered or quarantined (their
        answers will be duplicates); forgotten here."""
        state = self.inflight.get(key)
        if state is None or state.batches is None:
            return []
        others = list(state.holders)
        state.holders.clear()
        state.backups.clear()
        return others

    # -- assembly ------------------------------------------------------------------

    def assemble(self) -> list[Assembled | EpochTotal]:
        """Number the batches of the windows complete in order, past the assembly point."""
        events: list[Assembled | EpochTotal] = []
        while True:
            total = self.windows_in_epoch.get(self.asm_epoch)
            if total is not None and self.asm_window >= total:
                self.totals[self.asm_epoch] = self.asm_index
                if self.asm_index == 0 and self.end_epoch is None:
                    self.end_epoch = self.asm_epoch  # nothing packable: every epoch is empty
                events.append(EpochTotal(self.asm_epoch, self.asm_index))
                self._forget_old_epochs()
                self.asm_epoch += 1
                self.asm_window = 0
                self.asm_index = 0
                if not self.epoch_live(self.asm_epoch):
                    return events
                continue
            key = (self.asm_epoch, self.asm_window)
            state = self.inflight.get(key)
            if state is None or state.batches is None:
                return events
            del self.inflight[key]
            self.counters.add("windows_completed")
            self.window_bytes -= state.nbytes
            self.received_bytes -= state.batch_bytes
            counts = self.counts.setdefault(self.asm_epoch, [])
            if len(counts) == self.asm_window:
                counts.append(len(state.batches))
            for number, batch in enumerate(state.batches):
                events.append(
                    Assembled(
                        self.asm_epoch, self.asm_index + number, batch, self.asm_window, number
                    )
                )
            self.asm_index += len(state.batches)
            self.asm_window += 1

    def numbered(self, epoch: int) -> int:
        """Batches of ``epoch`` numbered so far (since the last rewind)."""
        if epoch < self.asm_epoch:
            return self.totals.get(epoch, 0)
        return self.asm_index if epoch == self.asm_epoch else 0

    def _forget_old_epochs(self) -> None:
        oldest = self.asm_epoch - KEPT_EPOCHS + 1
        for table in (self.counts, self.windows_in_epoch, self._quarantine_mark):
            for epoch in [e for e in table if e < oldest]:
                del table[epoch]
        for epoch in [e for e in self.totals if e < self.asm_epoch - KEPT_TOTALS]:
            del self.totals[epoch]  # one integer per epoch: kept much longer

    def rewind(self, epoch: int, index: int) -> tuple[int, list[tuple[bytes, WindowKey]]]:
        """Restart at the window of ``epoch`` holding batch ``index`` (window 0 when that
        epoch's counts are not known). Returns the global index of that window's first
        batch and the (worker, window) pairs taken back from their workers."""
        window, base = 0, 0
        for count in self.counts.get(epoch, []):
            if base + count > index:
                break
            base += count
            window += 1
        taken = [(holder, key) for key, state in self.inflight.items() for holder in state.holders]
        self.inflight.clear()
        self.reissue.clear()
        self.backups.clear()
        self.window_bytes = 0
        self.received_bytes = 0
        self.asm_epoch, self.asm_window, self.asm_index = epoch, window, base
        self._reset_cutter(epoch, window)
        return base, taken
