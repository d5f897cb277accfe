"""A trainer's view of its data path as Prometheus metrics (optional).

``BatchStream.metrics()`` is a plain dict, enough for logging it with the training
loss. A trainer that already serves Prometheus metrics can export the same numbers
from its own process::

    from streampack.client_metrics import register_client_metrics

    stream = BatchStream(endpoint, rank=rank, world_size=world)
    register_client_metrics(stream)          # into prometheus_client's default registry

Every counter carries the ``rank`` label; the numbers are read from the stream at
scrape time. ``streampack_client_blocked_seconds_total`` growing as fast as the wall
clock means the trainer is waiting for data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

# stream.metrics() key -> (metric name without _total, help)
CLIENT_COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("streampack_client_batches", "Batches this rank yielded (fillers included)"),
    "fillers": ("streampack_client_fillers", "All-padding filler batches this rank yielded"),
    "bytes_received": (
        "streampack_client_bytes_received",
        "Bytes of the batches yielded, as they travelled (compact)",
    ),
    "waits": ("streampack_client_waits", "Batches that had not arrived when the trainer asked"),
    "seconds_blocked": (
        "streampack_client_blocked_seconds",
        "Seconds the trainer waited for a batch that had not arrived",
    ),
    "rejected": ("streampack_client_messages_rejected", "Malformed messages dropped"),
    "resent": (
        "streampack_client_fetches_resent",
        "Times outstanding fetches were sent again after silence",
    ),
    "batches_from_workers": (
        "streampack_client_batches_from_workers",
        "Routed batches fetched from a worker and matching the producer's digest",
    ),
    "batches_rerouted": (
        "streampack_client_batches_rerouted",
        "Routes given up on (mismatch, missing, timeout): the producer sent the batch",
    ),
    "worker_batches_refused": (
        "streampack_client_worker_batches_refused",
        "Batches from a worker whose frames did not match the producer's digest",
    ),
    "verify_seconds": (
        "streampack_client_verify_seconds",
        "CPU seconds spent recomputing the digests of batches fetched from workers",
    ),
}

#: Every metric this module exports: name -> (type, help).
CLIENT_METRICS: dict[str, tuple[str, str]] = {
    f"{name}_total": ("counter", text) for name, text in CLIENT_COUNTERS.values()
}


class ClientCollector(Collector):
    """Reads ``stream.metrics()`` at every scrape."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counters = self.stream.metrics()
        for key, (name, text) in CLIENT_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["rank"])
            family.add_metric([str(counters["rank"])], counters[key])
            yield family


def register_client_metrics(
    stream: Any, registry: CollectorRegistry | None = None
) -> ClientCollector:
    """Export ``stream``'s counters from ``registry`` (prometheus_client's default one
    when None); ``registry.unregister(collector)`` stops it."""
    collector = ClientCollector(stream)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
