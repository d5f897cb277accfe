"""Prometheus metrics: the producer's and workers' ``/metrics``, scraped over HTTP.

The end-to-end test runs a real ``serve`` (producer + 2 worker processes) and two
``consume`` processes, scrapes every ``/metrics`` endpoint with urllib and parses it
with ``prometheus_client``'s own parser; the counters must agree with what the
consumers printed, with the quarantine file and with ``health``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _formats import manifest, masks, write_shard
from _service import (
    FIXTURE,
    SMALL,
    Service,
    consume,
    drain_ranks,
    expected,
    free_port,
    result,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streampack.errors import InvalidConfig
from streampack.render import load_batch
from streampack.service.metrics import (
    METRICS,
    QUARANTINE_REASONS,
    STORAGE_METRICS,
    MetricsServer,
    ProducerMetrics,
    StorageCollector,
    WorkerMetrics,
)
from streampack.service.producer import Producer
from streampack.settings import ProducerSettings

BINDING = {
    "vocab_size": 512,
    "tokenizer": "metrics-test",
    "split_receipt": "metrics",
    "partition": "train",
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        return samples(answer.read().decode())


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


def exported_names(scraped: dict) -> set[str]:
    """Metric names as METRICS lists them (histogram samples under their base name)."""
    names = set()
    for name, _ in scraped:
        for suffix in ("_bucket", "_count", "_sum", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in METRICS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def test_the_collector_reads_the_producers_counters_at_scrape_time():
    producer = Producer(
        ProducerSettings(
            corpus=str(FIXTURE), capacity=256, window_tokens=3000, window_budget_bytes=1 << 20
        )
    )
    metrics = ProducerMetrics(
        producer.snapshot,
        window_budget_bytes=1 << 20,
        reorder_budget_bytes=producer.settings.reorder_budget_bytes,
    )
    before = samples(generate_latest(metrics.registry).decode())
    assert value(before, "streampack_batches_served_total") == 0
    assert value(before, "streampack_documents_quarantined_total", reason="too_long") == 0
    # The producer counts; the next scrape shows it, with nothing registered per event.
    counters = producer.coordinator.counters
    counters.add("batches_served", 3)
    counters.add("windows_reissued", 2)
    counters.add("rejected_consumer", 1)
    counters.add("tokens_served", 500)
    counters.add("cells_served", 1024)
    counters.served_to_rank(0, 300, 120)
    counters.served_to_rank(1, 200, 80)
    counters.served_by_source(np.array([0, 1, 1]), np.array([10, 20, 30]), np.array([4, 0, 9]))
    for _ in range(4):
        counters.quarantine("too_long")
    producer.coordinator.delivery.ready_bytes = 4096
    metrics.observe_pack(0.003)
    after = samples(generate_latest(metrics.registry).decode())
    assert value(after, "streampack_batches_served_total") == 3
    assert value(after, "streampack_windows_reissued_total") == 2
    assert value(after, "streampack_messages_rejected_total", peer="consumer") == 1
    assert value(after, "streampack_tokens_served_total", rank="0") == 300
    assert value(after, "streampack_tokens_served_total", rank="1") == 200
    assert value(after, "streampack_supervised_targets_served_total", rank="0") == 120
    assert value(after, "streampack_supervised_targets_served_total", rank="1") == 80
    assert value(after, "streampack_source_tokens_served_total", source="1") == 50
    assert value(after, "streampack_source_supervised_targets_served_total", source="0") == 4
    assert value(after, "streampack_source_supervised_targets_served_total", source="1") == 9
    assert value(after, "streampack_source_documents_served_total", source="1") == 2
    assert value(after, "streampack_fill_ratio") == pytest.approx(500 / 1024)
    assert value(after, "streampack_documents_quarantined_total", reason="too_long") == 4
    assert value(after, "streampack_reorder_bytes") == 4096
    assert value(after, "streampack_window_budget_bytes") == 1 << 20
    assert value(after, "streampack_window_pack_seconds_count") == 1
    assert value(after, "streampack_window_pack_seconds_bucket", le="0.005") == 1
    assert value(after, "streampack_window_pack_seconds_bucket", le="0.0025") == 0
    # Every exported name is documented in METRICS (which the dashboard test reads).
    worker = WorkerMetrics({"windows": 1})
    names = exported_names(after) | exported_names(
        samples(generate_latest(worker.registry).decode())
    )
    assert names - set(METRICS) == set()
    # Counted once reported; the storage metrics once a remote corpus is read (their
    # label is its scheme: tests/corpus/test_remote_metrics.py).
    storage = {name for name, _, _ in STORAGE_METRICS.values()}
    assert set(METRICS) - names <= {"streampack_pack_seconds_total"} | storage


def test_a_port_that_cannot_be_used_is_one_clear_error():
    registry = WorkerMetrics({}).registry
    server = MetricsServer(registry, 0)
    try:
        with pytest.raises(InvalidConfig, match=f"metrics_port = {server.port} .*cannot listen"):
            MetricsServer(registry, server.port)
    finally:
        server.close()
    with pytest.raises(InvalidConfig, match="metrics_port = 70000 must be a TCP port"):
        ProducerSettings(metrics_port=70000)


def write_corpus(root: Path) -> dict[str, int]:
    """JSON Lines: 80 documents, 5 of them bad, with their reasons."""
    rng = np.random.default_rng(16)
    lines, reasons = [], collections.Counter()
    for i in range(80):
        if i in (3, 41):
            lines.append(json.dumps({"tokens": [0, 1, 900, 2]}))
            reasons["out_of_vocabulary"] += 1
        elif i == 17:
            lines.append(json.dumps({"tokens": [4]}))
            reasons["too_short"] += 1
        elif i in (29, 60):
            lines.append(json.dumps({"tokens": [5] * 300}))
            reasons["too_long"] += 1
        else:
            lines.append(
                json.dumps({"tokens": rng.integers(0, 512, int(rng.integers(2, 180))).tolist()})
            )
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    manifest(root, binding=BINDING, jsonl=["docs.jsonl"])
    return dict(reasons)


def test_scraped_metrics_agree_with_the_consumers_and_the_quarantine_file(tmp_path):
    reasons = write_corpus(tmp_path)
    quarantine = tmp_path / "quarantine.jsonl"
    port = free_port()
    with Service(
        tmp_path, serve_workers=2, quarantine_path=str(quarantine), metrics_port=port
    ) as service:
        ranks = [consume(service.consumer_endpoint, r, 2) for r in (0, 1)]
        outputs = [result(proc) for proc in ranks]
        producer = scrape(port)
        health = service.stats()
        workers = [scrape(port + 1 + slot) for slot in (0, 1)]
        # A rank's batch saved by consume, for `streampack inspect --batch-file`.
        saved = tmp_path / "batch.npz"
        result(
            consume(
                service.consumer_endpoint, 1, 2, "--max-batches", "2", "--save-batch", str(saved)
            )
        )
    want = expected(tmp_path, 1, 2)["list"][1]  # (epoch, index, digest) of rank 1's 2nd
    assert want[:2] == (0, 3) and load_batch(saved).digest() == want[2]
    # What the consumers received, and the CPU they spent on it (within their run).
    assert all(0 < o["cpu_seconds"] < o["seconds"] * (os.cpu_count() or 1) for o in outputs)
    batches = sum(o["batches"] - o["fillers"] for o in outputs)
    assert value(producer, "streampack_batches_served_total") == batches == health["batches_served"]
    assert value(producer, "streampack_fillers_served_total") == sum(o["fillers"] for o in outputs)
    for rank, output in enumerate(outputs):
        assert value(producer, "streampack_tokens_served_total", rank=str(rank)) == output["tokens"]
    tokens = sum(o["tokens"] for o in outputs)
    cells = value(producer, "streampack_cells_served_total")
    assert cells == batches * 4 * 256 or 0 < cells < batches * 4 * 256
    assert value(producer, "streampack_fill_ratio") == pytest.approx(tokens / cells)
    # What the quarantine file holds, by reason, and every known reason at 0 besides.
    written = collections.Counter(
        json.loads(line)["reason"] for line in quarantine.read_text().splitlines()
    )
    assert written == reasons
    for reason in QUARANTINE_REASONS:
        assert (
            value(producer, "streampack_documents_quarantined_total", reason=reason)
            == written.get(reason, 0)
            == health["quarantine_reasons"].get(reason, 0)
        )
    # Gauges against their budgets, and the workers.
    assert value(producer, "streampack_workers") == 2
    assert (
        value(producer, "streampack_window_bytes_peak")
        <= value(producer, "streampack_window_budget_bytes") + 64 * 1024
    )
    assert value(producer, "streampack_pending_fetches") == 0
    assert value(producer, "streampack_windows_reissued_total") == 0
    received = value(producer, "streampack_batches_received_total")
    assert sum(value(w, "streampack_worker_batches_packed_total") for w in workers) == received
    windows = value(producer, "streampack_windows_issued_total")
    assert sum(value(w, "streampack_worker_windows_packed_total") for w in workers) == windows
    assert sum(value(w, "streampack_worker_pack_seconds_count") for w in workers) == windows
    assert value(producer, "streampack_window_pack_seconds_count") == windows
    # Every fetch was answered: one serve latency per batch or filler each rank received,
    # plus the fetches past the end (each rank prefetches 4: up to 4 epoch_end and 4
    # stream_end answers).
    answered = sum(o["batches"] for o in outputs)
    assert answered < value(producer, "streampack_serve_seconds_count") <= answered + 2 * 8


def test_the_client_counts_what_it_yielded_and_how_long_it_waited():
    import time

    from prometheus_client import CollectorRegistry

    from streampack.client import BatchStream
    from streampack.client_metrics import CLIENT_METRICS, register_client_metrics

    with Service(FIXTURE, serve_workers=1) as service:
        with BatchStream(service.consumer_endpoint, rank=0, world_size=1, timeout=60) as stream:
            registry = CollectorRegistry(auto_describe=False)
            register_client_metrics(stream, registry)
            started = time.perf_counter()
            got = [(batch.filler, int(batch.valid_lengths.sum())) for batch in stream]
            wall = time.perf_counter() - started
            counters = stream.metrics()
            scraped = samples(generate_latest(registry).decode())
        served = service.stats()
    assert counters["batches"] == len(got) == served["batches_served"] + served["fillers_served"]
    assert counters["fillers"] == sum(filler for filler, _ in got)
    assert counters["rejected"] == 0 and counters["resent"] == 0
    # The first batch cannot be there before it is asked for: at least one wait.
    assert 1 <= counters["waits"] <= counters["batches"]
    assert 0 < counters["seconds_blocked"] < wall
    assert counters["bytes_received"] > 0
    # The producer counts what its sockets took: every batch's bytes, plus the headers
    # (and the health answers) around them.
    sent = served["bytes_sent_to_consumers"]
    assert counters["bytes_received"] < sent < counters["bytes_received"] + 4096 * (len(got) + 16)
    assert served["bytes_sent_to_workers"] > 0
    for key, name in (
        ("batches", "streampack_client_batches_total"),
        ("waits", "streampack_client_waits_total"),
        ("seconds_blocked", "streampack_client_blocked_seconds_total"),
        ("bytes_received", "streampack_client_bytes_received_total"),
    ):
        assert value(scraped, name, rank="0") == pytest.approx(counters[key])
    assert exported_names(scraped) == set(CLIENT_METRICS)


def all_exported_names() -> set[str]:
    """Names the code exports, from real registries with every optional counter set."""
    from streampack.client_metrics import ClientCollector

    producer = Producer(ProducerSettings(corpus=str(FIXTURE), capacity=256, window_tokens=3000))
    producer.coordinator.counters.pack_seconds += 0.5
    producer.coordinator.counters.served_to_rank(0, 1, 1)
    producer.coordinator.counters.served_by_source(
        np.zeros(1, np.int32), np.ones(1, np.int64), np.ones(1, np.int64)
    )
    registries = [
        ProducerMetrics(producer.snapshot, window_budget_bytes=1, reorder_budget_bytes=1).registry,
        WorkerMetrics({}).registry,
        CollectorRegistry(auto_describe=False),
    ]

    class Stream:
        def metrics(self) -> dict:
            return dict.fromkeys(
                (
                    "batches",
                    "fillers",
                    "bytes_received",
                    "waits",
                    "seconds_blocked",
                    "rejected",
                    "resent",
                    "batches_from_workers",
                    "batches_rerouted",
                    "worker_batches_refused",
                    "verify_seconds",
                ),
                0,
            ) | {"rank": 0}

    registries[2].register(ClientCollector(Stream()))
    zero = dict.fromkeys(STORAGE_METRICS, 0)
    registries[2].register(StorageCollector(lambda: {"s3": zero}))
    names = set()
    for registry in registries:
        names |= exported_names(samples(generate_latest(registry).decode()))
    return names


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "streampack.json"


def test_every_dashboard_query_names_a_metric_the_code_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = all_exported_names()
    from streampack.client_metrics import CLIENT_METRICS

    assert exported == set(METRICS) | set(CLIENT_METRICS)
    used = set()
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bstreampack_[a-z_]+", target["expr"]))
            assert names, (panel["title"], target["expr"])
            for name in names:
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert name in exported or (
                    base in exported and METRICS.get(base, ("",))[0] == "histogram"
                ), (panel["title"], name)
            used |= names
    # The dashboard covers what an operator watches first.
    for name in (
        "streampack_batches_served_total",
        "streampack_tokens_served_total",
        "streampack_documents_quarantined_total",
        "streampack_windows_reissued_total",
        "streampack_workers",
        "streampack_reorder_bytes",
        "streampack_reorder_budget_bytes",
        "streampack_window_bytes",
        "streampack_window_budget_bytes",
        "streampack_pending_fetches",
        "streampack_audit_failures_total",
        "streampack_fill_ratio",
        "streampack_window_pack_seconds_bucket",
        "streampack_serve_seconds_bucket",
        "streampack_client_blocked_seconds_total",
    ):
        assert name in used, name


def test_docs_name_every_health_field_and_every_metric():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "service.md").read_text()
    producer = Producer(ProducerSettings(corpus=str(FIXTURE), capacity=256, window_tokens=3000))
    fields = set(producer.snapshot()) | {"serving", "worker_restarts"}
    missing = {field for field in fields if f"`{field}`" not in docs}
    assert not missing, f"docs/service.md does not describe health fields {sorted(missing)}"
    missing = {name for name in all_exported_names() if f"`{name}`" not in docs}
    assert not missing, f"docs/service.md does not describe metrics {sorted(missing)}"


def test_serve_refuses_worker_metrics_ports_past_65535():
    import subprocess

    from _service import command, env

    proc = subprocess.run(
        command("serve", "--corpus", str(FIXTURE), "--workers", "2", "--metrics-port", "65534"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "metrics_port 65534: local workers serve theirs on the next 2 ports" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_rank_and_source_counters_agree_with_what_a_masked_mixture_delivered(tmp_path):
    """A 3:1 mixture of two masked sources served to 2 ranks: by rank, the supervised
    targets are what each rank received, and they sum to the total; by source, the
    tokens, documents and supervised targets are what the ranks received, and the
    supervised ones what the in-process digest packs from each source's documents."""
    from streampack.service.digest import rank_stream

    rng = np.random.default_rng(3)
    for name, low, count in (("a", 2, 30), ("b", 200, 12)):
        docs = [rng.integers(low, low + 198, size=int(n)) for n in rng.integers(5, 60, count)]
        write_shard(tmp_path, name, docs)
        np.save(
            tmp_path / f"{name}.mask.npy", np.concatenate(masks(docs, seed=low)).astype(np.uint8)
        )
    manifest(
        tmp_path,
        binding=BINDING,
        sources=[{"weight": 3, "shards": ["a"]}, {"weight": 1, "shards": ["b"]}],
    )
    shape = {"capacity": 64, "window_documents": 8, "window_tokens": 300}
    port = free_port()
    with Service(tmp_path, serve_workers=2, metrics_port=port, **shape) as service:
        received = drain_ranks(service.consumer_endpoint, 2)
        scraped = scrape(port)
        health = service.stats()
    tokens, documents = collections.Counter(), collections.Counter()
    supervised = collections.Counter()
    by_rank = collections.Counter()
    for rank, items in received.items():
        for _, batch in items:
            occ = batch.occurrences
            for source, length in zip(
                batch.sources.tolist(), (occ["stop"] - occ["start"]).tolist()
            ):
                tokens[str(source)] += length
                documents[str(source)] += 1
            cells = batch.cell_sources()[batch.loss_mask]
            supervised.update({str(s): int(n) for s, n in enumerate(np.bincount(cells)) if n})
            by_rank[str(rank)] += int(batch.loss_mask.sum())
    # The oracle: the batches ``streampack digest`` packs for each rank, in process.
    settings = ProducerSettings(corpus=str(tmp_path), **(SMALL | shape))
    packed = collections.Counter()
    for rank in (0, 1):
        for _, _, batch in rank_stream(settings, rank, 2):
            cells = batch.cell_sources()[batch.loss_mask]
            packed.update({str(s): int(n) for s, n in enumerate(np.bincount(cells)) if n})
    assert set(supervised) == {"0", "1"} and supervised == packed
    for source in ("0", "1"):
        assert 0 < supervised[source] < tokens[source]  # the masks leave prompts out
        for name, counted in (
            ("tokens", tokens),
            ("supervised_targets", supervised),
            ("documents", documents),
        ):
            want = counted[source]
            assert value(scraped, f"streampack_source_{name}_served_total", source=source) == want
            assert health[f"{name}_served_by_source"][source] == want
    assert health["supervised_targets_served_by_rank"] == dict(by_rank)
    assert set(by_rank) == {"0", "1"}
    for rank, want in by_rank.items():
        assert value(scraped, "streampack_supervised_targets_served_total", rank=rank) == want
    assert sum(by_rank.values()) == health["supervised_targets_served"] == sum(packed.values())


