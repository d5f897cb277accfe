"""Mixtures and long documents through the window cut and the real service.

The corpora are written here, as token shards: source A's tokens lie in [2, 200) and
B's in [200, 400), so a token tells which source it came from.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from _formats import manifest, write_shard
from _service import Service, consume, expected, result

from streampack.client import BatchStream
from streampack.corpus import open_corpus
from streampack.corpus.schedule import Schedule
from streampack.errors import InvalidConfig
from streampack.windows import CutSpec, iter_windows

BINDING = {"vocab_size": 512, "tokenizer": "test", "split_receipt": "mix", "partition": "train"}
SHAPE = {"capacity": 64, "max_rows_per_batch": 4, "window_documents": 8, "window_tokens": 300}
MIXED = {"shuffle": True, "seed": 7, "epochs": 1}


def documents(rng, count, low_token, lengths):
    return [
        rng.integers(low_token, low_token + 198, size=int(n))
        for n in rng.integers(lengths[0], lengths[1], size=count)
    ]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A 3:1 mixture of A (30 documents) and B (20): {path, a, b} (the documents)."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    a, b = documents(rng, 30, 2, (5, 60)), documents(rng, 20, 200, (5, 60))
    write_shard(root, "a", a)
    write_shard(root, "b", b)
    manifest(
        root,
        binding=BINDING,
        sources=[{"weight": 3, "shards": ["a"]}, {"weight": 1, "shards": ["b"]}],
        stopping="first_exhausted",
    )
    return {"path": root, "a": a, "b": b}


def visited(path, **settings):
    """(source index, source id) of every document the epoch's windows hold, in order."""
    spec = CutSpec(
        **{k: v for k, v in SHAPE.items() if k != "max_rows_per_batch"},
        shuffle=settings.get("shuffle", False),
        seed=settings.get("seed", 0),
    )
    reader = open_corpus(path)
    out = []
    for window in iter_windows(reader, 0, spec):
        out += list(zip(window.source_index.tolist(), window.source_id.tolist()))
    return reader, out


def test_a_3_to_1_mixture_visits_exactly_the_schedule(mixture):
    """Window after window, the documents are the round-robin's picks A A B A ..., each
    source in its own seeded order; A runs out first, after 30 of A and 10 of B."""
    reader, got = visited(mixture["path"], **MIXED)
    picks, _ = Schedule.of([3, 1]).picks(0, 40)
    assert [s for s, _ in got] == picks.tolist()
    assert np.bincount([s for s, _ in got]).tolist() == [30, 10]
    ids = np.array([i for _, i in got])
    order = reader.epoch_order(0, True, 7)
    assert ids.tolist() == order[0 : len(order)].tolist()
    assert np.concatenate([order[0:7], order[7:19], order[19:40]]).tolist() == ids.tolist()
    assert sorted(ids[ids < 30].tolist()) == list(range(30))  # all of A, once
    assert len(set(ids[ids >= 30].tolist())) == 10  # ten of B, no repeat
    assert [s for s, i in got] == [int(i >= 30) for _, i in got]


def drain(endpoint, out):
    with BatchStream(endpoint, rank=0, world_size=1, timeout=120) as stream:
        out.extend((stream.current, batch) for batch in stream)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 3])
