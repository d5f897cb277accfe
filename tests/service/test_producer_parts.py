"""The producer's parts without sockets: delivery, rewinds, budgets, the worker registry
and every trust rule of a message, driven through ``tests/_harness.py``.

Each test names the defect of the reliability issue it holds (``defect N``); the stream
a simulated consumer receives is compared, batch by batch, with ``digest``'s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _harness import Harness
from _service import FIXTURE, expected

from streampack import wire
from streampack.errors import InternalError, ProtocolError
from streampack.service.counters import ProducerCounters
from streampack.service.delivery import (
    FAIR_SHARE,
    MAX_CONSUMERS,
    MAX_PENDING,
    MAX_PENDING_PER_CONSUMER,
    RESEND_WINDOW,
    rank_share,
)
from streampack.service.pipeline import BACKUP_P95_FACTOR, RECENT_WINDOWS
from streampack.service.registry import MAX_CREDIT, MAX_LOSSES

SHUFFLED = {"shuffle": True, "seed": 11, "epochs": 2}


@pytest.fixture(scope="module")
def want_w1():
    return expected(FIXTURE, 0, 1)["list"]


def test_simulated_workers_give_digests_stream_for_every_rank():
    harness = Harness(**SHUFFLED)
    harness.join(b"w1")
    harness.join(b"w2")
    for rank in (0, 1):
        got = harness.drain(b"c%d" % rank, rank, 2, workers=(b"w1", b"w2"))
        assert got == expected(FIXTURE, rank, 2, **SHUFFLED)["list"]


def fill_reorder_buffer(harness: Harness, workers: tuple[bytes, ...]) -> None:
    """Let the workers pack until the producer stops cutting (the budget is reached)."""
    for _ in range(200):
        if not sum(harness.work(w, limit=1) for w in workers):
            return
    raise AssertionError("the producer never stopped cutting")


def test_a_trainer_resuming_20_behind_a_full_reorder_buffer_receives_exactly_the_rest(want_w1):
    """Defect 1: the rewind frees the batches past its point, so the buffer at its
    budget cannot wedge the replay."""
    budget = 10_000
    harness = Harness(reorder_budget_bytes=budget)
    harness.join(b"w1")
    first = harness.drain(b"old", 0, 1, until=35)
    assert first == want_w1[:35]
    fill_reorder_buffer(harness, (b"w1",))
    assert harness.counters["reorder_bytes"] >= budget  # at its budget: nothing is cut
    harness.unreachable.add(b"old")  # the trainer died with fetches outstanding
    rest = harness.drain(b"new", 0, 1, index=15)
    assert rest == want_w1[15:]
    assert harness.counters["rewinds"] == 1


def test_a_rewind_frees_every_ready_batch_past_its_point():
    harness = Harness(reorder_budget_bytes=1 << 30)
    harness.join(b"w1")
    harness.drain(b"c", 0, 1, until=10)
    fill_reorder_buffer(harness, (b"w1",))
    delivery = harness.coordinator.delivery
    assert len(delivery.ready) > 20
    harness.coordinator.rewind((0, 12))
    point = harness.coordinator.pipeline.assembly_point
    assert point <= (0, 12) and all(key < point for key in delivery.ready)
    assert delivery.ready_bytes == sum(e.batch.nbytes for e in delivery.ready.values())


def test_a_strangers_stale_fetch_neither_stalls_nor_changes_a_rank(want_w1):
    """Defect 1, second case: a fetch from anyone for a batch long gone rewinds, and the
    rank that is far ahead still receives exactly its stream, under a small budget."""
    harness = Harness(reorder_budget_bytes=20_000)
    harness.join(b"w1")
    got = harness.drain(b"rank", 0, 1, until=30, prefetch=2)
    harness.fetch(b"stranger", 0, 1, 0, 0, count=4)
    harness.unreachable.add(b"stranger")
    got += harness.drain(b"rank", 0, 1, index=30, prefetch=2)
    assert got == want_w1


def test_resent_fetches_are_deduplicated():
    """Defect 2: a client's resends of an outstanding fetch do not pile up."""
    harness = Harness(epochs=0)
    for _ in range(100):
        harness.fetch(b"c", 0, 2, 5, 0, count=4)
    assert harness.counters["pending_fetches"] == 4


