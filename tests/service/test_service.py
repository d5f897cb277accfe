"""The service end to end: determinism, exactly once, worker failure, consumer restart.

Real ``streampack`` processes (producer, workers, ``serve``, ``consume``) talk over
ZeroMQ on 127.0.0.1; the expected streams come from ``streampack.service.digest.rank_stream``,
the in-process computation of the same windows and packing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from _service import FIXTURE, Service, consume, drain, drain_ranks, expected, result, stream_digest

from streampack.client import BatchStream
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

pytestmark = pytest.mark.slow

SHUFFLED = {"shuffle": True, "seed": 11, "epochs": 2}


@pytest.fixture(scope="module")
def reference():
    return {rank: expected(FIXTURE, rank, 2, **SHUFFLED) for rank in (0, 1)}


@pytest.fixture(scope="module")
def shuffled():
    """One service shared by the tests that use these settings (start-up is the cost)."""
    with Service(FIXTURE, serve_workers=2, **SHUFFLED) as service:
        yield service


def check_determinism(endpoint, reference):
    got = {rank: stream_digest(items) for rank, items in drain_ranks(endpoint, 2).items()}
    for rank in (0, 1):
        assert got[rank] == (reference[rank]["digest"], reference[rank]["batches"])
    assert got[0][1] == got[1][1]


@pytest.mark.parametrize("workers", [1, 4])
def test_stream_is_identical_for_any_number_of_workers(workers, reference):
    """Property 1: per-rank digests (over every array of every batch) equal the
    in-process stream with 1, 2 (next test) and 4 workers, run after run."""
    with Service(FIXTURE, serve_workers=workers, **SHUFFLED) as service:
        check_determinism(service.consumer_endpoint, reference)


def test_stream_is_identical_with_two_workers(shuffled, reference):
    check_determinism(shuffled.consumer_endpoint, reference)


def test_consume_command_prints_the_reference_digest(shuffled, reference):
    """The ``consume`` process (what a deployment runs) agrees, from a fresh cursor."""
    out = result(consume(shuffled.consumer_endpoint, 1, 2))
    assert (out["digest"], out["batches"]) == (reference[1]["digest"], reference[1]["batches"])


def corpus_tokens(corpus):
    """Every document's tokens by source id, read independently of the service."""
    source = open_corpus(corpus)
    spec = CutSpec(capacity=10**6, window_documents=10**6, window_tokens=10**9)
    docs = {}
    for window in iter_windows(source, 0, spec):
        for i, source_id in enumerate(window.source_id):
            docs[int(source_id)] = window.tokens[window.offsets[i] : window.offsets[i + 1]]
    return docs


def test_every_selected_pair_arrives_exactly_once_with_equal_counts():
    """Property 2 (rule C1): every document's range arrives once, its pairs intact."""
    docs = corpus_tokens(FIXTURE)
    with Service(FIXTURE, serve_workers=2, tail="fill") as service:
        received = drain_ranks(service.consumer_endpoint, 3)
    counts = {rank: len(items) for rank, items in received.items()}
    assert len(set(counts.values())) == 1, counts
    seen = []
    for rank, items in received.items():
        for (epoch, index), batch in items:
            assert index % 3 == rank and epoch == 0
            for occ in batch.occurrences:
                doc = docs[int(occ["source_id"])]
                a, b = int(occ["range_start"]), int(occ["range_stop"])
                row, start, stop = int(occ["row"]), int(occ["start"]), int(occ["stop"])
                np.testing.assert_array_equal(batch.inputs[row, start:stop], doc[a : b - 1])
                np.testing.assert_array_equal(batch.targets[row, start:stop], doc[a + 1 : b])
                seen.append((int(occ["source_id"]), a, b))
    assert sorted(seen) == sorted((s, 0, len(d)) for s, d in docs.items())
    assert len(seen) == len(set(seen)) == 600
    fillers = sum(batch.filler for items in received.values() for _, batch in items)
    total = sum(counts.values()) - fillers
    assert fillers == (-total) % 3


def test_drop_tail_gives_every_rank_floor_share():
    with Service(FIXTURE, serve_workers=1, tail="drop") as service:
        received = drain_ranks(service.consumer_endpoint, 3)
    got = [stream_digest(received[r]) for r in range(3)]
    want = [expected(FIXTURE, r, 3, tail="drop") for r in range(3)]
    assert got == [(w["digest"], w["batches"]) for w in want]
    assert len({batches for _, batches in got}) == 1
    assert not any(batch.filler for items in received.values() for _, batch in items)