def test_a_mixture_streams_the_same_for_any_number_of_workers(mixture, workers):
    """The digest is the in-process one for 1 and 3 workers; every batch labels each
    occurrence with its source, which a recount from the tokens confirms, and so do
    the producer's per-source counters."""
    want = expected(mixture["path"], 0, 1, **SHAPE, **MIXED)
    with Service(mixture["path"], serve_workers=workers, **MIXED, **SHAPE) as service:
        line = result(consume(service.consumer_endpoint, 0, 1))
        counted = service.stats()  # what the producer counted serving that consumer
        received = []
        thread = threading.Thread(target=drain, args=(service.consumer_endpoint, received))
        thread.start()
        thread.join(timeout=120)
    assert (line["digest"], line["batches"]) == (want["digest"], want["batches"])
    served = np.zeros(2, np.int64)
    tokens = np.zeros(2, np.int64)
    sources = {0: mixture["a"], 1: mixture["b"]}
    assert_located(
        [batch for _, batch in received], lambda source, i: sources[source][i - 30 * source]
    )
    for _, batch in received:
        occ = batch.occurrences
        assert batch.sources.tolist() == (occ["source_id"] >= 30).astype(int).tolist()
        cells = batch.cell_sources()
        real = batch.input_valid
        assert np.array_equal(cells[real] == 1, batch.inputs[real] >= 200)  # B's tokens
        served += np.bincount(batch.sources, minlength=2)
        tokens += np.bincount(
            batch.sources, weights=occ["stop"] - occ["start"], minlength=2
        ).astype(np.int64)
    assert served.tolist() == [30, 10]
    everything = mixture["a"] + mixture["b"]
    pairs = np.zeros(2, np.int64)
    for source, i in visited(mixture["path"], **MIXED)[1]:
        pairs[source] += len(everything[i]) - 1
    assert tokens.tolist() == pairs.tolist()
    assert counted["documents_served_by_source"] == {"0": 30, "1": 10}
    assert counted["tokens_served_by_source"] == {"0": int(tokens[0]), "1": int(tokens[1])}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sources": []}, "'sources' must be a non-empty list"),
        ({"sources": [{"shards": ["a"]}]}, "source 0: no weight"),
        ({"sources": [{"weight": 0, "shards": ["a"]}]}, "source 0: weight 0 must be a positive"),
        ({"stopping": "longest"}, "stopping 'longest'; expected one of first_exhausted"),
        (
            {"sources": [{"weight": 1, "shards": ["a"], "long_documents": "truncate"}]},
            "source 0: long_documents 'truncate'; expected one of quarantine, split",
        ),
        ({"sources": [{"weight": 1, "shards": ["missing"]}]}, "missing"),
    ],
)
def test_a_bad_mixture_manifest_is_refused_naming_the_source(mixture, tmp_path, change, match):
    manifest = json.loads((mixture["path"] / "manifest.json").read_text()) | change
    path = tmp_path / "manifest.json"
    for name in ("a", "b"):
        for suffix in (".tokens.npy", ".offsets.npy"):
            (tmp_path / f"{name}{suffix}").write_bytes(
                (mixture["path"] / f"{name}{suffix}").read_bytes()
            )
    path.write_text(json.dumps(manifest))
    with pytest.raises(InvalidConfig, match=match):
        open_corpus(path)


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    """Documents of 3 x capacity (64) tokens between short ones, long_documents = split."""
    root = tmp_path_factory.mktemp("long")
    rng = np.random.default_rng(1)
    docs = [rng.integers(2, 500, size=n) for n in [10, 192, 30, 192, 65, 66, 192, 12]]
    write_shard(root, "docs", docs)
    manifest(root, binding=BINDING, shards=["docs"], long_documents="split")
    return {"path": root, "docs": docs}


def pairs_of(tokens, cuts=()):
    """Every (position, input, target) of a document, but those across ``cuts``."""
    return {
        (i, int(tokens[i]), int(tokens[i + 1])) for i in range(len(tokens) - 1) if i + 1 not in cuts
    }


SPLIT_SHAPE = {"capacity": 64, "max_rows_per_batch": 2, "window_documents": 3}


def assert_located(batches, document_of):
    """Every occurrence's record locates its tokens: the tokens at ``[range_start,
    range_stop)`` of document ``source_id`` of source ``source``, as ``document_of``
    reads it from the corpus, are its packed inputs and then its last target."""
    occurrences = 0
    for batch in batches:
        for occ in batch.occurrences:
            row, lo, hi = int(occ["row"]), int(occ["start"]), int(occ["stop"])
            packed = [*batch.inputs[row, lo:hi].tolist(), int(batch.targets[row, hi - 1])]
            document = document_of(int(occ["source"]), int(occ["source_id"]))
            assert document[occ["range_start"] : occ["range_stop"]].tolist() == packed, occ
            occurrences += 1
    assert occurrences


@pytest.fixture(scope="module")
def long_jsonl(tmp_path_factory, long_corpus):
    """The long corpus as JSON Lines, split: a blank line (ids count documents, not
    lines), and the second long document selecting [3, 190) of itself."""
    root = tmp_path_factory.mktemp("long-jsonl")
    lines = [json.dumps({"tokens": d.tolist()}) for d in long_corpus["docs"]]
    lines[3] = json.dumps({"tokens": long_corpus["docs"][3].tolist(), "start": 3, "stop": 190})
    lines.insert(2, "")
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    manifest(root, binding=BINDING, jsonl=["docs.jsonl"], long_documents="split")
    return root


def jsonl_documents(path):
    """Each document of a JSON Lines corpus, read as plain JSON (no streampack reader)."""
    lines = (path / "docs.jsonl").read_text().splitlines()
    return [np.array(json.loads(line)["tokens"]) for line in lines if line.strip()]