def test_a_resend_crossing_its_answer_costs_nothing(want_w1):
    """Item 5 of the data-plane issue: a client resends its outstanding fetches after
    silence; read after they were answered, they must neither replay a window nor count
    a batch twice. A stranger's fetch for the same batch still replays, and so does the
    same consumer's once RESEND_WINDOW has passed (its answer may have been lost)."""
    harness = Harness()
    harness.fetch(b"c", 0, 1, 0, 0, count=4)
    harness.step(6.0)  # no worker yet: the client's resend is read while still pending
    harness.fetch(b"c", 0, 1, 0, 0, count=4)
    harness.join(b"w1")
    harness.work(b"w1")
    got = harness.batches(b"c")
    assert got == want_w1[:4]
    served = harness.counters["batches_served"]
    for index in range(4):  # the resends that crossed those answers
        harness.fetch(b"c", 0, 1, 0, index)
    harness.work(b"w1")
    assert harness.batches(b"c") == []
    counters = harness.counters
    assert (counters["rewinds"], counters["batches_served"]) == (0, served)
    assert counters["resends_dropped"] == 4
    harness.fetch(b"stranger", 0, 1, 0, 0)
    harness.work(b"w1")
    assert harness.batches(b"stranger") == want_w1[:1]
    assert harness.counters["rewinds"] == 1
    harness.step(RESEND_WINDOW)
    harness.fetch(b"c", 0, 1, 0, 1)
    harness.work(b"w1")
    assert harness.batches(b"c") == want_w1[1:2]
    assert harness.counters["batches_served"] == served + 2


def test_pending_fetches_are_bounded_and_expire(want_w1):
    """Defect 2: 100 identities x 1024 fetches of a far epoch stay bounded, are forgotten
    once their consumers fall silent, and a real consumer is then served as usual."""
    harness = Harness(epochs=0, consumer_timeout=5.0)
    for i in range(100):
        harness.fetch(b"flood%d" % i, 0, 1, 10_000, 0, count=MAX_PENDING_PER_CONSUMER)
    assert harness.counters["pending_fetches"] <= MAX_PENDING
    harness.step(6.0)
    assert harness.counters["pending_fetches"] == 0
    assert harness.counters["consumers"] == 0
    harness.join(b"w1")
    got = harness.drain(b"c", 0, 1, until=5)
    assert got == want_w1[:5]  # epoch 0 of an unbounded stream (no shuffle) is epoch 0


def test_a_window_past_its_deadline_goes_to_another_worker_and_the_late_one_is_dropped(want_w1):
    """Defect 3: a worker that heartbeats but never answers holds nothing forever."""
    harness = Harness(window_timeout=3.0, heartbeat_timeout=5.0)
    harness.fetch(b"c", 0, 1, 0, 0)
    harness.join(b"hung", credit=4)
    harness.step()
    assert harness.take(b"hung", "window")  # it holds a window and will never answer
    harness.join(b"w1")
    for _ in range(3):
        harness.from_worker(b"hung", "heartbeat", {"free": 4, "needs_tokens": False})
        harness.step(1.1)
    assert harness.counters["workers_dropped"] == 1
    assert harness.counters["windows_overdue"] == 1
    assert harness.coordinator.registry.get(b"hung") is None
    harness.from_worker(b"hung", "heartbeat", {"free": 4, "needs_tokens": False})
    assert harness.coordinator.registry.get(b"hung") is None  # ignored while dropped
    harness.take(b"c")
    assert harness.drain(b"c2", 0, 1) == want_w1


def test_credit_above_the_limit_is_clamped_and_errors_are_never_answered():
    """Defect 4: no error answers a too large credit, and an error is never answered, so
    a worker started with a large --prefetch cannot start an error ping-pong."""
    harness = Harness()
    harness.join(b"w", credit=1000)
    assert harness.take(b"w", "error") == []
    assert harness.counters["credit_clamped"] == 1
    worker = harness.coordinator.registry.get(b"w")
    assert worker is not None and worker.credit == MAX_CREDIT
    harness.from_worker(b"w", "error", {"message": "your window was malformed"})
    harness.from_consumer(b"c", "error", {"message": "no"})
    assert harness.take(b"w") == [] and harness.take(b"c") == []
    assert harness.counters["peer_errors"] == 2


def test_the_world_size_comes_with_each_fetch():
    """Defect 5: a stranger's fetch at another world size locks nobody out; every world
    size gets its own share and tail."""
    harness = Harness(**SHUFFLED)
    harness.fetch(b"stranger", 2, 3, 0, 2)
    harness.join(b"w1")
    for rank in (0, 1):
        got = harness.drain(b"job%d" % rank, rank, 2)
        assert got == expected(FIXTURE, rank, 2, **SHUFFLED)["list"]
    got = harness.drain(b"three", 1, 3)
    assert got == expected(FIXTURE, 1, 3, **SHUFFLED)["list"]


