"""Prometheus metrics of the producer and the pack workers, served over HTTP.

The numbers come from the same place ``streampack health`` and the stop line read:
the producer's counters (its ``snapshot()`` dict) and a worker's ``counters`` dict.
A custom collector reads them *at scrape time*, so nothing is counted twice and the
service loop does no metrics work per event beyond the latency histograms.

Names follow Prometheus conventions: ``streampack_`` prefix, ``_total`` for counters,
base units (``_bytes``, ``_seconds``), labels for what varies (``rank``, ``reason``).
``METRICS`` lists every name exported here, with its type and help; the dashboard test
checks every panel against it, and docs/service.md documents it.

``serve_metrics(registry, port, address)`` starts prometheus_client's HTTP server in a
daemon thread. It is off unless ``metrics_port`` is set, and listens on
``metrics_address`` (default ``127.0.0.1``): metrics are unauthenticated, and a
worker otherwise listens on no port at all, so exposing them is an explicit choice
(containers set ``metrics_address = "0.0.0.0"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..corpus.storage import storage_stats
from ..errors import InvalidConfig
from ..windows import REASONS as SCREEN_REASONS

logger = logging.getLogger(__name__)

#: Reasons a document is quarantined for (docs/service.md, Screening); exported at 0
#: before the first one so that rate() and alerts see the series from the start.
QUARANTINE_REASONS = (*SCREEN_REASONS, "pack_failed")  # the screen's, and a window's

#: Latency buckets (seconds): windows pack in milliseconds, a slow audit takes seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# snapshot key -> (metric name without _total, help). Counters of the producer.
PRODUCER_COUNTERS: dict[str, tuple[str, str]] = {
    "batches_served": ("streampack_batches_served", "Batches sent to consumers (not fillers)"),
    "fillers_served": ("streampack_fillers_served", "All-padding filler batches sent"),
    "batches_received": (
        "streampack_batches_received",
        "Batches received from workers as checked plans",
    ),
    "workers_joined": ("streampack_workers_joined", "Pack workers that registered"),
    "workers_lost": (
        "streampack_workers_lost",
        "Workers silent for heartbeat_timeout (their windows reissued)",
    ),
    "windows_cut": ("streampack_windows_cut", "Windows cut from the corpus"),
    "windows_issued": ("streampack_windows_issued", "Window messages sent to workers"),
    "windows_reissued": (
        "streampack_windows_reissued",
        "Windows handed to another worker after their worker was lost",
    ),
    "windows_completed": ("streampack_windows_completed", "Windows whose batches were numbered"),
    "windows_failed": ("streampack_windows_failed", "Windows quarantined whole"),
    "windows_backed_up": (
        "streampack_windows_backed_up",
        "Backup copies of overdue windows handed to another worker",
    ),
    "backup_wins": (
        "streampack_backup_wins",
        "Windows whose first answer that passed the plan check came from a backup copy",
    ),
    "duplicates_dropped": (
        "streampack_duplicates_dropped",
        "Results of windows already complete, dropped",
    ),
    "stale_dropped": ("streampack_stale_dropped", "Results no longer awaited, dropped"),
    "replayed_dropped": (
        "streampack_replayed_dropped",
        "Replayed batches no consumer can still ask for, dropped",
    ),
    "rewinds": ("streampack_rewinds", "Replays from an earlier window for a resuming consumer"),
    "resends_dropped": (
        "streampack_resends_dropped",
        "Fetches for batches just answered to the same consumer (a resend crossing its answer)",
    ),
    "batches_routed": (
        "streampack_batches_routed",
        "Batches sent as a route to the worker serving them (data_plane = workers)",
    ),
    "batches_rerouted": (
        "streampack_batches_rerouted",
        "Routes a consumer gave up on (mismatch, missing, timeout); the producer sent them",
    ),
    "worker_batches_refused": (
        "streampack_worker_batches_refused",
        "Batches from a worker that did not match the producer's digest",
    ),
    "workers_refused_serving": (
        "streampack_workers_refused_serving",
        "Worker endpoints no longer routed to after a digest mismatch",
    ),
    "documents_split": (
        "streampack_documents_split",
        "Long documents cut into ranges (long_documents = split)",
    ),
    "pairs_cut": (
        "streampack_pairs_cut",
        "Prediction pairs across the cuts of split documents, not formed",
    ),
    "ranges_unsupervised": (
        "streampack_ranges_unsupervised",
        "Ranges of split documents with no supervised target, dropped",
    ),
    "bytes_sent_to_workers": (
        "streampack_bytes_sent_to_workers",
        "Bytes of the messages the producer sent to workers (headers and frames)",
    ),
    "bytes_sent_to_consumers": (
        "streampack_bytes_sent_to_consumers",
        "Bytes of the messages the producer sent to consumers (headers and frames)",
    ),
    "audited": ("streampack_batches_audited", "Batches audited by workers"),
    "audit_failures": ("streampack_audit_failures", "Audited batches that failed the audit"),
    "pack_seconds": (
        "streampack_pack_seconds",
        "Seconds workers report spending on the windows they packed",
    ),
}
REJECTED_PEERS = {"rejected_worker": "worker", "rejected_consumer": "consumer"}

# snapshot key of a total -> metric name without _total, labelled by ``rank`` from the
# snapshot's ``<key>_by_rank`` (the total alone, unlabelled, when the snapshot lacks it).
BY_RANK = {
    "tokens_served": "streampack_tokens_served",
    "supervised_targets_served": "streampack_supervised_targets_served",
}
# snapshot key -> metric name without _total, labelled by mixture ``source``.
BY_SOURCE = {
    "tokens_served_by_source": "streampack_source_tokens_served",
    "supervised_targets_served_by_source": "streampack_source_supervised_targets_served",
    "documents_served_by_source": "streampack_source_documents_served",
}

# snapshot key -> (metric name, help). Gauges of the producer.
PRODUCER_GAUGES: dict[str, tuple[str, str]] = {
    "workers": ("streampack_workers", "Pack workers currently registered"),
    "windows_in_flight": ("streampack_windows_in_flight", "Windows cut and not yet complete"),
    "window_bytes": ("streampack_window_bytes", "Bytes of windows handed out and not complete"),
    "reorder_bytes": (
        "streampack_reorder_bytes",
        "Bytes of packed batches held for ordering and delivery",
    ),
    "window_bytes_peak": ("streampack_window_bytes_peak", "Highest streampack_window_bytes"),
    "reorder_bytes_peak": ("streampack_reorder_bytes_peak", "Highest streampack_reorder_bytes"),
    "ready_batches": ("streampack_ready_batches", "Batches numbered and waiting for a fetch"),
    "pending_fetches": ("streampack_pending_fetches", "Fetches received and not yet answered"),
    "epoch": ("streampack_epoch", "The epoch being assembled"),
}

# counter key of a worker -> (metric name without _total, help).
WORKER_COUNTERS: dict[str, tuple[str, str]] = {
    "windows": ("streampack_worker_windows_packed", "Windows this worker packed"),
    "batches": ("streampack_worker_batches_packed", "Batches in the windows this worker packed"),
    "failed": ("streampack_worker_windows_failed", "Windows this worker could not pack"),
    "rejected": ("streampack_worker_messages_rejected", "Malformed messages this worker refused"),
    "audited": ("streampack_worker_batches_audited", "Batches this worker audited"),
    "audit_failures": (
        "streampack_worker_audit_failures",
        "Batches that failed this worker's audit",
    ),
}

# ``storage_stats()`` key -> (metric name, type, help), labelled by ``scheme``: the
# remote corpus reads of the process that serves them (producer or worker).
STORAGE_METRICS: dict[str, tuple[str, str, str]] = {
    "requests": (
        "streampack_storage_requests_total",
        "counter",
        "Requests to corpus stores (attempts: a retry is one more), by scheme",
    ),
    "bytes": ("streampack_storage_bytes_total", "counter", "Bytes fetched from corpus stores"),
    "retries": (
        "streampack_storage_retries_total",
        "counter",
        "Store requests retried (throttling, 5xx, dropped connections, timeouts)",
    ),
    "throttles": (
        "streampack_storage_throttles_total",
        "counter",
        "Of those retries, the ones the store asked for (429, 503 SlowDown)",
    ),
    "cache_hits": (
        "streampack_storage_cache_hits_total",
        "counter",
        "Blocks a read found in the node-local cache",
    ),
    "cache_misses": (
        "streampack_storage_cache_misses_total",
        "counter",
        "Blocks a read had to fetch (or wait for another process fetching them)",
    ),
    "cache_evictions": (
        "streampack_storage_cache_evictions_total",
        "counter",
        "Blocks removed from the node-local cache to keep corpus_cache_bytes",
    ),
    "prefetch_ahead_bytes": (
        "streampack_storage_prefetch_ahead_bytes",
        "gauge",
        "Bytes fetched ahead of the read cursor and not read yet (the prefetch depth)",
    ),
    "longest_wait": (
        "streampack_storage_longest_wait_seconds",
        "gauge",
        "Longest a read waited for the store (retries included) since the start",
    ),
}

#: Every metric exported by this module: name -> (type, help). Counters are listed with
#: their ``_total`` sample name, histograms with their base name.
METRICS: dict[str, tuple[str, str]] = {
    **{f"{name}_total": ("counter", text) for name, text in PRODUCER_COUNTERS.values()},
    "streampack_tokens_served_total": ("counter", "Real tokens (prediction pairs) sent, by rank"),
    "streampack_supervised_targets_served_total": (
        "counter",
        "Loss-eligible targets (a supervision mask's marked ones) of the batches sent, by rank",
    ),
    "streampack_cells_served_total": ("counter", "Cells (rows x capacity) of the batches sent"),
    "streampack_documents_quarantined_total": ("counter", "Documents quarantined, by reason"),
    "streampack_messages_rejected_total": (
        "counter",
        "Malformed or out-of-range messages refused, by peer",
    ),
    **{name: ("gauge", text) for name, text in PRODUCER_GAUGES.values()},
    "streampack_window_budget_bytes": (
        "gauge",
        "window_budget_bytes: the bound on streampack_window_bytes",
    ),
    "streampack_reorder_budget_bytes": (
        "gauge",
        "reorder_budget_bytes: the bound on streampack_reorder_bytes",
    ),
    "streampack_fill_ratio": ("gauge", "Real tokens over cells of the batches sent so far"),
    "streampack_source_tokens_served_total": (
        "counter",
        "Real tokens sent, by mixture source (its index in the manifest)",
    ),
    "streampack_source_supervised_targets_served_total": (
        "counter",
        "Loss-eligible targets sent, by mixture source",
    ),
    "streampack_source_documents_served_total": (
        "counter",
        "Documents (occurrences) sent, by mixture source",
    ),
    "streampack_window_pack_seconds": (
        "histogram",
        "Seconds a worker took to pack one window, as it reports",
    ),
    "streampack_serve_seconds": (
        "histogram",
        "Seconds from a fetch's arrival at the producer "
        "to its answer (a batch, a filler or the end of the epoch)",
    ),
    **{f"{name}_total": ("counter", text) for name, text in WORKER_COUNTERS.values()},
    "streampack_worker_pack_seconds": ("histogram", "Seconds this worker took per window"),
    **{name: (kind, text) for name, kind, text in STORAGE_METRICS.values()},
}


def _snapshot_of(read: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any]:
    """``read()``, retried when the service thread changed a table under it."""
    for attempt in range(5):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            if attempt == 4:
                raise
            time.sleep(0.001)
    raise AssertionError("unreachable")


class ProducerCollector(Collector):
    """Producer metrics, read from its counters' dict view at every scrape.

    ``snapshot`` returns the producer's counters (what ``health`` answers):
    the keys of ``PRODUCER_COUNTERS`` and ``PRODUCER_GAUGES``, those of ``BY_RANK`` (or
    their ``_by_rank`` tables) and ``BY_SOURCE``, ``cells_served`` when counted,
    ``quarantine_reasons``, ``rejected_worker`` and ``rejected_consumer``. Keys it lacks
    are not exported.
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        *,
        window_budget_bytes: int,
        reorder_budget_bytes: int,
    ) -> None:
        self.snapshot = snapshot
        self.budgets = {
            "streampack_window_budget_bytes": window_budget_bytes,
            "streampack_reorder_budget_bytes": reorder_budget_bytes,
        }

    def describe(self) -> list[Metric]:
        return []  # names come from collect(); registering needs no up-front description

    def collect(self) -> Iterator[Metric]:
        stats = _snapshot_of(self.snapshot)
        for key, (name, text) in PRODUCER_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, text, value=stats[key])
        for key, name in BY_RANK.items():
            yield _by_rank(name, stats.get(f"{key}_by_rank"), stats.get(key, 0))
        if "cells_served" in stats:
            yield CounterMetricFamily(
                "streampack_cells_served",
                METRICS["streampack_cells_served_total"][1],
                value=stats["cells_served"],
            )
            cells = stats["cells_served"]
            by_rank = stats.get("tokens_served_by_rank")
            served = sum(by_rank.values()) if by_rank is not None else stats.get("tokens_served", 0)
            yield GaugeMetricFamily(
                "streampack_fill_ratio",
                METRICS["streampack_fill_ratio"][1],
                value=served / cells if cells else 0.0,
            )
        for key, name in BY_SOURCE.items():
            if key in stats:
                family = CounterMetricFamily(name, METRICS[f"{name}_total"][1], labels=["source"])
                for source, count in sorted(stats[key].items(), key=lambda kv: int(kv[0])):
                    family.add_metric([str(source)], count)
                yield family
        reasons = CounterMetricFamily(
            "streampack_documents_quarantined",
            METRICS["streampack_documents_quarantined_total"][1],
            labels=["reason"],
        )
        counted = dict.fromkeys(QUARANTINE_REASONS, 0) | dict(stats.get("quarantine_reasons", {}))
        for reason, value in sorted(counted.items()):
            reasons.add_metric([reason], value)
        yield reasons
        rejected = CounterMetricFamily(
            "streampack_messages_rejected",
            METRICS["streampack_messages_rejected_total"][1],
            labels=["peer"],
        )
        for key, peer in REJECTED_PEERS.items():
            rejected.add_metric([peer], stats.get(key, 0))
        yield rejected
        for key, (name, text) in PRODUCER_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, text, value=stats[key])
        for name, value in self.budgets.items():
            yield GaugeMetricFamily(name, METRICS[name][1], value=value)