@pytest.mark.parametrize("format", ["shards", "jsonl"])
def test_a_split_documents_occurrences_locate_their_tokens_in_the_document(
    long_corpus, long_jsonl, format
):
    """In process (``streampack digest``'s stream): the pieces of a split document
    report their ranges in the document, not in the piece (192 tokens: [0, 65), [65,
    130), [130, 192); from [3, 190): [3, 68), [68, 133), [133, 190)), and every
    occurrence's tokens are the corpus document's at its range."""
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    path = long_corpus["path"] if format == "shards" else long_jsonl
    docs = long_corpus["docs"] if format == "shards" else jsonl_documents(long_jsonl)
    settings = ProducerSettings(corpus=str(path), window_tokens=400, **SPLIT_SHAPE)
    batches = [batch for _, _, batch in rank_stream(settings, 0, 1)]
    assert_located(batches, lambda source, i: docs[i] if source == 0 else None)
    ranges = {}
    for batch in batches:
        for occ in batch.occurrences:
            ranges.setdefault(int(occ["source_id"]), []).append(
                (int(occ["range_start"]), int(occ["range_stop"]))
            )
    assert ranges[1] == [(0, 65), (65, 130), (130, 192)]
    assert ranges[3] == (
        [(0, 65), (65, 130), (130, 192)] if format == "shards" else [(3, 68), (68, 133), (133, 190)]
    )
    assert ranges[5] == [(0, 65)] and ranges[4] == [(0, 65)]


def test_a_mixtures_occurrences_name_their_source_and_document(mixture):
    """In process, a shuffled 3:1 mixture: (source, source_id) of each occurrence names
    a document of that source (source ids count the sources' documents in manifest
    order: B's document i is 30 + i), and its range holds the occurrence's tokens."""
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    settings = ProducerSettings(corpus=str(mixture["path"]), **SHAPE, **MIXED)
    batches = [batch for _, _, batch in rank_stream(settings, 0, 1)]
    first = {0: 0, 1: len(mixture["a"])}
    sources = {0: mixture["a"], 1: mixture["b"]}
    assert_located(batches, lambda source, i: sources[source][i - first[source]])
    seen = np.concatenate([batch.occurrences["source"] for batch in batches])
    assert np.bincount(seen).tolist() == [30, 10]


def test_long_documents_are_split_into_ranges_of_capacity_plus_one(long_corpus):
    """192 tokens at capacity 64: ranges [0, 65), [65, 130), [130, 192); the pairs
    across 65 and 130 are the two the cuts cost. 66 tokens: [0, 65) and a lone token
    that forms no range: one pair. 65 tokens fit whole."""
    spec = CutSpec(capacity=64, window_documents=8, window_tokens=10_000)
    (window,) = iter_windows(open_corpus(long_corpus["path"]), 0, spec)
    assert window.quarantined == []
    assert (window.documents_split, window.pairs_cut) == (4, 2 + 2 + 1 + 2)
    lengths = np.diff(window.offsets)
    assert window.source_id.tolist() == [0, 1, 1, 1, 2, 3, 3, 3, 4, 5, 6, 6, 6, 7]
    assert lengths.tolist() == [10, 65, 65, 62, 30, 65, 65, 62, 65, 65, 65, 65, 62, 12]
    assert window.start.tolist() == [0] * 14 and window.stop.tolist() == lengths.tolist()
    assert window.piece_start.tolist() == [0, 0, 65, 130, 0, 0, 65, 130, 0, 0, 0, 65, 130, 0]
    got: dict[int, set] = {}
    for d, source in enumerate(window.source_id.tolist()):
        at = sum(lengths[i] for i in range(d) if window.source_id[i] == source)
        piece = window.tokens[window.offsets[d] : window.offsets[d + 1]]
        got.setdefault(source, set()).update(
            (at + i, int(piece[i]), int(piece[i + 1])) for i in range(len(piece) - 1)
        )
    cuts = {192: (65, 130), 66: (65,)}
    for source, tokens in enumerate(long_corpus["docs"]):
        assert got[source] == pairs_of(tokens, cuts.get(len(tokens), ()))