def test_an_elastic_resume_at_another_world_size_receives_the_rest_once():
    """A job of 2 ranks consumes k batches each; resumed with 3 ranks at base 2k
    (DECISIONS #7), the new ranks together receive exactly the rest of the epoch."""
    everything = expected(FIXTURE, 0, 1)["list"]
    total = len(everything)
    harness = Harness()
    harness.join(b"w1")
    k = 7
    seen = []
    for rank in (0, 1):
        seen += harness.drain(b"old%d" % rank, rank, 2, until=k)
    base = 2 * k
    for rank in range(3):
        ranks_share = []
        index = base + rank
        while True:
            harness.fetch(b"new%d" % rank, rank, 3, 0, index, base=base)
            for _ in range(50):
                answers = harness.batches(b"new%d" % rank)
                ends = harness.take(b"new%d" % rank, "epoch_end")
                if answers or ends:
                    break
                harness.work(b"w1", limit=1)
                harness.step()
            if ends:
                assert ends[0].fields["per_rank"] == rank_share(total - base, 3, "fill")
                break
            ranks_share += answers
            index += 3
        seen += [item for item in ranks_share if item[1] < total]
    assert sorted(seen) == sorted(everything)


def test_join_and_vanish_waves_cannot_quarantine_data(want_w1):
    """Defect 6: peers that register, take a window and vanish are not proven: their
    losses count against no window, and each holds one window at a time."""
    harness = Harness(heartbeat_timeout=1.0)
    harness.fetch(b"c", 0, 1, 0, 0)
    for wave in range(3 * MAX_LOSSES):
        for i in range(4):
            identity = b"ghost%d-%d" % (wave, i)
            harness.join(identity, credit=MAX_CREDIT)
            harness.step()
            assert len(harness.take(identity, "window")) <= 1
        harness.step(1.5)
    assert harness.counters["workers_lost"] == 3 * MAX_LOSSES * 4
    assert harness.counters["windows_failed"] == 0 and harness.counters["quarantined"] == 0
    harness.take(b"c")
    harness.join(b"w1")
    assert harness.drain(b"c2", 0, 1) == want_w1


def test_a_window_that_fails_proven_workers_is_quarantined():
    """The loss rule still works for real poison: MAX_LOSSES distinct proven workers
    report failure on the same window (the one each was packing): it is quarantined."""
    harness = Harness()
    harness.fetch(b"c", 0, 1, 0, 0, count=4)
    workers = [b"p%d" % i for i in range(MAX_LOSSES)]
    for identity in workers:  # each proves itself on one window, then holds nothing
        harness.join(identity, credit=1)
        harness.step()
        (window,) = harness.take(identity, "window")
        harness.from_worker(
            identity, "packed", harness.packed_fields(window), harness.honest_plan(window)
        )
    poison = None
    for identity in workers:
        harness.join(identity, credit=1)
        harness.step()
        (window,) = harness.take(identity, "window")
        key = (window.fields["epoch"], window.fields["window"])
        poison = poison or key
        assert key == poison
        harness.from_worker(
            identity, "failed", {"epoch": key[0], "window": key[1], "error": "killed the packer"}
        )
    assert harness.counters["windows_failed"] == 1
    assert harness.counters["quarantine_reasons"]["pack_failed"] > 0


def held_window(harness: Harness, identity: bytes) -> wire.Message:
    harness.fetch(b"c", 0, 1, 0, 0)
    harness.join(identity, credit=1)
    harness.step()
    (window,) = harness.take(identity, "window")
    return window


@pytest.mark.parametrize(
    "field, value",
    [
        ("audited", 2**64 - 1),
        ("audited", -1),
        ("audit_failures", 2**63),
        ("seconds", math.nan),
        ("seconds", -1.0),
        ("seconds", math.inf),
    ],
)
def test_out_of_range_numbers_never_touch_a_counter(field, value):
    """Defect 7: from a holder or not, a number out of range is refused before it is
    counted, and ``health`` still answers."""
    harness = Harness()
    window = held_window(harness, b"w")
    fields = harness.packed_fields(window, **{field: value})
    for identity in (b"stranger", b"w"):  # a well-formed message but for that number
        harness.from_worker(identity, "packed", fields, harness.honest_plan(window))
        (error,) = harness.take(identity, "error")
        assert f"{field} = " in error.fields["message"]
    assert harness.counters["rejected_worker"] == 2
    assert harness.counters["audited"] == harness.counters["audit_failures"] == 0
    assert harness.counters["pack_seconds"] == 0.0
    harness.from_consumer(b"probe", "health", {})
    (status,) = harness.take(b"probe", "status")
    assert status.fields["serving"] and status.fields["stats"]["rejected_worker"] == 2


