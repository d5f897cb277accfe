"""The data plane (``data_plane = "workers"``) end to end: real processes, real sockets.

The worker whose plan of a window the producer accepted serves the window's batches;
the producer sends each consumer a route (endpoint + the route digest, from its own
window) and the consumer fetches the batch there, checks it before it is yielded, and takes it from
the producer whenever the worker fails it. Whatever the workers do, the stream is the
``streampack digest`` stream, byte for byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _service import FIXTURE, ROOT, Service, drain_ranks, env, expected, stream_digest

from streampack.client import BatchStream

pytestmark = pytest.mark.slow

SHUFFLED = {"shuffle": True, "seed": 11, "epochs": 2}
SERVE = ("--serve-endpoint", "tcp://127.0.0.1:*")


@pytest.fixture(scope="module")
def reference():
    return {rank: expected(FIXTURE, rank, 2, **SHUFFLED) for rank in (0, 1)}


@pytest.fixture(scope="module")
def one_rank():
    return expected(FIXTURE, 0, 1, epochs=2)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_stream_through_the_workers_is_the_digest_stream(workers, reference):
    with Service(FIXTURE, serve_workers=workers, data_plane="workers", **SHUFFLED) as service:
        received = drain_ranks(service.consumer_endpoint, 2)
        stats = service.stats()
    for rank in (0, 1):
        got = stream_digest(received[rank])
        assert got == (reference[rank]["digest"], reference[rank]["batches"])
    # Every batch went through a worker: none was rerouted, each counted once.
    assert stats["batches_rerouted"] == 0 and stats["worker_batches_refused"] == 0
    assert stats["batches_routed"] == stats["batches_served"] > 0
    # The producer sent routes, not tokens: well under a byte per real token.
    assert stats["bytes_sent_to_consumers"] < stats["tokens_served"]
    # It counted from its plans, not from gathered batches: exactly what the ranks read.
    for rank, items in received.items():
        assert stats["tokens_served_by_rank"][str(rank)] == sum(
            int(batch.target_valid.sum()) for _, batch in items
        )
        assert stats["supervised_targets_served_by_rank"][str(rank)] == sum(
            int(batch.loss_mask.sum()) for _, batch in items
        )


def serving_peer(service: Service, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "service" / "_serving_peer.py"),
            mode,
            "--connect",
            service.worker_endpoint,
            "--heartbeat-interval",
            "0.2",
            *SERVE,
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
    )
    service.workers.append(proc)
    return proc


def read_all(endpoint: str, **kwargs) -> tuple[list, dict, float]:
    """(epoch, index, digest) of every batch, the stream's metrics, the longest wait."""
    got, longest = [], 0.0
    with BatchStream(endpoint, rank=0, world_size=1, timeout=120, **kwargs) as stream:
        last = time.monotonic()
        for batch in stream:
            now = time.monotonic()
            if got:
                longest = max(longest, now - last)
            last = now
            got.append((*stream.current, batch.digest()))
        return got, stream.metrics(), longest


@pytest.mark.parametrize("mode", ["tamper", "drop", "repeat", "reorder", "other"])
def test_a_worker_that_serves_a_wrong_batch_is_caught_before_the_batch_is_yielded(mode, one_rank):
    """Its plans pass (they are the contract's); the batches it serves have a token
    changed, their last document dropped or repeated, their first two documents'
    tokens swapped, or are another window's batch (``_serving_peer``). The consumer's
    digest check refuses the first such batch, the producer sends it and stops routing
    to that worker: the stream is exact."""
    with Service(FIXTURE, epochs=2, data_plane="workers") as service:
        serving_peer(service, mode)
        got, metrics, _ = read_all(service.consumer_endpoint)
        stats = service.stats()
    assert got == one_rank["list"]
    assert metrics["worker_batches_refused"] >= 1
    assert metrics["batches_rerouted"] == metrics["worker_batches_refused"]
    assert stats["workers_refused_serving"] == 1
    assert stats["worker_batches_refused"] == metrics["worker_batches_refused"]
    assert stats["batches_served"] == len(got) - metrics["fillers"]  # rerouted: once


def test_a_worker_that_takes_a_get_and_never_answers_costs_a_bounded_wait(one_rank):
    with Service(FIXTURE, epochs=2, data_plane="workers") as service:
        serving_peer(service, "hang")
        got, metrics, longest = read_all(service.consumer_endpoint, route_timeout=0.5)
        stats = service.stats()
    assert got == one_rank["list"]
    assert metrics["batches_rerouted"] >= 1 and metrics["worker_batches_refused"] == 0
    assert metrics["batches_from_workers"] == 0
    assert stats["workers_refused_serving"] == 0  # slow is not wrong
    # The first route waits route_timeout; then the worker is skipped for a while, and
    # a reroute is a replay of a few windows: no wait near the 120 s stream timeout.
    assert longest < 10.0, longest


def test_kill_9_of_a_worker_consumers_hold_routes_to_gives_the_exact_stream(one_rank):
    """The only serving worker is killed with its store full of routed batches; the
    consumer's routes to it fail, the producer sends those batches itself (replaying
    the windows on a new worker) and the stream is exact."""
    with Service(FIXTURE, epochs=2, data_plane="workers", heartbeat_timeout=2.0) as service:
        victim = service.add_worker(*SERVE)
        got = []
        with BatchStream(
            service.consumer_endpoint, rank=0, world_size=1, timeout=120, route_timeout=1.0
        ) as stream:
            for batch in stream:
                got.append((*stream.current, batch.digest()))
                if len(got) == 5:
                    os.kill(victim.pid, signal.SIGKILL)
                    victim.wait()
                    service.add_worker(*SERVE)
            metrics = stream.metrics()
        stats = service.stats()
    assert got == one_rank["list"]
    assert metrics["batches_rerouted"] >= 1 and metrics["worker_batches_refused"] == 0
    assert metrics["batches_from_workers"] >= 5
    assert stats["batches_served"] == len(got) - metrics["fillers"]
