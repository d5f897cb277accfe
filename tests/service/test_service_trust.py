"""The service's guarantees when a worker, a consumer or a message misbehaves: real
processes, a hostile peer written with raw ZeroMQ, small budgets and short timeouts.

Each test names the defect of the reliability issue it holds (``defect N``). The
oracle is always the same: what a trainer receives equals ``digest``'s stream.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq
from _service import FIXTURE, Service, consume, expected, result

from streampack import wire
from streampack.client import RESEND_AFTER, BatchStream

pytestmark = pytest.mark.slow


class Peer:
    """A raw DEALER on a producer endpoint: whatever a test makes it say."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(endpoint)

    def send(self, kind: str, fields: dict, arrays: dict | None = None) -> None:
        self.socket.send_multipart(wire.encode(kind, fields, arrays))

    def receive(self, timeout: float = 10.0) -> wire.Message | None:
        if not self.socket.poll(int(timeout * 1000)):
            return None
        return wire.decode(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


class FakeWorker(threading.Thread):
    """A pack worker written with raw ZeroMQ: it says ``ready``, heartbeats every 0.2 s
    and answers its first ``slow`` windows honestly after ``delay`` seconds — or never
    (``None``: a hung process whose heartbeat thread lives on) — and the rest at once."""

    def __init__(
        self, endpoint: str, delay: float | None, credit: int = 2, slow: int = 1 << 30
    ) -> None:
        super().__init__(daemon=True)
        self.peer = Peer(endpoint)
        self.delay = delay
        self.credit = credit
        self.slow = slow
        self.stopping = threading.Event()
        self.taken = 0

    def run(self) -> None:
        from streampack.config import PackConfig
        from streampack.service.plan_check import ranges_plan

        self.peer.send("ready", {"credit": self.credit, "needs_tokens": False})
        due: list[tuple[float, wire.Message]] = []
        next_beat = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.peer.send("heartbeat", {"free": 1, "needs_tokens": False})
                next_beat = now + 0.2
            while due and due[0][0] <= now:
                _, window = due.pop(0)
                occurrences, sizes = ranges_plan(
                    window.arrays, PackConfig.from_wire(window.fields["config"])
                )
                fields = {
                    "epoch": window.fields["epoch"],
                    "window": window.fields["window"],
                    "capacity": window.fields["config"]["capacity"],
                    "seconds": self.delay,
                    "audited": 0,
                    "audit_failures": 0,
                    "audit_error": "",
                }
                self.peer.send("packed", fields, {"occurrences": occurrences, "batch_sizes": sizes})
                self.peer.send("ready", {"credit": 1, "needs_tokens": False})
            message = self.peer.receive(timeout=0.05)
            if message is not None and message.kind == "window":
                self.taken += 1
                if self.taken > self.slow:
                    due.append((time.monotonic(), message))
                elif self.delay is not None:
                    due.append((time.monotonic() + self.delay, message))

    def close(self) -> None:
        self.stopping.set()
        self.join(5)
        self.peer.close()


def timed_digests(stream: BatchStream, waits: list[float]) -> list:
    """``digests`` with the seconds each ``next()`` waited appended to ``waits``."""
    out = []
    while True:
        asked = time.monotonic()
        try:
            batch = next(stream)
        except StopIteration:
            return out
        waits.append(time.monotonic() - asked)
        out.append((*stream.current, batch.digest()))


def read_ranks(endpoint: str, world_size: int, timeout: float) -> tuple[dict, list[float]]:
    """Every rank read in a thread of its own: {rank: digests}, and every wait."""
    got: dict[int, list] = {}
    waits: list[float] = []
    errors: list[BaseException] = []

    def read(rank: int) -> None:
        try:
            with BatchStream(endpoint, rank=rank, world_size=world_size, timeout=timeout) as s:
                got[rank] = timed_digests(s, waits)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return got, waits


def fetch(rank: int, world_size: int, epoch: int, index: int, count: int = 1) -> dict:
    return {
        "rank": rank,
        "world_size": world_size,
        "epoch": epoch,
        "index": index,
        "count": count,
        "base": 0,
    }


def digests(stream: BatchStream, limit: int | None = None) -> list:
    out = []
    for batch in stream:
        out.append((*stream.current, batch.digest()))
        if limit is not None and len(out) == limit:
            break
    return out


def test_a_trainer_resuming_20_behind_a_full_reorder_buffer_receives_exactly_the_rest():
    """Defect 1, the resumed-trainer scenario: the workers run ahead until the reorder
    buffer is at its budget; the trainer dies and resumes from a checkpoint 20 batches
    behind what it had received; it receives exactly the rest of the stream."""
    budget = 12_000
    want = expected(FIXTURE, 0, 1)["list"]
    with Service(FIXTURE, reorder_budget_bytes=budget) as service:
        service.add_worker()
        service.add_worker()
        with BatchStream(
            service.consumer_endpoint, rank=0, world_size=1, timeout=30, prefetch=4
        ) as stream:
            first = digests(stream, limit=30)
            deadline = time.monotonic() + 30
            while service.stats()["reorder_bytes"] < budget:
                assert time.monotonic() < deadline, service.stats()
                time.sleep(0.05)
        with BatchStream(service.consumer_endpoint, rank=0, world_size=1, timeout=30) as stream:
            stream.load_state_dict({"epoch": 0, "index": 10})
            rest = digests(stream)
        counters = service.stats()
    assert first == want[:30]
    assert rest == want[10:]
    assert counters["rewinds"] >= 1


def test_a_worker_asking_for_more_credit_than_allowed_starts_no_error_storm():
    """Defect 4: ``worker --prefetch 100`` (above the 64 windows a worker may hold): the
    producer clamps the credit; no error is exchanged and the stream is complete."""
    with Service(FIXTURE) as service:
        service.add_worker("--prefetch", "100")
        out = result(consume(service.consumer_endpoint, 0, 1, "--timeout", "30"), timeout=60)
        counters = service.stats()
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]
    assert counters["rejected_worker"] == 0 and counters["peer_errors"] == 0
    assert counters["credit_clamped"] >= 1