@pytest.mark.parametrize("kind", ["packed", "failed"])
def test_a_peer_may_only_answer_windows_it_holds(kind, want_w1):
    """Defects 7 and 10: ``packed`` or ``failed`` for a window another worker holds is
    refused and counted; nothing is quarantined and the stream is unchanged."""
    harness = Harness()
    window = held_window(harness, b"w1")
    key = (window.fields["epoch"], window.fields["window"])
    if kind == "failed":
        harness.from_worker(
            b"rogue", "failed", {"epoch": key[0], "window": key[1], "error": "lost"}
        )
    else:
        harness.from_worker(
            b"rogue", "packed", harness.packed_fields(window), harness.honest_plan(window)
        )
    (error,) = harness.take(b"rogue", "error")
    assert "was not given to this worker" in error.fields["message"]
    assert harness.counters["rejected_worker"] == 1
    assert harness.counters["quarantined"] == harness.counters["windows_failed"] == 0
    harness.sent[b"w1"] = [window]
    harness.take(b"c")
    assert harness.drain(b"c2", 0, 1) == want_w1


def not_next_fit(plan: dict) -> dict:
    occurrences = plan["occurrences"].copy()
    occurrences["row"] = np.arange(len(occurrences)) % 4
    occurrences["start"] = 0
    occurrences["stop"] = plan["occurrences"]["stop"] - plan["occurrences"]["start"]
    sizes = np.full(-(-len(occurrences) // 4), 4, np.int64)
    sizes[-1] = len(occurrences) - 4 * (len(sizes) - 1)
    return {"occurrences": occurrences, "batch_sizes": sizes}


def rewritten_source(plan: dict) -> dict:
    occurrences = plan["occurrences"].copy()
    occurrences["source"] = 1  # another source's document, in a one-source corpus
    return {"occurrences": occurrences, "batch_sizes": plan["batch_sizes"]}


@pytest.mark.parametrize(
    "tamper, complaint", [(not_next_fit, "batch sizes"), (rewritten_source, "['source']")]
)
def test_a_plan_other_than_the_contracts_is_refused_and_the_window_reissued(
    tamper, complaint, want_w1
):
    """Defect 9: a well-formed plan that is not the contract's exact plan is refused,
    counted, and the window goes to another worker."""
    harness = Harness()
    window = held_window(harness, b"rogue")
    harness.from_worker(
        b"rogue", "packed", harness.packed_fields(window), tamper(harness.honest_plan(window))
    )
    (error,) = harness.take(b"rogue", "error")
    assert complaint in error.fields["message"]
    assert harness.counters["plans_refused"] == 1
    harness.take(b"c")
    harness.join(b"w1")
    assert harness.drain(b"c2", 0, 1, workers=(b"w1",)) == want_w1
    assert harness.counters["windows_reissued"] == 1


def test_peer_text_cannot_forge_a_log_line():
    harness = Harness()
    window = held_window(harness, b"w")
    forged = "ok\nproducer: worker 00 was promoted to admin"
    harness.from_worker(
        b"w",
        "packed",
        harness.packed_fields(window, audit_error=forged),
        harness.honest_plan(window),
    )
    harness.from_worker(b"x", "error", {"message": forged})
    harness.from_worker(b"y", "failed", {"epoch": 0, "window": 99, "error": forged})
    assert harness.log and not any("\n" in line for line in harness.log)
    assert sum("promoted to admin" in line for line in harness.log) == 2


def test_a_message_over_the_per_message_limit_is_refused():
    """Bounded memory: every frame within the frame limit, the message over the message
    limit; the producer's own limit follows from window_documents."""
    limits = wire.WireLimits(max_frame_bytes=1 << 20, max_message_bytes=1 << 20)
    occurrences = np.zeros(9000, wire.frame_dtype("occurrence"))  # 576,000 bytes
    frames = wire.encode(
        "packed",
        {
            "epoch": 0,
            "window": 0,
            "capacity": 256,
            "seconds": 0.0,
            "audited": 0,
            "audit_failures": 0,
            "audit_error": "",
        },
        {"occurrences": occurrences, "batch_sizes": np.zeros(60_000)},
    )
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes"):
        wire.decode(frames, limits)
    harness = Harness()  # window_documents = 40: a plan message is at most ~67 KB
    assert harness.coordinator.limits.max_message_bytes < 70_000
    harness.coordinator.on_worker(b"w", [bytes(f) for f in frames], 0.0)
    assert harness.counters["rejected_worker"] == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_drop_tail_serves_no_batch_past_the_share_before_the_total_is_known(world_size):
    """With tail = "drop" a rank running ahead of the others never receives a batch of
    the remainder, even when it is numbered before the epoch's total is known."""
    harness = Harness(tail="drop", **SHUFFLED)
    harness.join(b"w1")
    for rank in range(world_size):
        got = harness.drain(b"c%d" % rank, rank, world_size, prefetch=8)
        assert got == expected(FIXTURE, rank, world_size, tail="drop", **SHUFFLED)["list"]


def test_counters_refuse_what_a_peer_reports_out_of_range():
    counters = ProducerCounters()
    for value in (-1, 2**64, math.nan, math.inf, True, "3"):
        with pytest.raises(ProtocolError, match="out of range"):
            counters.add_reported("audited", value, 1 << 31)
    counters.add_reported("audited", 7, 1 << 31)
    assert counters.as_dict()["audited"] == 7
    with pytest.raises(InternalError, match="cannot decrease"):
        counters.add("audited", -1)


@pytest.mark.parametrize(
    "total, world, tail, share",
    [
        (49, 2, "fill", 25),
        (49, 2, "drop", 24),
        (48, 3, "fill", 16),
        (0, 4, "fill", 0),
        (5, 8, "drop", 0),
        (5, 8, "fill", 1),
    ],
)
def test_rank_share_is_the_tail_rule(total, world, tail, share):
    assert rank_share(total, world, tail) == share


def test_the_receive_limit_admits_the_plans_of_every_window_handed_out():
    """A split long document can give a window more ranges than window_documents: the
    limit follows the largest plan handed out, within max_message_bytes."""
    from streampack.service.coordinator import receive_limit

    harness = Harness()
    small = receive_limit(harness.settings)
    assert small == 65536 + 40 * 72
    assert receive_limit(harness.settings, plan_bytes=10**6) == 65536 + 10**6
    assert receive_limit(harness.settings, plan_bytes=10**12) == harness.settings.max_message_bytes
    window = held_window(harness, b"w")
    assert harness.coordinator.limits.max_message_bytes >= 65536 + sum(
        frame.nbytes for frame in harness.honest_plan(window).values()
    )


def _three_ranks_at_once(budget: int) -> tuple[Harness, dict[int, list]]:
    """Ranks 0-2 of 3 each ask for their first 8 batches before a worker joins, under
    a drop tail; the worker packs until nothing moves."""
    harness = Harness(tail="drop", reorder_budget_bytes=budget, window_documents=16)
    for rank in range(3):
        harness.fetch(b"c%d" % rank, rank, 3, 0, rank, count=8)
    harness.join(b"w1")
    harness.work(b"w1", limit=50)
    return harness, {rank: harness.batches(b"c%d" % rank) for rank in range(3)}


@pytest.mark.parametrize("budget", [2_000, 3_000])
def test_a_drop_tail_held_back_by_a_budget_below_a_group_of_batches_does_not_wedge(budget):
    """Chaos finding F5 (seed 29): batches 0 and 1 are asked for and ready, but a drop
    tail holds them back until batch 2 shows that their group of 3 is whole. They filled
    the budget (about 2 kB each), no window was cut again and every rank timed out.
    What a drop tail holds back no longer counts against the budget, up to one budget."""
    harness, got = _three_ranks_at_once(budget)
    for rank in range(3):
        assert got[rank] == expected(FIXTURE, rank, 3, tail="drop", window_documents=16)["list"][:8]
    assert not [line for line in harness.log if "reorder_budget_bytes" in line]


def test_a_budget_too_small_even_for_that_says_so():
    """Below what a drop tail holds back, even with the allowance, the ranks wait and
    the producer's log names the setting and the size needed."""
    harness, got = _three_ranks_at_once(500)
    assert got == {0: [], 1: [], 2: []}
    (warning,) = [line for line in harness.log if "reorder_budget_bytes" in line]
    assert "reorder_budget_bytes = 500 is too small" in warning and "tail = 'fill'" in warning


@pytest.mark.parametrize("budget", [4_000, 16_384])
def test_a_rank_alone_past_a_drop_tail_is_answered_with_the_reorder_buffer_full(budget):
    """Chaos finding F4: a fetch past the drop tail waits for the epoch's total, which
    only more cutting brings. With the buffer at its budget (other ranks' batches that
    nobody asks for yet) the budget must make room for that cutting, not wedge it."""
    harness = Harness(tail="drop", reorder_budget_bytes=budget, **SHUFFLED)
    harness.join(b"w1")
    for rank in (0, 2, 1):
        got = harness.drain(b"c%d" % rank, rank, 3, prefetch=1)
        assert got == expected(FIXTURE, rank, 3, tail="drop", **SHUFFLED)["list"]


# -- backup windows (issue 22): no trainer waits on one bad peer ------------------------


def heartbeat(harness: Harness, *workers: bytes) -> None:
    for identity in workers:
        harness.from_worker(identity, "heartbeat", {"free": 1, "needs_tokens": False})


def _held_by_hung(harness: Harness, *hung: bytes, count: int = 4) -> list[wire.Message]:
    """Each of ``hung`` registers first and takes one window it will never answer; a
    consumer asks for the first ``count`` batches."""
    harness.fetch(b"c", 0, 1, 0, 0, count=count)
    windows = []
    for identity in hung:
        harness.join(identity, credit=1)
        harness.step()
        (window,) = harness.take(identity, "window")
        windows.append(window)
    return windows


def test_a_hung_worker_costs_the_stream_one_backup_period_not_the_deadline(want_w1):
    """Issue 22: a worker that heartbeats but never answers holds window 0, which the
    ordered stream waits on. At ``backup_after`` (1 s) a copy goes to a healthy worker;
    its answer is the window's, and the stream is digest's, long before the deadline."""
    harness = Harness()  # window_timeout 60 s, backup_after 1 s
    (window,) = _held_by_hung(harness, b"hung")
    assert (window.fields["epoch"], window.fields["window"]) == (0, 0)
    harness.join(b"w1")
    for _ in range(9):  # 0.9 s: not overdue yet, the stream waits
        harness.step(0.1)
        harness.work(b"w1")
        assert harness.batches(b"c") == []
    assert harness.counters["windows_backed_up"] == 0
    harness.step(0.15)
    harness.work(b"w1")  # it is handed the copy and answers it
    assert harness.batches(b"c") == want_w1[:4]
    counters = harness.counters
    assert counters["windows_backed_up"] == 1 and counters["backup_wins"] == 1
    assert counters["workers_dropped"] == 0  # not punished for being slow ...
    assert harness.drain(b"c", 0, 1, index=4) == want_w1[4:]
    assert harness.take(b"hung", "window") == []  # ... and it sits on its one slot
    for _ in range(60):  # it heartbeats on
        heartbeat(harness, b"hung")
        harness.step(1.0)
    counters = harness.counters
    assert counters["workers_dropped"] == 1  # ... until it misses the deadline
    assert counters["windows_reissued"] == 0  # its window was complete long ago


def test_a_slow_workers_late_answer_is_a_duplicate_and_it_goes_on(want_w1):
    """The slow worker's answer after its copy won is dropped as a duplicate: no error,
    nothing refused, and the worker is given windows as before."""
    harness = Harness(reorder_budget_bytes=20_000)
    (window,) = _held_by_hung(harness, b"slow")
    harness.join(b"w1")
    harness.step(1.1)
    harness.work(b"w1")
    assert harness.counters["backup_wins"] == 1
    harness.from_worker(
        b"slow", "packed", harness.packed_fields(window), harness.honest_plan(window)
    )
    assert harness.take(b"slow", "error") == []
    counters = harness.counters
    assert counters["duplicates_dropped"] == 1
    assert counters["rejected_worker"] == counters["plans_refused"] == 0
    harness.from_worker(b"slow", "ready", {"credit": 1, "needs_tokens": False})
    harness.take(b"c")
    assert harness.drain(b"c2", 0, 1, workers=(b"slow", b"w1")) == want_w1
    assert harness.coordinator.registry.get(b"slow").completed > 0  # it packed on


def test_when_the_first_holder_answers_first_the_copy_is_the_duplicate(want_w1):
    harness = Harness()
    (window,) = _held_by_hung(harness, b"first")
    harness.join(b"w1")
    harness.step(1.1)
    copies = [w for w in harness.take(b"w1", "window") if w.fields["window"] == 0]
    assert len(copies) == 1 and harness.counters["windows_backed_up"] == 1
    harness.from_worker(
        b"first", "packed", harness.packed_fields(window), harness.honest_plan(window)
    )
    harness.from_worker(
        b"w1", "packed", harness.packed_fields(copies[0]), harness.honest_plan(copies[0])
    )
    counters = harness.counters
    assert counters["backup_wins"] == 0 and counters["duplicates_dropped"] == 1
    assert counters["rejected_worker"] == 0 and harness.take(b"w1", "error") == []
    got = harness.batches(b"c")
    assert got and got == want_w1[: len(got)]  # window 0's batches


def test_a_refused_copy_leaves_the_window_with_its_first_holder(want_w1):
    """The first answer that *passes the plan check* wins: a copy whose plan is refused
    is counted and dropped, the window is not reissued (its first holder still packs
    it), and that holder's answer is accepted."""
    harness = Harness()
    (window,) = _held_by_hung(harness, b"first")
    harness.join(b"rogue")
    harness.step(1.1)
    (copy,) = harness.take(b"rogue", "window")
    harness.from_worker(
        b"rogue", "packed", harness.packed_fields(copy), not_next_fit(harness.honest_plan(copy))
    )
    assert harness.counters["plans_refused"] == 1
    assert harness.coordinator.pipeline.reissue == []
    harness.from_worker(
        b"first", "packed", harness.packed_fields(window), harness.honest_plan(window)
    )
    got = harness.batches(b"c")
    assert got and got == want_w1[: len(got)]
    assert harness.counters["backup_wins"] == 0


def test_backups_skip_lagging_workers_and_a_window_has_at_most_three_copies(want_w1):
    """Two hung workers: the window goes to A, its copy to B (B held nothing, so it
    was not lagging), the next copy to the healthy worker, never back to A or B. Each
    extra hung worker costs one more backup period."""
    harness = Harness()
    harness.fetch(b"c", 0, 1, 0, 0, count=4)
    harness.join(b"A", credit=1)
    harness.step()
    assert len(harness.take(b"A", "window")) == 1
    harness.step(1.1)
    harness.join(b"B", credit=1)
    harness.step()
    (copy,) = harness.take(b"B", "window")
    assert copy.fields["window"] == 0
    harness.join(b"w1")
    harness.step(0.5)  # B's copy is 0.5 s old: not overdue yet; w1 takes window 1
    harness.work(b"w1")
    assert harness.batches(b"c") == []
    harness.step(0.6)
    harness.work(b"w1")
    assert harness.batches(b"c") == want_w1[:4]
    state_copies = harness.counters["windows_backed_up"]
    assert state_copies == 2 and harness.counters["backup_wins"] == 1
    assert harness.take(b"A", "window") == harness.take(b"B", "window") == []
    assert harness.drain(b"c", 0, 1, index=4) == want_w1[4:]


def test_the_backup_threshold_follows_the_observed_windows():
    """Overdue means ``BACKUP_P95_FACTOR`` times the p95 of the recent windows, at least
    ``backup_after``, and never at or past the deadline (which reissues anyway)."""
    pipeline = Harness(backup_after=0.5).coordinator.pipeline
    assert pipeline.backup_threshold() == 0.5  # nothing observed yet: the floor
    pipeline.durations.extend([0.01] * 19 + [0.2])
    assert pipeline.backup_threshold() == 0.5  # 4 x p95 (0.01) is below the floor
    pipeline.durations.extend([0.3] * 5)
    assert pipeline.backup_threshold() == pytest.approx(BACKUP_P95_FACTOR * 0.3)
    pipeline.durations.extend([30.0] * RECENT_WINDOWS)  # every window slow: 4 x 30 s
    assert pipeline.plan_backups(0.0) == 120.0 and pipeline.backups == []
    assert Harness(backups=False).coordinator.pipeline.backup_threshold() == math.inf


def test_without_backups_a_hung_worker_costs_the_deadline(want_w1):
    """``backups = false``: only ``window_timeout`` takes the window back (the figure
    without backups, and the setting benchmarks/service.py compares)."""
    harness = Harness(backups=False, window_timeout=10.0)
    _held_by_hung(harness, b"hung")
    harness.join(b"w1")
    for _ in range(9):
        heartbeat(harness, b"hung", b"w1")
        harness.step(1.0)
        harness.work(b"w1")
    assert harness.batches(b"c") == [] and harness.counters["windows_backed_up"] == 0
    heartbeat(harness, b"hung", b"w1")
    harness.step(1.5)
    harness.work(b"w1")
    assert harness.batches(b"c") == want_w1[:4]
    assert harness.counters["workers_dropped"] == 1


def test_a_worker_found_unreachable_loses_every_window_it_held(want_w1):
    """A send to a worker that fails (gone, or not reading) forgets it; the windows it
    already held go elsewhere rather than waiting for a deadline nobody keeps."""
    harness = Harness()
    harness.fetch(b"c", 0, 1, 0, 0, count=8)
    harness.join(b"w", credit=1)
    harness.work(b"w", limit=1)  # proven
    harness.take(b"w")
    harness.from_worker(b"w", "ready", {"credit": 2, "needs_tokens": False})
    harness.step()
    held = list(harness.coordinator.registry.get(b"w").held)
    assert len(held) >= 2
    harness.unreachable.add(b"w")
    harness.from_worker(b"w", "ready", {"credit": 1, "needs_tokens": False})
    harness.step()  # the next window cannot be sent: w is forgotten, with what it held
    assert harness.coordinator.registry.get(b"w") is None
    reissue = harness.coordinator.pipeline.reissue
    assert set(held) < set(reissue) and len(reissue) == len(held) + 1
    harness.take(b"c")
    harness.join(b"w1")
    assert harness.drain(b"c2", 0, 1) == want_w1


# -- the pending-fetch table (issue 22): strangers cannot crowd a rank out -------------


def test_strangers_filling_the_fetch_table_never_crowd_out_a_waiting_rank(want_w1):
    """A rank waits for batches not packed yet; 100 strangers ask for 1,024 batches
    each that come much later. The table stays bounded, its oldest entries are the
    strangers' (they hold the most), and the rank keeps every fetch."""
    harness = Harness()
    harness.fetch(b"rank", 0, 1, 0, 0, count=4)
    for i in range(100):
        harness.fetch(b"stranger%d" % i, 0, 1, 0, 10_000, count=MAX_PENDING_PER_CONSUMER)
    delivery = harness.coordinator.delivery
    assert harness.counters["pending_fetches"] <= MAX_PENDING
    assert len(delivery.consumers[b"rank"].pending) == 4
    harness.join(b"w1")
    harness.work(b"w1", limit=2)
    assert harness.batches(b"rank") == want_w1[:4]


def test_a_consumer_within_its_share_is_never_forgotten_for_room():
    harness = Harness(epochs=0)
    harness.fetch(b"rank", 0, 1, 0, 0, count=FAIR_SHARE)
    for i in range(MAX_CONSUMERS - 1):  # as many keys as the table holds, then more
        harness.fetch(b"s%d" % i, 0, 1, 5 + i, 0, count=FAIR_SHARE + (i % 3))
    assert harness.counters["pending_fetches"] <= MAX_PENDING
    assert len(harness.coordinator.delivery.consumers[b"rank"].pending) == FAIR_SHARE


def test_newcomers_displace_strangers_before_a_rank_that_was_answered(want_w1):
    """Past MAX_CONSUMERS identities the least recently heard consumer goes, but one
    never answered a batch goes before a rank at work, however long it waits."""
    harness = Harness()
    harness.join(b"w1")
    assert harness.drain(b"rank", 0, 1, until=4) == want_w1[:4]
    harness.fetch(b"rank", 0, 1, 0, 4, count=4)
    for i in range(MAX_CONSUMERS + 200):
        harness.fetch(b"n%d" % i, 0, 1, 0, 10_000 + i)
    consumers = harness.coordinator.delivery.consumers
    assert len(consumers) == MAX_CONSUMERS and b"rank" in consumers
    assert b"n%d" % (MAX_CONSUMERS + 199) in consumers  # a newcomer is never refused
    assert harness.drain(b"rank", 0, 1, index=4) == want_w1[4:]


def test_a_reissue_goes_back_to_its_last_holder_when_no_other_worker_has_room(want_w1):
    """Chaos finding (seed 11 once the hung worker's deadline outlasted the trainers'
    timeout): a reissued window skipped the worker it was last given while another
    worker was registered — a hung one with no credit — so nobody took it, ever. The
    preference for another worker holds only when another has room."""
    harness = Harness()
    _held_by_hung(harness, b"hung")  # hung holds window 0, no credit left
    harness.join(b"w1", credit=1)
    harness.step()
    assert len(harness.take(b"w1", "window")) == 1
    for _ in range(6):  # w1 falls silent (its window is reissued), the hung one beats on
        heartbeat(harness, b"hung")
        harness.step(1.0)
    assert harness.counters["workers_lost"] == 1
    heartbeat(harness, b"hung", b"w1")  # w1 is back, with room for one window
    harness.step()
    harness.take(b"c")
    assert harness.drain(b"c2", 0, 1) == want_w1