def test_long_documents_are_quarantined_unless_split(long_corpus, tmp_path):
    manifest = json.loads((long_corpus["path"] / "manifest.json").read_text())
    del manifest["long_documents"]
    path = long_corpus["path"] / "quarantine.json"
    path.write_text(json.dumps(manifest))
    spec = CutSpec(capacity=64, window_documents=8, window_tokens=10_000)
    (window,) = iter_windows(open_corpus(path), 0, spec)
    assert [q["source_id"] for q in window.quarantined] == [1, 3, 5, 6]
    assert {q["reason"] for q in window.quarantined} == {"too_long"}
    assert (window.documents_split, window.pairs_cut) == (0, 0)


@pytest.mark.slow
def test_split_documents_train_on_every_pair_but_the_cuts_through_the_service(long_corpus):
    """Through real processes: every pair of every document arrives, once, but the
    pairs across the cuts; the producer's counters say how many documents were split
    and what the cuts cost."""
    with Service(long_corpus["path"], serve_workers=2, window_tokens=400, **SPLIT_SHAPE) as service:
        received = []
        thread = threading.Thread(target=drain, args=(service.consumer_endpoint, received))
        thread.start()
        thread.join(timeout=120)
        stats = service.stats()
    trained: dict[int, list] = {}
    for _, batch in received:
        for occ in batch.occurrences:
            row, lo, hi = int(occ["row"]), int(occ["start"]), int(occ["stop"])
            trained.setdefault(int(occ["source_id"]), []).extend(
                zip(batch.inputs[row, lo:hi].tolist(), batch.targets[row, lo:hi].tolist())
            )
    cuts = {192: (65, 130), 66: (65,)}
    for source, tokens in enumerate(long_corpus["docs"]):
        want = [
            (int(tokens[i]), int(tokens[i + 1]))
            for i in range(len(tokens) - 1)
            if i + 1 not in cuts.get(len(tokens), ())
        ]
        assert trained[source] == want
    assert (stats["documents_split"], stats["pairs_cut"]) == (4, 7)
    assert stats["quarantined"] == 0
    # Each occurrence's record locates its tokens in the document (read by the reader).
    reader = open_corpus(long_corpus["path"])

    def document(source, i):
        assert source == 0
        ids = np.array([i])
        return np.asarray(reader.gather(ids, reader.lengths(ids))[0])

    assert_located([batch for _, batch in received], document)


@pytest.mark.slow
def test_a_split_json_lines_corpus_locates_every_occurrence_through_the_service(long_jsonl):
    """Through real processes (a worker that audits, so windows travel with their
    tokens): the stream is the in-process one, and each occurrence's range indexes its
    JSON Lines document, a range that starts inside its line included."""
    settings = {"window_tokens": 400, **SPLIT_SHAPE}
    want = expected(long_jsonl, 0, 1, **settings)
    with Service(long_jsonl, serve_workers=1, audit_every=1, **settings) as service:
        received = []
        thread = threading.Thread(target=drain, args=(service.consumer_endpoint, received))
        thread.start()
        thread.join(timeout=120)
        stats = service.stats()
    assert [batch.digest() for _, batch in received] == [d for _, _, d in want["list"]]
    docs = jsonl_documents(long_jsonl)
    assert_located([batch for _, batch in received], lambda source, i: docs[i])
    assert stats["audit_failures"] == 0 and stats["audited"] > 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_mixture_with_a_json_lines_source_follows_the_schedule(mixture, tmp_path, shuffle):
    """A sequential source (JSON Lines, sized by one pass at open) mixes like the others,
    document by document: the 2:1 schedule, each source read once in its own order."""
    lines = [json.dumps({"tokens": d.tolist()}) for d in mixture["b"]]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    for suffix in (".tokens.npy", ".offsets.npy"):
        (tmp_path / f"a{suffix}").write_bytes((mixture["path"] / f"a{suffix}").read_bytes())
    manifest(
        tmp_path,
        binding=BINDING,
        sources=[{"weight": 2, "shards": ["a"]}, {"weight": 1, "jsonl": ["b.jsonl"]}],
        stopping="all_exhausted",
    )
    reader, got = visited(tmp_path, shuffle=shuffle, seed=3)
    assert not reader.random_access and reader.sizes == [30, 20]
    length = Schedule.of([2, 1]).epoch_length([30, 20], "all_exhausted")
    picks, _ = Schedule.of([2, 1]).picks(0, length)
    assert [s for s, _ in got] == picks.tolist()
    assert [s for s, i in got] == [int(i >= 30) for _, i in got]
    b = [i - 30 for s, i in got if s == 1]
    assert sorted(b) == list(range(20)) and (b == list(range(20))) != shuffle
    a = [i for s, i in got if s == 0]
    assert sorted(a[:30]) == list(range(30))  # A's first cycle, whole