def test_a_strangers_world_size_does_not_lock_the_job_out():
    """Defect 5: the first fetch comes from a stranger at world size 3; the real job at
    world size 2 receives its streams."""
    with Service(FIXTURE, serve_workers=1) as service:
        stranger = Peer(service.consumer_endpoint)
        stranger.send("fetch", fetch(2, 3, 0, 2))
        reply = stranger.receive()
        stranger.close()
        assert reply is not None and reply.kind == "batch"
        ranks = [consume(service.consumer_endpoint, r, 2, "--timeout", "30") for r in (0, 1)]
        outs = [result(proc, timeout=60) for proc in ranks]
    assert [o["digest"] for o in outs] == [expected(FIXTURE, r, 2)["digest"] for r in (0, 1)]


def test_waves_of_workers_that_join_and_vanish_quarantine_nothing():
    """Defect 6: waves of peers register with all the credit they may, take what they
    are given and vanish; no window is quarantined and the stream is complete."""
    with Service(FIXTURE, heartbeat_timeout=0.5) as service:
        trainer = consume(service.consumer_endpoint, 0, 1, "--timeout", "60")
        for _ in range(8):
            peers = [Peer(service.worker_endpoint) for _ in range(4)]
            for peer in peers:
                peer.send("ready", {"credit": 64, "needs_tokens": False})
            for peer in peers:
                peer.receive(timeout=2.0)
                peer.close()
            time.sleep(0.8)  # past the heartbeat timeout: the producer forgets them
        service.add_worker()
        out = result(trainer, timeout=90)
        counters = service.stats()
    assert counters["windows_failed"] == 0 and counters["quarantined"] == 0
    assert counters["workers_lost"] >= 8
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]


def test_out_of_range_counters_from_a_peer_cannot_crash_the_producer():
    """Defect 7: ``packed`` with ``audited`` = 2**64 - 1 from a peer that holds no
    window, twice, then a health probe: the producer answers and serves on."""
    with Service(FIXTURE, serve_workers=1) as service:
        peer = Peer(service.worker_endpoint)
        fields = {
            "epoch": 0,
            "window": 0,
            "capacity": 256,
            "seconds": 0.0,
            "audited": 2**64 - 1,
            "audit_failures": 0,
            "audit_error": "",
        }
        plans = {
            "occurrences": np.zeros(0, wire.frame_dtype("occurrence")),
            "batch_sizes": np.zeros(0, np.int64),
        }
        for _ in range(2):
            peer.send("packed", fields, plans)
            reply = peer.receive()
            assert reply is not None and reply.kind == "error"
        peer.close()
        counters = service.stats()
        out = result(consume(service.consumer_endpoint, 0, 1, "--timeout", "30"), timeout=60)
    assert counters["rejected_worker"] == 2 and counters["audited"] == 0
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]


def test_failed_from_a_peer_that_holds_no_window_loses_no_document():
    """Defect 10: ``failed`` for windows a peer was never given is refused; nothing is
    quarantined and the stream is complete."""
    with Service(FIXTURE) as service:
        trainer = consume(service.consumer_endpoint, 0, 1, "--timeout", "30")
        peer = Peer(service.worker_endpoint)
        for window in range(6):
            peer.send("failed", {"epoch": 0, "window": window, "error": "x\nforged line"})
            assert peer.receive().kind == "error"
        peer.close()
        service.add_worker()
        out = result(trainer, timeout=60)
        counters = service.stats()
    assert counters["quarantined"] == 0 and counters["windows_failed"] == 0
    assert counters["rejected_worker"] == 6
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]


