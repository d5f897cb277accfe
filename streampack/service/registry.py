"""The producer's table of pack workers: credit, liveness, the windows each one holds.

A worker is known by its socket identity. Its record says how many more windows it
asked for (credit), when it was last heard from, which windows it holds and since when
(each window handed out has a deadline, ``window_timeout`` after that), which of those
another worker answered first (a backup copy won: its own answer, when it comes, is a
duplicate), which windows were taken back from it (its late answers for those are
stale, not hostile), and whether it has *proven* itself by answering a window with
exactly the contract's plan.

A window outrun by a backup stays held, deadline and all: a slow worker is not
punished for being slow (its late answer is dropped as a duplicate, and it goes on),
but a hung one still misses the deadline and is dropped, and until then the window
it sits on keeps its slot, so it cannot take one window after another and hang on
each.

Why "proven" matters: a window whose worker disappears is reissued; a window that
keeps killing the workers that pack it is eventually quarantined (``MAX_LOSSES``).
Only a loss that says something about the window may count toward that rule, or a
wave of peers that register and vanish could quarantine the whole stream. So a loss
counts only when (1) the worker had proven itself, i.e. it has answered at least one
window correctly (work the producer verified, which a flood of fake peers cannot
fake cheaply), and (2) the window was the *oldest* it held, the one it was packing
when it died (a worker packs its windows in the order it got them; the others were
only queued). An unproven worker gets one window at a time, whatever credit it
offers, so join-and-vanish peers also cannot take many windows out of circulation.

Every table here is bounded: at most ``max_workers`` records (silent ones expire after
``heartbeat_timeout``), at most ``max_credit`` windows per worker, a short memory of
windows taken back, and a bounded, expiring list of dropped identities.
"""

from __future__ import annotations

import collections
import dataclasses

WindowKey = tuple[int, int]  # (epoch, window)

#: Most windows one worker may hold (credit beyond it is clamped).
MAX_CREDIT = 64
#: Most workers registered at once.
MAX_WORKERS = 1024
#: (worker, window) pairs taken back that are remembered: late answers are stale.
RELEASED_MEMORY = 4096
#: A window is quarantined once this many proven workers died while packing it.
MAX_LOSSES = 5


@dataclasses.dataclass
class WorkerRecord:
    """One registered worker."""

    credit: int
    last_seen: float
    needs_tokens: bool = False  # it audits, so its windows carry their tokens
    # Windows it holds, in the order it got them, each with when it got it.
    held: dict[WindowKey, float] = dataclasses.field(default_factory=dict)
    # Those of them another worker answered first: the answer it owes is a duplicate.
    outrun: set[WindowKey] = dataclasses.field(default_factory=set)
    completed: int = 0  # windows answered with exactly the contract's plan

    @property
    def proven(self) -> bool:
        return self.completed > 0

    @property
    def capacity(self) -> int:
        """Windows it may be given now: its credit, one at a time until proven."""
        if not self.proven:
            return max(0, min(self.credit, 1 - len(self.held)))
        return self.credit


