"""The producer's counters: one object, read alike by ``health``, the stop line and metrics.

Every counter is a plain non-negative integer (``pack_seconds`` is the one float, a
sum of finite, range-checked durations). Numbers a peer reports pass through
:meth:`ProducerCounters.add_reported`, which refuses anything outside its range before
it touches a counter: a peer can neither overflow a counter, make one negative, nor
store a NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..errors import InternalError, ProtocolError

#: Ranks counted apart in ``tokens_served_by_rank`` (a peer chooses its rank: bounded).
MAX_RANK_KEYS = 1024


@dataclasses.dataclass
class ProducerCounters:
    """What happened since the producer started. Field names are the ``health`` keys."""

    workers_joined: int = 0  # identities registered as pack workers
    workers_lost: int = 0  # workers silent for heartbeat_timeout
    workers_dropped: int = 0  # workers that missed a window deadline
    windows_cut: int = 0
    windows_issued: int = 0  # window messages sent (first issues and reissues)
    windows_reissued: int = 0
    windows_completed: int = 0  # windows whose batches were numbered
    windows_failed: int = 0  # windows quarantined whole
    windows_overdue: int = 0  # windows taken back at their deadline
    windows_backed_up: int = 0  # backup copies of overdue windows handed to another worker
    backup_wins: int = 0  # windows whose first answer that passed the plan check was a copy's
    windows_failed_by_worker: int = 0  # 'failed' answers (the contract plans the window)
    plans_refused: int = 0  # plans that were not exactly the contract's
    batches_received: int = 0
    batches_served: int = 0
    fillers_served: int = 0
    tokens_served: int = 0
    supervised_targets_served: int = 0  # loss-eligible targets (rule C5) of those tokens
    cells_served: int = 0  # rows x capacity of the batches served (not fillers)
    duplicates_dropped: int = 0
    stale_dropped: int = 0  # late answers for windows taken back (rewind, deadline)
    replayed_dropped: int = 0  # replayed batches no consumer can still ask for
    evicted: int = 0  # ready batches dropped to make room for a batch someone waits for
    rewinds: int = 0
    resends_dropped: int = 0  # fetches for batches just answered to the same consumer
    # data_plane = "workers": batches sent as a route to the worker holding them, routes
    # a consumer gave up on (it then got the batch from the producer), and of those the
    # ones whose frames did not match the producer's digest (the worker is no longer
    # routed to).
    batches_routed: int = 0
    batches_rerouted: int = 0
    worker_batches_refused: int = 0
    workers_refused_serving: int = 0
    rejected_worker: int = 0
    rejected_consumer: int = 0
    peer_errors: int = 0  # 'error' messages received (never answered)
    credit_clamped: int = 0  # credit offers above the most a worker may hold
    consumers_dropped: int = 0  # consumers gone (unreachable, silent or over the bound)
    quarantined: int = 0  # documents
    documents_split: int = 0  # long documents of a split source cut into ranges
    pairs_cut: int = 0  # prediction pairs lost at those cuts
    ranges_unsupervised: int = 0  # ranges of those cuts with no supervised target, dropped
    audited: int = 0
    audit_failures: int = 0
    window_bytes_peak: int = 0
    reorder_bytes_peak: int = 0
    # Bytes of every message the producer's sockets accepted for a peer (header and
    # frames): what the data path costs its network card.
    bytes_sent_to_workers: int = 0
    bytes_sent_to_consumers: int = 0
    pack_seconds: float = 0.0
    quarantine_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    # str(rank) -> real tokens / supervised targets served to that rank; ranks from
    # MAX_RANK_KEYS on share a key.
    tokens_served_by_rank: dict[str, int] = dataclasses.field(default_factory=dict)
    supervised_targets_served_by_rank: dict[str, int] = dataclasses.field(default_factory=dict)
    # str(mixture source index) -> tokens / supervised targets / documents served (one
    # source: "0"). Bounded by the manifest's sources: the producer counts what it sends,
    # not what peers say.
    tokens_served_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    supervised_targets_served_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    documents_served_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    last_audit_error: str = ""

    def add(self, name: str, amount: int = 1) -> None:
        """Add a non-negative amount the producer itself counted."""
        if amount < 0:
            raise InternalError(f"counter {name} cannot decrease (amount {amount})")
        setattr(self, name, getattr(self, name) + amount)

    def peak(self, name: str, value: int) -> None:
        if value > getattr(self, name):
            setattr(self, name, value)

    def add_reported(self, name: str, value: Any, maximum: float) -> None:
        """Add a number a peer reported, after checking it is finite and in ``0..maximum``.

        Raises ``ProtocolError`` (naming the field, the value and the accepted range)
        and leaves every counter as it was otherwise.
        """
        check_reported(name, value, maximum)
        setattr(self, name, getattr(self, name) + value)

    def quarantine(self, reason: str) -> None:
        self.quarantined += 1
        self.quarantine_reasons[reason] = self.quarantine_reasons.get(reason, 0) + 1

    def served_to_rank(self, rank: int, tokens: int, supervised_targets: int) -> None:
        """Count one served batch by the rank it went to: its real tokens and its
        supervised targets."""
        key = str(rank) if rank < MAX_RANK_KEYS else f"{MAX_RANK_KEYS}+"
        _count(self.tokens_served_by_rank, key, tokens)
        _count(self.supervised_targets_served_by_rank, key, supervised_targets)

    def served_by_source(
        self, sources: np.ndarray, lengths: np.ndarray, supervised_targets: np.ndarray
    ) -> None:
        """Count one served batch by mixture source: ``sources``, ``lengths`` (pairs) and
        ``supervised_targets`` per occurrence."""
        documents = np.bincount(sources)
        tokens = np.bincount(sources, weights=lengths)
        supervised = np.bincount(sources, weights=supervised_targets)
        for source in np.flatnonzero(documents).tolist():
            key = str(source)
            _count(self.documents_served_by_source, key, int(documents[source]))
            _count(self.tokens_served_by_source, key, int(tokens[source]))
            _count(self.supervised_targets_served_by_source, key, int(supervised[source]))

    def as_dict(self) -> dict[str, Any]:
        """Every counter by name (a fresh dict, safe to extend, to encode and to read
        from another thread, e.g. the metrics server's)."""
        out = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for name, value in out.items():
            if isinstance(value, dict):  # quarantine_reasons and the by-rank/by-source ones
                out[name] = dict(value)
        return out


def _count(table: dict[str, int], key: str, amount: int) -> None:
    table[key] = table.get(key, 0) + amount


def check_reported(name: str, value: Any, maximum: float) -> None:
    """Raise ``ProtocolError`` unless ``value`` is a finite number in ``0..maximum``."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0 <= value <= maximum
    )
    if not ok:
        raise ProtocolError(f"{name} = {value!r} is out of range; accepted: 0..{maximum}")