@pytest.mark.slow
def test_counters_equal_what_the_ranks_read_when_the_workers_start_after_them(monkeypatch):
    """Ranks that wait more than the client's resend delay for the first batch (the
    workers start 6 s after them) resend their fetches; a resend crossing its answer
    must cost nothing: the counters are what the ranks read, batch for batch, document
    for document, and every rank's stream is digest's."""
    import threading
    import time

    from _service import drain, stream_digest

    from streampack import client

    settings = {"shuffle": True, "seed": 5, "epochs": 2}
    world = 3
    # The ranks run in this process: resending after 10 ms of silence instead of 5 s
    # makes resends that cross their answers frequent, not a matter of luck.
    monkeypatch.setattr(client, "RESEND_AFTER", 0.01)
    with Service(FIXTURE, **settings) as service:
        received: dict[int, list] = {rank: [] for rank in range(world)}
        threads = [
            threading.Thread(target=drain, args=(service.consumer_endpoint, rank, world, items))
            for rank, items in received.items()
        ]
        for thread in threads:
            thread.start()
        time.sleep(6.0)
        service.add_worker()
        service.add_worker()
        for thread in threads:
            thread.join(timeout=120)
        counted = service.stats()
    batches = fillers = tokens = 0
    documents: collections.Counter[str] = collections.Counter()
    for rank, items in received.items():
        want = expected(FIXTURE, rank, world, **settings)
        assert stream_digest(items) == (want["digest"], want["batches"]), rank
        for _, batch in items:
            fillers += int(batch.filler)
            batches += int(not batch.filler)
            occ = batch.occurrences
            tokens += int((occ["stop"] - occ["start"]).sum())
            documents.update(str(s) for s in batch.sources.tolist())
    assert counted["rewinds"] == 0, counted
    assert (counted["batches_served"], counted["fillers_served"]) == (batches, fillers)
    assert counted["tokens_served"] == tokens
    assert counted["documents_served_by_source"] == dict(documents)
