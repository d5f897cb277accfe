"""A worker's store of the batches it serves to consumers. Plain Python, no sockets.

A worker that serves (``serve_endpoint``) keeps the compact batches of each window it
packs with its tokens, keyed ``(epoch, window, batch)`` — the window's own numbering,
which the worker knows (the global number ``g`` is the producer's). The store is
bounded three ways, so a consumer that never comes cannot make a worker grow:

- ``budget_bytes``: putting a batch past the budget drops the oldest entries first
  (counted ``dropped_for_room``); a batch larger than the whole budget is not kept;
- ``seconds``: an entry not fetched within that long is dropped (``expired``);
- an entry is dropped once delivered (``delivered``): a batch goes to one consumer once.

A batch not held is answered ``missing``, and the consumer takes it from the producer:
the store only ever saves work, never decides what a consumer receives.
"""

from __future__ import annotations

from collections import OrderedDict

from ..batch import CompactBatch

PartKey = tuple[int, int, int]  # (epoch, window, batch within the window)


class BatchStore:
    """Batches kept for consumers, oldest first, within a byte budget and a deadline."""

    def __init__(self, budget_bytes: int, seconds: float) -> None:
        self.budget_bytes = budget_bytes
        self.seconds = seconds
        self._entries: OrderedDict[PartKey, tuple[CompactBatch, float]] = OrderedDict()
        self.nbytes = 0
        self.counters = {
            "kept": 0,
            "delivered": 0,
            "missing": 0,
            "expired": 0,
            "dropped_for_room": 0,
        }

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: PartKey, batch: CompactBatch, now: float) -> None:
        if key in self._entries:  # a window packed again (a reissue or a backup copy)
            self._drop(key)
        if batch.nbytes > self.budget_bytes:
            self.counters["dropped_for_room"] += 1
            return
        while self._entries and self.nbytes + batch.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.counters["dropped_for_room"] += 1
        self._entries[key] = (batch, now + self.seconds)
        self.nbytes += batch.nbytes
        self.counters["kept"] += 1

    def take(self, key: PartKey, now: float) -> CompactBatch | None:
        """The batch ``key``, forgotten as it is handed out; None if not held."""
        self.expire(now)
        entry = self._entries.get(key)
        if entry is None:
            self.counters["missing"] += 1
            return None
        self._drop(key)
        self.counters["delivered"] += 1
        return entry[0]

    def expire(self, now: float) -> None:
        """Drop the entries whose deadline has passed (oldest first, so stop at the first
        that has not: every entry lives the same ``seconds``)."""
        while self._entries:
            key, (_, deadline) = next(iter(self._entries.items()))
            if deadline > now:
                break
            self._drop(key)
            self.counters["expired"] += 1

    def _drop(self, key: PartKey) -> None:
        batch, _ = self._entries.pop(key)
        self.nbytes -= batch.nbytes