def test_kill_9_of_a_worker_mid_epoch_changes_nothing():
    """Property 3: a worker killed holding windows; its windows are reissued."""
    settings = {"epochs": 2, "reorder_budget_bytes": 150_000, "heartbeat_timeout": 2.0}
    want = expected(FIXTURE, 0, 1, **settings)
    with Service(FIXTURE, **settings) as service:
        victim = service.add_worker()
        killed = threading.Event()

        def kill_once_it_holds_windows():
            # The frozen worker keeps the windows it is given in flight; once the
            # producer has handed it some, kill it and start a replacement.
            deadline = time.monotonic() + 120
            while service.stats()["windows_in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            service.add_worker()
            killed.set()

        got = []
        with BatchStream(
            service.consumer_endpoint, rank=0, world_size=1, timeout=120, prefetch=2
        ) as stream:
            for batch in stream:
                got.append((*stream.current, batch.digest()))
                if len(got) == 5:
                    os.kill(victim.pid, signal.SIGSTOP)
                    threading.Thread(target=kill_once_it_holds_windows, daemon=True).start()
        assert killed.wait(60)
        deadline = time.monotonic() + 30
        while service.stats()["workers"] > 1:  # it is forgotten: silent, or unreachable
            assert time.monotonic() < deadline, service.stats()
            time.sleep(0.1)
        final = service.stats()
    assert got == want["list"]
    # Its windows went elsewhere: reissued once it was forgotten, or copied before that
    # (backups of overdue windows, when the replacement registered first).
    assert final["windows_reissued"] + final["windows_backed_up"] >= 1


def test_consumer_restart_receives_exactly_the_remaining_batches(shuffled, reference):
    """Property 4: stop after k batches, load_state_dict, get the rest, byte for byte."""
    want = [(e, i, d) for e, i, d in reference[0]["list"]]
    # The shared service may already have served both ranks: then it replays.
    service = shuffled
    other = []
    rank1 = threading.Thread(target=drain, args=(service.consumer_endpoint, 1, 2, other))
    rank1.start()
    state = {"epoch": 0, "index": 0}
    got = []
    for k in (3, 10, len(want) // 2 + 1, len(want)):  # the last one crosses an epoch
        with BatchStream(service.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
            s.load_state_dict(state)
            while len(got) < k:
                batch = next(s)
                got.append((*s.current, batch.digest()))
            state = s.state_dict()
    with BatchStream(service.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
        s.load_state_dict(state)
        assert list(s) == []
    # and a restart far back in time, after the producer has moved on
    with BatchStream(service.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
        s.load_state_dict({"epoch": 0, "index": 2})
        again = []
        for _ in range(2):
            batch = next(s)
            again.append((*s.current, batch.digest()))
    rank1.join(timeout=180)
    rewinds = service.stats()["rewinds"]
    assert got == want
    assert again == want[1:3]
    assert rewinds >= 1
    assert [b.digest() for _, b in other] == [d for _, _, d in reference[1]["list"]]


def test_a_fresh_producer_resumes_a_saved_cursor(reference):
    """Property 4 across a producer restart: the cursor alone is enough."""
    want = reference[0]["list"]
    cut = len(want) - 4  # inside epoch 1
    with Service(FIXTURE, serve_workers=1, **SHUFFLED) as service:
        with BatchStream(service.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
            for _ in range(cut):
                next(s)
            state = s.state_dict()
    assert state["epoch"] == 1
    with Service(FIXTURE, serve_workers=1, **SHUFFLED) as service:
        with BatchStream(service.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
            s.load_state_dict(state)
            rest = [(*s.current, b.digest()) for b in s]
    assert rest == want[cut:]


def test_trainers_ride_out_a_producer_restart(reference):
    """kill -9 of the producer mid-epoch: a new one on the same endpoints, the running
    consumer's fetches reach it (queued across the reconnect, or resent after silence:
    which one depends on timing) and the worker reconnects; the stream is unchanged."""
    want = reference[0]["list"]
    first = Service(FIXTURE, **SHUFFLED).__enter__()
    second = None
    try:
        first.add_worker()
        got = []
        with BatchStream(first.consumer_endpoint, rank=0, world_size=2, timeout=120) as s:
            for batch in s:
                got.append((*s.current, batch.digest()))
                if len(got) == 10:
                    first.producer.kill()
                    first.producer.wait()
                    second = Service(
                        FIXTURE,
                        worker_endpoint=first.worker_endpoint,
                        consumer_endpoint=first.consumer_endpoint,
                        **SHUFFLED,
                    ).__enter__()
    finally:
        if second is not None:
            second.__exit__(None, None, None)
        first.producer = None
        first.__exit__(None, None, None)
    assert got == want
