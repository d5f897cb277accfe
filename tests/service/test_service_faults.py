"""The service under bad input, bad messages, SIGTERM and a slow consumer.

Real processes on 127.0.0.1; each test states the property it checks.
"""

from __future__ import annotations

import json
import os
import signal
import socket as pysocket
import subprocess
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from _formats import manifest, write_shard
from _service import (
    FIXTURE,
    Service,
    children,
    consume,
    expected,
    flags,
    free_port,
    next_message,
    result,
    rss_anon_bytes,
    start,
    stats,
    wait_healthy,
)

from streampack import wire
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

pytestmark = pytest.mark.slow

BINDING = {"vocab_size": 512, "tokenizer": "t", "split_receipt": "r", "partition": "train"}


def write_bad_corpus(root: Path) -> tuple[Path, dict[int, str], int]:
    """JSON Lines: 60 good documents with 4 bad ones among them."""
    rng = np.random.default_rng(5)
    lines, bad = [], {}
    for i in range(64):
        if i == 7:
            lines.append(json.dumps({"tokens": [0, 5, 700, 1]}))
            bad[i] = "out_of_vocabulary"
        elif i == 20:
            lines.append(json.dumps({"tokens": [9]}))
            bad[i] = "too_short"
        elif i == 33:
            lines.append(json.dumps({"tokens": [3] * 400}))
            bad[i] = "too_long"
        elif i == 50:
            lines.append('{"tokens": [1, 2, 3')
            bad[i] = "malformed"
        else:
            n = int(rng.integers(2, 200))
            lines.append(json.dumps({"tokens": rng.integers(0, 512, n).tolist()}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    manifest(root, jsonl=["docs.jsonl"])
    return root, bad, 64


def test_bad_documents_are_quarantined_and_the_rest_arrives_once(tmp_path):
    """Property 6: each bad document quarantined with its reason; the rest exactly once."""
    corpus, bad, count = write_bad_corpus(tmp_path)
    quarantine = tmp_path / "quarantine.jsonl"
    records = [tmp_path / f"rank{r}.npy" for r in (0, 1)]
    with Service(corpus, serve_workers=2, quarantine_path=str(quarantine)) as service:
        ranks = [
            consume(service.consumer_endpoint, r, 2, "--record", str(records[r])) for r in (0, 1)
        ]
        outputs = [result(proc) for proc in ranks]
        counters = service.stats()
    written = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert {r["source_id"]: r["reason"] for r in written} == bad
    assert all(r["detail"] for r in written)
    assert counters["quarantined"] == 4
    assert counters["quarantine_reasons"] == {reason: 1 for reason in bad.values()}
    summary = json.loads(service.output.strip().splitlines()[-1])["producer"]
    assert summary["quarantined"] == 4
    got = np.concatenate([np.load(path) for path in records])
    assert sorted(got[:, 0].tolist()) == sorted(set(range(count)) - set(bad))
    assert outputs[0]["batches"] == outputs[1]["batches"]


def _request(endpoint: str, frames: list[bytes], timeout: float = 20.0) -> wire.Message | None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            return None
        return wire.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)
        context.term()


GARBAGE = [
    [b"\xff\x00garbage"],
    [msgpack.packb({"v": 99, "k": "ready", "credit": 1, "f": []})],
    [
        msgpack.packb(
            {
                "v": wire.PROTOCOL_VERSION,
                "k": "window",
                "epoch": 0,
                "window": 0,
                "binding": {},
                "config": {},
                "f": [],
            }
        )
    ],
    wire.encode(
        "fetch", {"rank": 3, "world_size": 2, "epoch": 0, "index": 3, "count": 1, "base": 0}
    ),
    [wire.encode_header("ready", {"credit": 1, "needs_tokens": False}), b"unannounced frame"],
]


def test_malformed_messages_to_producer_sockets_are_rejected_and_counted():
    """Property 6: a malformed message to each producer socket: error reply, counted,
    and the producer keeps serving (the stream afterwards is complete)."""
    with Service(FIXTURE, serve_workers=1, max_message_bytes=1 << 20) as service:
        for endpoint in (service.worker_endpoint, service.consumer_endpoint):
            for frames in GARBAGE:
                reply = _request(endpoint, [bytes(f) for f in frames])
                assert reply is not None and reply.kind == "error", frames
                assert reply.fields["message"]
        # An oversize frame is cut off by zmq.MAXMSGSIZE before it is parsed.
        context = zmq.Context()
        big = context.socket(zmq.DEALER)
        big.connect(service.consumer_endpoint)
        big.send(b"x" * (2 << 20))
        big.close(linger=0)
        context.term()
        counters = service.stats()
        assert counters["rejected_worker"] == len(GARBAGE)
        assert counters["rejected_consumer"] == len(GARBAGE)
        out = result(consume(service.consumer_endpoint, 0, 1))
    assert out["batches"] > 0 and out["fillers"] == 0


def not_next_fit(occurrences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A well-formed plan of the same documents that is not next-fit: one per row."""
    plan = occurrences.copy()
    rows = 4
    plan["row"] = np.arange(len(plan)) % rows
    plan["start"] = 0
    plan["stop"] = occurrences["stop"] - occurrences["start"]
    sizes = np.full(-(-len(plan) // rows), rows, np.int64)
    sizes[-1] = len(plan) - rows * (len(sizes) - 1)
    return plan, sizes


def test_worker_plans_that_are_not_their_window_are_refused_and_the_window_reissued():
    """A worker sends plans; the producer accepts only exactly the contract's plan of the
    window (recomputed with ``plan_ranges``). Plans that lose, repeat or shift a
    document, change a range, rewrite the ``doc`` column or are well-formed but not
    next-fit are refused with an error reply and counted, the window goes to another
    worker, and the consumer receives exactly the stream of an undisturbed run."""
    from streampack.config import PackConfig
    from streampack.packing import plan_compact, warm_up_kernels
    from streampack.wire import window_examples

    warm_up_kernels()  # the rogue never heartbeats: let it answer quickly
    with Service(FIXTURE, heartbeat_timeout=30.0) as service:
        consumer = consume(service.consumer_endpoint, 0, 1)
        context = zmq.Context()
        rogue = context.socket(zmq.DEALER)
        rogue.connect(service.worker_endpoint)
        refused = 0
        try:
            for attempt in range(5):
                # It asks for the tokens (as an auditing worker does) to plan the usual
                # way; the window comes back to it, the only worker, after each refusal.
                rogue.send_multipart(wire.encode("ready", {"credit": 1, "needs_tokens": True}))
                assert rogue.poll(60_000)
                window = wire.decode(rogue.recv_multipart())
                assert window.kind == "window" and window.fields["with_tokens"]
                occurrences, sizes = plan_compact(
                    window_examples(window.arrays),
                    wire.binding_from_wire(window.fields["binding"]),
                    PackConfig.from_wire(window.fields["config"]),
                )
                shifted = occurrences.copy()
                shifted["ordinal"] += 1
                widened = occurrences.copy()
                widened["range_stop"][0] += 1
                relocated = occurrences.copy()  # same tokens, claimed from elsewhere
                relocated["range_start"] += 7
                relocated["range_stop"] += 7
                short = sizes.copy()
                short[-1] -= 1
                plans, batch_sizes, complaint = [
                    (shifted, sizes, "['ordinal']"),
                    (occurrences[:-1], short, "batch sizes"),
                    (widened, sizes, "['range_stop']"),
                    (relocated, sizes, "['range_start', 'range_stop']"),
                    (*not_next_fit(occurrences), "batch sizes"),
                ][attempt]
                fields = {
                    "epoch": window.fields["epoch"],
                    "window": window.fields["window"],
                    "capacity": 256,
                    "seconds": 0.0,
                    "audited": 0,
                    "audit_failures": 0,
                    "audit_error": "",
                }
                rogue.send_multipart(
                    wire.encode(
                        "packed", fields, {"occurrences": plans, "batch_sizes": batch_sizes}
                    )
                )
                assert rogue.poll(60_000)
                reply = wire.decode(rogue.recv_multipart())
                assert reply.kind == "error" and complaint in reply.fields["message"], reply
                refused += 1
        finally:
            rogue.close(linger=0)
            context.term()
        service.add_worker()
        out = result(consumer)
        counters = service.stats()
    assert refused == 5
    assert counters["rejected_worker"] == 5 and counters["plans_refused"] == 5
    assert counters["windows_reissued"] >= 5 and counters["windows_failed"] == 0
    assert out["digest"] == expected(FIXTURE, 0, 1)["digest"]


def test_a_worker_rejects_malformed_windows_and_keeps_packing():
    """Property 6 for the worker's socket: this test plays the producer. A window sent
    without its tokens is planned from its ranges exactly as ``plan_compact`` plans it."""
    from streampack.config import PackConfig
    from streampack.packing import plan_compact
    from streampack.wire import window_examples

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = start("worker", "--connect", f"tcp://127.0.0.1:{port}", stdout=subprocess.DEVNULL)
    try:
        assert router.poll(120_000)
        identity, *frames = router.recv_multipart()
        assert wire.decode(frames).kind == "ready"

        for frames in GARBAGE[:3]:
            router.send_multipart([identity, *frames])
            assert next_message(router, {"error"}, timeout_ms=60_000).fields["message"]
        window = next(
            iter_windows(
                open_corpus(FIXTURE),
                0,
                CutSpec(capacity=256, window_documents=8, window_tokens=3000),
            )
        )
        fields = {
            "epoch": 0,
            "window": 0,
            "binding": BINDING
            | {"tokenizer": "fixture-bytes-v1", "split_receipt": "fixture-corpus-2026-01"},
            "config": {
                "capacity": 256,
                "max_rows_per_batch": 4,
                "max_cells": None,
                "max_metadata_bytes": 1 << 24,
            },
            "with_tokens": False,
        }
        # As the producer sends it to a worker that does not audit: no tokens.
        tokenless = window.arrays() | {"tokens": window.tokens[:0]}
        router.send_multipart([identity, *wire.encode("window", fields, tokenless)], copy=False)
        packed = next_message(router, {"packed"}, timeout_ms=60_000)
        assert packed.fields["window"] == 0 and packed.fields["capacity"] == 256
        occurrences, sizes = plan_compact(
            window_examples(window.arrays()),
            wire.binding_from_wire(fields["binding"]),
            PackConfig.from_wire(fields["config"]),
        )
        np.testing.assert_array_equal(packed.arrays["occurrences"], occurrences)
        np.testing.assert_array_equal(packed.arrays["batch_sizes"], sizes)
        fields["with_tokens"] = True
        # a window that cannot pack (budget too small) is answered with ``failed``
        fields["config"] = dict(fields["config"], max_metadata_bytes=16)
        router.send_multipart(
            [identity, *wire.encode("window", fields, window.arrays())], copy=False
        )
        assert (
            "max_metadata_bytes"
            in next_message(router, {"failed"}, timeout_ms=60_000).fields["error"]
        )
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()
        router.close(linger=0)
        context.term()


def test_sigterm_stops_serve_quickly_with_no_orphans():
    """Property 7: serve exits within a few seconds; workers gone; ports free again."""
    worker_port, consumer_port = free_port(), free_port()
    serve = start(
        "serve",
        "--workers",
        "2",
        *flags({"corpus": str(FIXTURE)}),
        "--worker-endpoint",
        f"tcp://127.0.0.1:{worker_port}",
        "--consumer-endpoint",
        f"tcp://127.0.0.1:{consumer_port}",
    )
    try:
        endpoint = f"tcp://127.0.0.1:{consumer_port}"
        wait_healthy(endpoint)
        deadline = time.monotonic() + 120
        while stats(endpoint)["workers"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = children(serve.pid)
        assert len(workers) == 2
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0
    assert elapsed < 6.0, f"serve took {elapsed:.1f}s to stop"
    assert json.loads(out.strip().splitlines()[-1])["producer"]["workers_joined"] == 2
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived serve"
    for port in (worker_port, consumer_port):
        with pysocket.socket() as s:
            s.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_a_worker_killed_under_serve_is_restarted():
    with Service(FIXTURE, serve_workers=1, heartbeat_timeout=2.0) as service:
        deadline = time.monotonic() + 60
        while not children(service.producer.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (first,) = children(service.producer.pid)
        os.kill(first, signal.SIGKILL)
        out = result(consume(service.consumer_endpoint, 0, 1))
        (second,) = children(service.producer.pid)
    assert second != first and out["batches"] > 0
    assert json.loads(service.output.strip().splitlines()[-1])["producer"]["worker_restarts"] == 1


def write_big_corpus(root: Path, tokens: int) -> Path:
    rng = np.random.default_rng(9)
    lengths = rng.integers(16, 513, size=tokens // 264)
    tokens = rng.integers(0, 512, int(lengths.sum()))
    write_shard(root, "big", np.split(tokens, np.cumsum(lengths)[:-1]), np.uint16)
    return manifest(root, shards=["big"])


def test_memory_stays_within_budgets_with_a_slow_consumer(tmp_path):
    """Property 5: a slow consumer; the producer holds at most its byte budgets (plus the
    output of the windows in flight) and resident memory stays put, although an
    unbounded producer would pack the whole 8M-token corpus (~2,000 batches)."""
    corpus = write_big_corpus(tmp_path, 8_000_000)
    budgets = {"window_budget_bytes": 256 << 10, "reorder_budget_bytes": 1 << 20}
    settings = {
        "capacity": 512,
        "max_rows_per_batch": 8,
        "window_documents": 256,
        "window_tokens": 32768,
        **budgets,
    }
    with Service(corpus, serve_workers=2, **settings) as service:
        deadline = time.monotonic() + 60
        while len(children(service.producer.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        processes = [service.producer.pid, *children(service.producer.pid)]
        reader = consume(service.consumer_endpoint, 0, 1, "--delay", "0.05", "--max-batches", "80")
        samples: list[dict] = []
        baseline = None
        while reader.poll() is None:
            now = service.stats()
            rss = [rss_anon_bytes(pid) for pid in processes]
            if baseline is None and now["batches_served"] >= 5:
                baseline = rss
            if baseline is not None:
                samples.append({"stats": now, "rss": rss})
            time.sleep(0.2)
        out = result(reader)
    assert out["batches"] == 80 and len(samples) >= 5
    # Batches travel compact: one window's output is its <= 32768 selected tokens (2 bytes
    # each: the vocabulary fits uint16) and <= 256 occurrence records. A window holds
    # <= 32768 * 2 + 256 * 48 bytes, so at most four are in flight (the last one cut
    # while the others held less than the 256 KiB budget).
    window_output = 32768 * 2 + 256 * 64
    for sample in samples:
        now = sample["stats"]
        assert now["reorder_bytes"] <= budgets["reorder_budget_bytes"] + 4 * window_output
        assert now["window_bytes"] <= budgets["window_budget_bytes"] + 32768 * 2 + 256 * 48
    final = samples[-1]
    allowance = sum(budgets.values()) + (48 << 20)
    for pid_index, (before, after) in enumerate(zip(baseline, final["rss"])):
        assert after - before <= allowance, (pid_index, before, after)
    # The producer did not run ahead: besides the 80 consumed it holds what the 1 MiB
    # reorder budget takes (~130 compact batches of ~8 KB) and four windows in flight
    # (<= 16 batches each); the whole corpus would be ~2,000 batches.
    assert final["stats"]["batches_received"] <= 80 + 130 + 4 * 16 + 20


def test_unbounded_epochs_stream_on_and_audits_reach_the_producer():
    """epochs = 0 streams epoch after epoch (each its own shuffle); ``--audit-every``
    audits batches in the workers and the producer counts the outcomes."""
    from _service import SMALL

    from streampack.client import BatchStream
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    settings = {"epochs": 0, "shuffle": True, "seed": 2}
    reference = rank_stream(ProducerSettings(corpus=str(FIXTURE), **SMALL, **settings), 0, 1)
    want = [next(reference) for _ in range(110)]  # two epochs and a bit (~47 each)
    assert want[-1][0] == 2
    with Service(FIXTURE, serve_workers=1, audit_every=10, **settings) as service:
        with BatchStream(service.consumer_endpoint, rank=0, world_size=1, timeout=120) as s:
            got = []
            for batch in s:
                got.append((*s.current, batch.digest()))
                if len(got) == len(want):
                    break
        counters = service.stats()
    assert got == [(e, i, b.digest()) for e, i, b in want]
    assert counters["audited"] >= 5
    assert counters["audit_failures"] == 0, counters.get("last_audit_error")


def test_a_corpus_with_nothing_packable_ends_an_unbounded_stream(tmp_path):
    """Every document bad and epochs = 0: the stream ends (no busy loop), all quarantined."""
    lines = ['{"tokens": [1]}', "not json", '{"tokens": [1, 2, 9999]}']
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    manifest(tmp_path, jsonl=["docs.jsonl"])
    with Service(tmp_path, serve_workers=1, epochs=0) as service:
        out = result(consume(service.consumer_endpoint, 0, 1))
        counters = service.stats()
    assert out["batches"] == 0
    assert counters["quarantined"] == 3


def test_curve_producer_serves_only_clients_that_know_its_key(tmp_path):
    """With a CURVE secret key the producer's sockets encrypt; workers (under serve) and
    consumers given its public key get the full stream, a client without it nothing.
    The public key begins with "-" (as about 1 in 80 do): serve must still hand it to
    its workers as a value, not an option."""
    from _service import DASH_PUBLIC, DASH_SECRET

    from streampack.client import BatchStream, StreamTimeout
    from streampack.service.health import check

    (tmp_path / "producer.key").write_text(DASH_SECRET + "\n")
    with Service(
        FIXTURE, serve_workers=1, curve_secret_key_file=str(tmp_path / "producer.key")
    ) as service:
        assert service.key == DASH_PUBLIC
        with BatchStream(
            service.consumer_endpoint,
            rank=0,
            world_size=1,
            timeout=120,
            curve_server_key=service.key,
        ) as stream:
            batches = sum(1 for _ in stream)
        assert check(service.consumer_endpoint, 1.0) is None
        with BatchStream(service.consumer_endpoint, rank=0, world_size=1, timeout=1) as plain:
            with pytest.raises(StreamTimeout):
                next(plain)
    assert batches == expected(FIXTURE, 0, 1)["batches"]