def _by_rank(name: str, by_rank: Mapping[str, int] | None, total: int) -> CounterMetricFamily:
    """Counter ``name`` labelled by rank, or its unlabelled ``total`` without ``by_rank``."""
    family = CounterMetricFamily(
        name, METRICS[f"{name}_total"][1], labels=["rank"] if by_rank is not None else None
    )
    if by_rank is None:
        family.add_metric([], total)
    else:
        for rank, value in sorted(by_rank.items()):
            family.add_metric([str(rank)], value)
    return family


class WorkerCollector(Collector):
    """A pack worker's counters (its ``counters`` dict), read at every scrape."""

    def __init__(self, counters: Mapping[str, int]) -> None:
        self.counters = counters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counters = _snapshot_of(lambda: dict(self.counters))
        for key, (name, text) in WORKER_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=counters.get(key, 0))


class StorageCollector(Collector):
    """The remote corpus reads of this process (``storage_stats()``, or ``read``), by
    scheme, read at every scrape: the producer's and a worker's registry hold one."""

    def __init__(
        self, read: Callable[[], Mapping[str, Mapping[str, float]]] = storage_stats
    ) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        by_scheme = self.read()
        for key, (name, kind, text) in STORAGE_METRICS.items():
            family: Metric
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), text, labels=["scheme"])
            else:
                family = GaugeMetricFamily(name, text, labels=["scheme"])
            for scheme, stats in sorted(by_scheme.items()):
                family.add_metric([scheme], stats[key])
            yield family