def test_resends_do_not_pile_up_and_the_pending_table_is_bounded():
    """Defect 2: the same fetch sent 50 times is pending once; 80 identities x 1024
    fetches of a far epoch stay under the table's bound."""
    from streampack.service.delivery import MAX_PENDING

    with Service(FIXTURE, epochs=0) as service:
        peer = Peer(service.consumer_endpoint)
        for _ in range(50):
            peer.send("fetch", fetch(0, 1, 1000, 0, count=4))
        time.sleep(0.5)
        assert service.stats()["pending_fetches"] == 4
        peer.close()
        flood = [Peer(service.consumer_endpoint) for _ in range(80)]
        for peer in flood:
            peer.send("fetch", fetch(0, 1, 1000, 0, count=1024))
        time.sleep(2.0)
        pending = service.stats()["pending_fetches"]
        for peer in flood:
            peer.close()
    assert 4 < pending <= MAX_PENDING


def test_a_worker_that_heartbeats_but_never_answers_holds_no_window_for_long():
    """Defect 3: a hung worker keeps heartbeating; its window goes to another worker (a
    backup copy, or at the window's deadline) and the stream completes; backups or not,
    the deadline still drops the hung worker."""
    with Service(FIXTURE, window_timeout=2.0) as service:
        trainer = consume(service.consumer_endpoint, 0, 1, "--timeout", "60")
        hung = Peer(service.worker_endpoint)
        hung.send("ready", {"credit": 1, "needs_tokens": False})
        assert hung.receive().kind == "window"
        service.add_worker()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            trainer.poll() is None or service.stats()["workers_dropped"] == 0
        ):
            hung.send("heartbeat", {"free": 1, "needs_tokens": False})
            time.sleep(0.2)
        out = result(trainer, timeout=10)
        counters = service.stats()
        hung.close()
    assert counters["workers_dropped"] >= 1 and counters["windows_overdue"] >= 1
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]


#: The longest a trainer may wait for one batch while a worker hangs, with backups:
#: ``backup_after`` (1 s), a producer tick (0.25 s) and the copy's round trip, with
#: room for a loaded two-core machine. Without backups it is ``window_timeout`` (60 s).
HUNG_WAIT_BOUND = 3.0


def test_a_hung_worker_costs_the_trainers_a_second_not_the_deadline():
    """Issue 22: one real worker and one that heartbeats but never answers, which
    takes the window the stream needs first; consumers with a 5 s timeout (the
    deadline is 60 s). Every batch arrives, exactly digest's stream, and the longest
    wait is about ``backup_after``."""
    with Service(FIXTURE) as service:
        hung = FakeWorker(service.worker_endpoint, delay=None)
        hung.start()
        service.add_worker()
        deadline = time.monotonic() + 60
        while service.stats()["workers"] < 2:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.1)
        try:
            got, waits = read_ranks(service.consumer_endpoint, 2, timeout=5.0)
            counters = service.stats()
        finally:
            hung.close()
    print(f"longest wait for a batch with a hung worker: {max(waits):.3f} s")
    for rank in (0, 1):
        assert got[rank] == expected(FIXTURE, rank, 2)["list"]
    assert hung.taken >= 1 and counters["windows_backed_up"] >= 1
    assert counters["backup_wins"] >= 1 and counters["workers_dropped"] == 0
    assert max(waits) < HUNG_WAIT_BOUND


def test_strangers_in_the_fetch_table_cannot_crowd_out_a_waiting_rank():
    """Issue 22: a rank waits for the first batches, which a slow worker packs in 2 s;
    meanwhile 100 strangers ask for 1,024 batches each, far ahead, and leave. The
    table stays bounded and the rank keeps its fetches: every batch comes in a bounded
    wait, never after the resend the client makes after silence (RESEND_AFTER = 5 s),
    which a rank forgotten for room would need."""
    from streampack.service.delivery import MAX_PENDING

    with Service(FIXTURE) as service:
        slow = FakeWorker(service.worker_endpoint, delay=2.0, slow=1)
        slow.start()
        result: dict = {}

        def rank() -> None:
            result["got"], result["waits"] = read_ranks(service.consumer_endpoint, 1, 30.0)

        reader = threading.Thread(target=rank)
        try:
            reader.start()
            deadline = time.monotonic() + 30
            while service.stats()["pending_fetches"] == 0:  # the oldest in the table
                assert time.monotonic() < deadline, "the rank sent no fetch"
                time.sleep(0.05)
            strangers = [Peer(service.consumer_endpoint) for _ in range(100)]
            for stranger in strangers:
                stranger.send("fetch", fetch(0, 1, 0, 10**6, count=1024))
            time.sleep(0.5)
            pending = service.stats()["pending_fetches"]
            for stranger in strangers:
                stranger.close()
            reader.join(timeout=120)
        finally:
            slow.close()
    waits = result["waits"]
    print(f"longest wait for a batch with the table full of strangers: {max(waits):.3f} s")
    assert MAX_PENDING - 1024 <= pending <= MAX_PENDING
    assert result["got"][0] == expected(FIXTURE, 0, 1)["list"]
    assert max(waits) < RESEND_AFTER - 1.0