class WorkerRegistry:
    """The registered workers (see module docstring). Plain state, no sockets."""

    def __init__(
        self,
        *,
        heartbeat_timeout: float,
        window_timeout: float,
        max_workers: int = MAX_WORKERS,
        max_credit: int = MAX_CREDIT,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.window_timeout = window_timeout
        self.max_workers = max_workers
        self.max_credit = max_credit
        self.workers: dict[bytes, WorkerRecord] = {}
        # Identities dropped for missing a deadline, ignored until the time given.
        self.dropped: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        # Windows taken back from a worker, or held by one that was forgotten: an
        # answer about one of them is late, not hostile (oldest forgotten first).
        self.released: collections.OrderedDict[tuple[bytes, WindowKey], None] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, identity: bytes) -> WorkerRecord | None:
        return self.workers.get(identity)

    def is_dropped(self, identity: bytes, now: float) -> bool:
        until = self.dropped.get(identity)
        if until is None:
            return False
        if until <= now:
            del self.dropped[identity]
            return False
        return True

    def register(self, identity: bytes, now: float) -> WorkerRecord | None:
        """The record of ``identity``, created if new; None when the table is full of
        workers that hold windows or have proven themselves (newcomers wait)."""
        worker = self.workers.get(identity)
        if worker is not None:
            worker.last_seen = now
            return worker
        if len(self.workers) >= self.max_workers:
            idle = [i for i, w in self.workers.items() if not w.proven and not w.held]
            if not idle:
                return None
            del self.workers[min(idle, key=lambda i: self.workers[i].last_seen)]
        worker = WorkerRecord(credit=0, last_seen=now)
        self.workers[identity] = worker
        return worker

    def offer(self, worker: WorkerRecord, credit: int) -> bool:
        """Add ``credit`` (a checked non-negative int); False when it was clamped."""
        total = worker.credit + credit
        worker.credit = min(total, self.max_credit - len(worker.held))
        return total <= self.max_credit - len(worker.held)

    def give(self, identity: bytes, key: WindowKey, now: float) -> None:
        worker = self.workers[identity]
        worker.credit -= 1
        worker.held[key] = now
        worker.outrun.discard(key)  # a replay handed the same window out again

    def answer(self, identity: bytes, key: WindowKey) -> str:
        """Account for an answer (``packed``/``failed``) about ``key`` from ``identity``:
        "oldest" (it held the window, and got it before any other it holds: the one it
        was packing), "held" (it held it; no longer), "duplicate" (it held it, but a
        backup copy was answered first), "stale" (the window was taken back from it: a
        late answer) or "foreign" (it never held it)."""
        worker = self.workers.get(identity)
        if worker is not None and key in worker.held:
            oldest = next(iter(worker.held)) == key
            del worker.held[key]
            if key in worker.outrun:
                worker.outrun.discard(key)
                return "duplicate"
            return "oldest" if oldest else "held"
        return "stale" if self.released.pop((identity, key), 0) is None else "foreign"

    def outrun(self, identity: bytes, key: WindowKey) -> None:
        """Another worker answered ``key`` first: ``identity`` keeps holding it (the
        deadline still applies) and its answer will be a duplicate."""
        worker = self.workers.get(identity)
        if worker is not None and key in worker.held:
            worker.outrun.add(key)

    def lagging(self, identity: bytes, now: float, after: float) -> bool:
        """Whether the worker holds a window it was given ``after`` seconds ago or more
        (no backup copy goes to a worker that may be the slow one)."""
        worker = self.workers.get(identity)
        return worker is not None and any(now - t >= after for t in worker.held.values())

    def _remember_released(self, identity: bytes, key: WindowKey) -> None:
        self.released[(identity, key)] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)

    def take_back(self, identity: bytes, key: WindowKey) -> None:
        """The window is no longer this worker's (rewind, deadline): a late answer is stale."""
        worker = self.workers.get(identity)
        if worker is not None and worker.held.pop(key, None) is not None:
            worker.outrun.discard(key)
            self._remember_released(identity, key)

    def silent(self, now: float) -> list[bytes]:
        """Workers not heard from for ``heartbeat_timeout``."""
        limit = now - self.heartbeat_timeout
        return [i for i, w in self.workers.items() if w.last_seen < limit]

    def overdue(self, now: float) -> list[tuple[bytes, WindowKey]]:
        """(worker, window) pairs whose deadline has passed."""
        limit = now - self.window_timeout
        return [
            (identity, key)
            for identity, worker in self.workers.items()
            for key, given in worker.held.items()
            if given <= limit
        ]

    def forget(self, identity: bytes) -> tuple[list[WindowKey], WindowKey | None]:
        """Remove a worker. Returns the windows it held and the one a loss counts
        against: its oldest, when it had proven itself (see module docstring)."""
        worker = self.workers.pop(identity, None)
        if worker is None:
            return [], None
        held = list(worker.held)
        for key in held:
            self._remember_released(identity, key)
        blamed = held[0] if held and worker.proven else None
        return held, blamed

    def drop(
        self, identity: bytes, now: float, for_seconds: float
    ) -> tuple[list[WindowKey], WindowKey | None]:
        """``forget`` a worker that missed a deadline, and ignore it for ``for_seconds``
        (its messages are counted and dropped: it cannot take windows again at once)."""
        result = self.forget(identity)
        self.dropped[identity] = now + for_seconds
        self.dropped.move_to_end(identity)
        while len(self.dropped) > self.max_workers:
            self.dropped.popitem(last=False)
        return result

    def with_capacity(self) -> list[tuple[bytes, WorkerRecord]]:
        return [(i, w) for i, w in self.workers.items() if w.capacity > 0]