def pack_histogram(name: str, registry: CollectorRegistry) -> Histogram:
    """A latency histogram (seconds) registered in ``registry``."""
    return Histogram(name, METRICS[name][1], buckets=LATENCY_BUCKETS, registry=registry)


class ProducerMetrics:
    """The producer's registry: its collector plus the pack-latency histogram.

    The producer integration is: build one with its ``snapshot`` method and budgets,
    call ``observe_pack(seconds)`` for each accepted ``packed`` report and
    ``observe_serve(seconds)`` for each fetch answered, and serve ``registry`` with
    ``MetricsServer`` when ``metrics_port`` is set.
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        *,
        window_budget_bytes: int,
        reorder_budget_bytes: int,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            ProducerCollector(
                snapshot,
                window_budget_bytes=window_budget_bytes,
                reorder_budget_bytes=reorder_budget_bytes,
            )
        )
        self.registry.register(StorageCollector())
        self.pack_seconds = pack_histogram("streampack_window_pack_seconds", self.registry)
        self.serve_seconds = pack_histogram("streampack_serve_seconds", self.registry)

    def observe_pack(self, seconds: float) -> None:
        self.pack_seconds.observe(seconds)

    def observe_serve(self, seconds: float) -> None:
        """A fetch answered ``seconds`` after it arrived."""
        self.serve_seconds.observe(seconds)


class WorkerMetrics:
    """A worker's registry: its counters plus its own pack-latency histogram."""

    def __init__(self, counters: Mapping[str, int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkerCollector(counters))
        self.registry.register(StorageCollector())
        self.pack_seconds = pack_histogram("streampack_worker_pack_seconds", self.registry)

    def observe_pack(self, seconds: float) -> None:
        self.pack_seconds.observe(seconds)


class MetricsServer:
    """prometheus_client's HTTP server for one registry, stopped with ``close()``."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        try:
            self.server, self.thread = start_http_server(port, address, registry=registry)
        except OSError as exc:
            raise InvalidConfig(
                f"metrics_port = {port} at metrics_address = {address!r}: "
                f"cannot listen there ({exc.strerror or exc})"
            ) from None
        self.port = self.server.server_port
        logger.info("serving metrics on http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
