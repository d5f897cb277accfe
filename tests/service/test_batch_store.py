"""The serving worker's batch store: bounded by bytes and by time, one delivery each."""

from __future__ import annotations

import numpy as np

from streampack import Binding, CompactBatch
from streampack.batch import OCCURRENCE_DTYPE
from streampack.service.store import BatchStore

BINDING = Binding(vocab_size=300, tokenizer="t", split_receipt="s", partition="train")


def batch(tokens: int) -> CompactBatch:
    """A batch of ``tokens`` tokens (the store reads only its size)."""
    return CompactBatch(
        tokens=np.arange(tokens, dtype=np.int32) % 300,
        occurrences=np.zeros(0, OCCURRENCE_DTYPE),
        rows=1,
        capacity=8,
        binding=BINDING,
    )


def test_a_batch_is_delivered_once_then_missing():
    store = BatchStore(budget_bytes=1 << 20, seconds=60)
    one = batch(4)
    store.put((0, 1, 0), one, now=0.0)
    assert store.take((0, 1, 0), now=1.0) is one
    assert store.take((0, 1, 0), now=1.0) is None
    assert store.counters["delivered"] == 1 and store.counters["missing"] == 1
    assert store.nbytes == 0 and len(store) == 0


def test_the_budget_drops_the_oldest_first_and_never_holds_more():
    size = batch(100).nbytes
    store = BatchStore(budget_bytes=3 * size, seconds=60)
    for window in range(5):
        store.put((0, window, 0), batch(100), now=float(window))
        assert store.nbytes <= 3 * size
    assert [store.take((0, w, 0), 10.0) is not None for w in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.counters["dropped_for_room"] == 2
    store.put((0, 9, 0), batch(1000), now=11.0)  # larger than the whole budget: not kept
    assert len(store) == 0 and store.counters["dropped_for_room"] == 3


def test_entries_expire_after_their_deadline_and_a_repack_replaces_its_entry():
    store = BatchStore(budget_bytes=1 << 20, seconds=5)
    store.put((0, 0, 0), batch(4), now=0.0)
    store.put((0, 1, 0), batch(4), now=3.0)
    store.put((0, 1, 0), batch(8), now=3.0)  # a reissue or backup copy packed again
    assert len(store) == 2 and store.nbytes == batch(4).nbytes + batch(8).nbytes
    store.expire(now=6.0)
    assert store.take((0, 0, 0), now=6.0) is None and store.counters["expired"] == 1
    assert store.take((0, 1, 0), now=7.0) is not None
    store.put((0, 2, 0), batch(4), now=7.0)
    assert store.take((0, 2, 0), now=12.5) is None and store.counters["expired"] == 2
