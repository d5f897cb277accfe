"""Supervision masks in every reader that can hold one (rule C5), the screen's mask
reasons, split ranges with their own slice of the mask, and mixtures of masked and
unmasked sources."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from _formats import (
    BINDING,
    MASKED_WRITERS,
    WRITERS,
    documents,
    labels,
    manifest,
    masks,
    write_hf_dataset,
    write_jsonl,
    write_megatron,
    write_parquet,
    write_shards,
)

from streampack import InvalidConfig
from streampack.corpus import open_corpus
from streampack.corpus.inspect import inspect_corpus
from streampack.windows import CutSpec, iter_windows

SPEC = CutSpec(capacity=64, window_documents=9, window_tokens=200)


def read_masked(source, spec=SPEC, epoch=0):
    """{source_id: (tokens, mask)} through the window cut, and every window."""
    got, windows = {}, []
    for window in iter_windows(source, epoch, spec):
        windows.append(window)
        assert window.mask is not None and window.mask.dtype == np.uint8
        assert len(window.mask) == len(window.tokens)
        for i, source_id in enumerate(window.source_id.tolist()):
            lo, hi = window.offsets[i], window.offsets[i + 1]
            got[source_id] = (window.tokens[lo:hi].tolist(), window.mask[lo:hi].tolist())
    return got, windows


@pytest.mark.parametrize("fmt", sorted(MASKED_WRITERS))
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_document_arrives_with_its_own_mask(tmp_path, fmt, shuffle):
    docs = documents()
    mask = masks(docs)
    source = open_corpus(MASKED_WRITERS[fmt](tmp_path, docs, mask))
    assert source.masked
    spec = CutSpec(
        capacity=64,
        window_documents=9,
        window_tokens=200,
        shuffle=shuffle,
        seed=3,
        shuffle_buffer=8,
    )
    got, windows = read_masked(source, spec)
    assert not [q for w in windows for q in w.quarantined]
    assert got == {i: (d, m) for i, (d, m) in enumerate(zip(docs, mask, strict=True))}


@pytest.mark.parametrize("fmt", sorted(MASKED_WRITERS))
def test_the_mask_changes_no_other_field_of_a_window(tmp_path, fmt):
    """The same documents without their mask ("mask": false) give the same windows,
    field for field, with mask None: an unmasked corpus is cut as before masks."""
    docs = documents()
    path = MASKED_WRITERS[fmt](tmp_path, docs, masks(docs))
    data = json.loads((path / "manifest.json").read_text())
    data.pop("labels", None)
    data["mask"] = False
    (path / "plain.json").write_text(json.dumps(data))
    masked = list(iter_windows(open_corpus(path), 0, SPEC))
    plain = list(iter_windows(open_corpus(path / "plain.json"), 0, SPEC))
    assert len(masked) == len(plain)
    for a, b in zip(masked, plain, strict=True):
        assert b.mask is None and a.mask is not None
        for name, value in a.arrays().items():
            if name != "mask":  # the wire frame that carries the mask itself
                assert np.array_equal(value, b.arrays()[name]), name
        assert a.nbytes == b.nbytes + len(a.tokens)  # one byte per token


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_an_unmasked_corpus_has_no_mask(tmp_path, fmt):
    source = open_corpus(WRITERS[fmt](tmp_path, documents()))
    assert not source.masked
    assert all(w.mask is None for w in iter_windows(source, 0, SPEC))


def test_labels_mark_the_target_tokens_as_hugging_face_does(tmp_path):
    """labels = [-100, -100, 7, 8]: the pairs trained are those whose target is 7 or 8,
    exactly the positions a Hugging Face model's shifted labels train."""
    docs = [[5, 6, 7, 8], [9, 10, 11]]
    path = write_jsonl(
        tmp_path, docs, supervision=[[-100, -100, 7, 8], [-100, 10, 11]], key="labels"
    )
    (window,) = iter_windows(open_corpus(path), 0, SPEC)
    assert window.mask.tolist() == [0, 0, 1, 1, 0, 1, 1]
    # Hugging Face's loss: logits[:-1] predict labels[1:]; trained where labels != -100.
    hf = [
        (d[i], lab[i + 1])
        for d, lab in zip(docs, labels(docs, [[0, 0, 1, 1], [0, 1, 1]]))
        for i in range(len(d) - 1)
        if lab[i + 1] != -100
    ]
    ours = [
        (int(window.tokens[j]), int(window.tokens[j + 1]))
        for d in range(2)
        for j in range(window.offsets[d], window.offsets[d + 1] - 1)
        if window.mask[j + 1]
    ]
    assert ours == hf == [(6, 7), (7, 8), (9, 10), (10, 11)]


def bad_jsonl(tmp_path):
    lines = [
        {"tokens": [1, 2, 3], "mask": [0, 1, 1]},  # good
        {"tokens": [1, 2, 3], "mask": [0, 1]},  # mask_length
        {"tokens": [1, 2, 3], "mask": [0, 2, 1]},  # mask_values
        {"tokens": [1, 2, 3], "mask": [1, 0, 0]},  # unsupervised: only the first token
        {"tokens": [1, 2, 3]},  # mask_length: none
        {"tokens": [1, 2, 3], "mask": [0, "1", 1]},  # mask_values: not an integer
        {"tokens": [4, 5], "mask": [True, True]},  # good: true/false are 1/0
        {"tokens": [1, 2, 3], "mask": [0, 300, 1]},  # mask_values past a byte
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return manifest(tmp_path, jsonl=["d.jsonl"], mask="mask")


def test_bad_masks_are_quarantined_with_their_own_reasons(tmp_path):
    (window,) = iter_windows(open_corpus(bad_jsonl(tmp_path)), 0, SPEC)
    got = {q["location"]: (q["reason"], q["detail"]) for q in window.quarantined}
    assert got == {
        "d.jsonl:2": ("mask_length", "mask has 2 value(s) for 3 tokens; one per token needed"),
        "d.jsonl:3": ("mask_values", "mask values span [0, 2]; accepted: 0 and 1"),
        "d.jsonl:4": (
            "unsupervised",
            "no target of range [0, 3) is marked in the mask; nothing to train on",
        ),
        "d.jsonl:5": (
            "mask_length",
            "mask field 'mask' is missing; expected a list of one value per token",
        ),
        "d.jsonl:6": ("mask_values", "mask values must be integers; found ['str']"),
        "d.jsonl:8": ("mask_values", "mask values span [0, 300]; accepted: 0 and 1"),
    }
    assert window.source_id.tolist() == [0, 6]
    assert window.mask.tolist() == [0, 1, 1, 1, 1]


def test_a_range_whose_targets_are_unmarked_is_unsupervised(tmp_path):
    """Only mask[start + 1:stop] counts: a mark on the range's first token trains
    nothing (it is no pair's target), one on its last token does."""
    lines = [
        {"tokens": [1, 2, 3, 4], "mask": [0, 1, 0, 0], "start": 1},  # [2, 3, 4]: none
        {"tokens": [1, 2, 3, 4], "mask": [0, 0, 0, 1], "start": 1},  # target 4 marked
        {"tokens": [1, 2, 3, 4], "mask": [0, 0, 1, 0], "stop": 2},  # [1, 2]: none
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (window,) = iter_windows(
        open_corpus(manifest(tmp_path, jsonl=["d.jsonl"], mask="mask")), 0, SPEC
    )
    assert [(q["location"], q["reason"]) for q in window.quarantined] == [
        ("d.jsonl:1", "unsupervised"),
        ("d.jsonl:3", "unsupervised"),
    ]
    assert window.source_id.tolist() == [1]


@pytest.mark.parametrize("fmt", ["jsonl_labels", "parquet_labels", "hf_dataset_labels"])
def test_labels_that_disagree_with_the_tokens_are_quarantined(tmp_path, fmt):
    docs = documents(20)
    mask = masks(docs)
    path = MASKED_WRITERS[fmt](tmp_path, docs, mask)
    # Rewrite document 4's labels with a wrong supervised id (in the format's own way).
    wrong = labels(docs, mask)
    last = len(docs[4]) - 1
    wrong[4][last] = (docs[4][last] + 1) % 512
    if fmt == "jsonl_labels":
        write_jsonl(tmp_path, docs, supervision=wrong, key="labels")
    elif fmt == "parquet_labels":
        write_parquet(tmp_path, docs, supervision={"labels": wrong}, key="labels")
    else:
        import shutil

        shutil.rmtree(tmp_path / "hf")
        write_hf_dataset(tmp_path, docs, supervision={"labels": wrong}, key="labels")
    windows = list(iter_windows(open_corpus(path), 0, SPEC))
    (q,) = [q for w in windows for q in w.quarantined]
    assert (q["source_id"], q["reason"]) == (4, "labels_mismatch")
    assert q["detail"] == (
        f"label {wrong[4][last]} at token {last} is neither -100 nor the token {docs[4][last]}"
    )


@pytest.mark.parametrize("writer", [write_hf_dataset, write_parquet])
def test_columnar_rows_whose_mask_is_another_length_are_quarantined(tmp_path, writer):
    docs = documents(20)
    mask = masks(docs)
    mask[3] = mask[3][:-1]
    mask[17] = mask[17] + [1]
    path = writer(tmp_path, docs, supervision={"completion_mask": mask})
    windows = list(iter_windows(open_corpus(path), 0, SPEC))
    got = [(q["source_id"], q["reason"]) for w in windows for q in w.quarantined]
    assert got == [(3, "mask_length"), (17, "mask_length")]
    kept = {int(s) for w in windows for s in w.source_id}
    assert kept == set(range(20)) - {3, 17}
    for w in windows:  # the others keep their own masks, aligned
        for i, s in enumerate(w.source_id.tolist()):
            assert w.mask[w.offsets[i] : w.offsets[i + 1]].tolist() == mask[s]


def test_shard_mask_values_are_screened(tmp_path):
    docs = documents(10)
    mask = masks(docs)
    mask[2][-1] = 7
    (window,) = iter_windows(
        open_corpus(write_shards(tmp_path, docs, supervision=mask)),
        0,
        CutSpec(capacity=64, window_documents=64, window_tokens=10_000),
    )
    assert [(q["source_id"], q["reason"], q["location"]) for q in window.quarantined] == [
        (2, "mask_values", "shard-000#2")
    ]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda root: (root / "shard-001.mask.npy").unlink(),
            "shard 'shard-001' has no mask file .*shard-001.mask.npy', but its corpus is "
            "masked; write one \\(bool or uint8, one value per token\\) for every shard, or "
            'set "mask": false',
        ),
        (
            lambda root: np.save(root / "shard-001.mask.npy", np.ones(3, np.uint8)),
            "shard 'shard-001': mask .*shard-001.mask.npy' has dtype uint8 and shape \\(3,\\); "
            "expected a 1-D bool or uint8 array of \\d+ values, one per token of "
            "shard-001.tokens.npy",
        ),
        (
            lambda root: np.save(
                root / "shard-000.mask.npy", np.load(root / "shard-000.mask.npy").astype(np.int64)
            ),
            "shard 'shard-000': mask .* has dtype int64 .*expected a 1-D bool or uint8 array",
        ),
    ],
)
def test_a_shard_mask_that_does_not_fit_is_refused_at_open(tmp_path, mutate, match):
    docs = documents(20)
    write_shards(tmp_path, docs, supervision=masks(docs))
    mutate(tmp_path)
    with pytest.raises(InvalidConfig, match=match):
        open_corpus(tmp_path)


def test_shard_mask_files_are_required_when_asked_for_and_ignored_when_refused(tmp_path):
    docs = documents(20)
    write_shards(tmp_path, docs)
    manifest(tmp_path, shards=["shard-000", "shard-001"], mask=True)
    with pytest.raises(InvalidConfig, match="shard 'shard-000' has no mask file"):
        open_corpus(tmp_path)
    write_shards(tmp_path, docs, supervision=masks(docs))
    manifest(tmp_path, shards=["shard-000", "shard-001"], mask=False)
    source = open_corpus(tmp_path)
    assert not source.masked
    assert all(w.mask is None for w in iter_windows(source, 0, SPEC))


@pytest.mark.parametrize(
    "entry, match",
    [
        (
            {"megatron": ["m_0"], "mask": "completion_mask"},
            "Megatron datasets: mask 'completion_mask' is set, but Megatron indexed datasets "
            "\\(.bin/.idx\\) hold no supervision mask; store a masked corpus as token shards",
        ),
        ({"megatron": ["m_0"], "labels": "labels"}, "labels 'labels' is set, but Megatron"),
        ({"shards": ["s"], "mask": "yes"}, "token shards: mask 'yes' must be true or false"),
        ({"shards": ["s"], "labels": "labels"}, "token shards: labels 'labels' is set"),
        (
            {"jsonl": ["d.jsonl"], "mask": "m", "labels": "l"},
            "both mask 'm' and labels 'l' are set; give one of them",
        ),
        ({"jsonl": ["d.jsonl"], "mask": 3}, "mask 3 must name a column \\(field\\) of the source"),
    ],
)
def test_supervision_keys_that_cannot_work_are_one_clear_error(tmp_path, entry, match):
    write_megatron(tmp_path, documents(4), prefix="m")
    (tmp_path / "d.jsonl").write_text('{"tokens": [1, 2]}\n')
    with pytest.raises(InvalidConfig, match=match):
        open_corpus(manifest(tmp_path, **entry))


@pytest.mark.parametrize("fmt", ["parquet", "hf_dataset", "jsonl"])
@pytest.mark.parametrize("name", ["labels", "completion_mask", "assistant_masks"])
def test_a_supervision_column_nobody_named_is_refused_not_ignored(tmp_path, fmt, name):
    """A TRL-prepared dataset (input_ids + labels) read as if unmasked would train on
    every prompt: the manifest must say which it means."""
    docs = documents(10)
    values = labels(docs, masks(docs)) if name == "labels" else masks(docs)
    if fmt == "jsonl":
        path = write_jsonl(tmp_path, docs, supervision=values, key=name)
    else:
        writer = write_parquet if fmt == "parquet" else write_hf_dataset
        path = writer(
            tmp_path, docs, supervision={name: values}, key="labels" if name == "labels" else "mask"
        )
    data = json.loads((path / "manifest.json").read_text())
    for key in ("mask", "labels"):
        data.pop(key, None)
    (path / "manifest.json").write_text(json.dumps(data))
    key = "labels" if name == "labels" else "mask"
    with pytest.raises(
        InvalidConfig,
        match=f"holds a '{name}' column but the manifest names no supervision; set "
        f'"{key}": "{name}" to train only the tokens it marks, or "mask": false',
    ):
        open_corpus(path)
    data["mask"] = False
    (path / "manifest.json").write_text(json.dumps(data))
    assert not open_corpus(path).masked


def test_a_missing_mask_column_is_named(tmp_path):
    docs = documents(10)
    write_parquet(tmp_path, docs)
    manifest(tmp_path, parquet=["train-000.parquet", "train-001.parquet"], mask="completion_mask")
    with pytest.raises(
        InvalidConfig, match="has no mask column 'completion_mask'; its columns are"
    ):
        open_corpus(tmp_path)


def split_corpus(tmp_path, docs, mask):
    path = write_shards(tmp_path, docs, supervision=mask, files=1)
    data = json.loads((path / "manifest.json").read_text())
    data["long_documents"] = "split"
    (path / "manifest.json").write_text(json.dumps(data))
    return path


def test_split_ranges_keep_their_own_slice_of_the_mask(tmp_path):
    """A document of 30 tokens at capacity 9: ranges [0, 10) [10, 20) [20, 30); each
    keeps mask[lo:hi]. A range left with no marked target is dropped and counted."""
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 512, 30).tolist()
    mask = [0] * 30
    mask[5] = 1  # range 0 trains the pair whose target is token 5
    mask[20] = 1  # token 20 opens range 2: no pair targets it, so range 2 trains nothing
    mask[25] = 1  # ... but this one does
    short = [1, 2, 3]
    (window,) = iter_windows(
        open_corpus(split_corpus(tmp_path, [doc, short], [mask, [0, 0, 1]])),
        0,
        CutSpec(capacity=9, window_documents=8, window_tokens=1000),
    )
    assert window.quarantined == []
    assert (window.documents_split, window.pairs_cut, window.ranges_unsupervised) == (1, 2, 1)
    # Range 1 ([10, 20)) has no mark and is dropped; ranges 0 and 2 remain.
    assert window.source_id.tolist() == [0, 0, 1]
    pieces = [
        (window.tokens[lo:hi].tolist(), window.mask[lo:hi].tolist())
        for lo, hi in zip(window.offsets[:-1], window.offsets[1:], strict=True)
    ]
    assert pieces == [
        (doc[0:10], mask[0:10]),
        (doc[20:30], mask[20:30]),
        (short, [0, 0, 1]),
    ]


def test_a_split_document_with_no_marked_target_is_quarantined_whole(tmp_path):
    doc = list(range(1, 31))
    (window,) = iter_windows(
        open_corpus(split_corpus(tmp_path, [doc, [1, 2]], [[1] + [0] * 29, [0, 1]])),
        0,
        CutSpec(capacity=9, window_documents=8, window_tokens=1000),
    )
    assert [(q["source_id"], q["reason"]) for q in window.quarantined] == [(0, "unsupervised")]
    assert (window.documents_split, window.ranges_unsupervised) == (0, 0)


@pytest.mark.parametrize("second", ["shards", "jsonl", "jsonl_masked"])
def test_a_mixture_of_masked_and_unmasked_sources_masks_every_window(tmp_path, second):
    """The unmasked source's documents carry all ones; the masked ones their own masks
    (a masked JSON Lines source is read through the mixture's sequential path)."""
    docs_a, docs_b = documents(12, seed=1), documents(12, seed=2)
    mask_a, mask_b = masks(docs_a), masks(docs_b, seed=5)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_shards(a, docs_a, supervision=mask_a)
    if second == "shards":
        write_shards(b, docs_b)
        entry_b = {"weight": 1, "shards": ["../b/shard-000", "../b/shard-001"]}
    elif second == "jsonl":
        write_jsonl(b, docs_b)
        entry_b = {"weight": 1, "jsonl": ["../b/docs.jsonl"]}
    else:
        write_jsonl(b, docs_b, supervision=mask_b)
        entry_b = {"weight": 1, "jsonl": ["../b/docs.jsonl"], "mask": "mask"}
    data = {
        "format": "streampack-corpus",
        "version": 1,
        "binding": BINDING,
        "sources": [{"weight": 1, "shards": ["shard-000", "shard-001"]}, entry_b],
        "stopping": "all_exhausted",
    }
    (a / "mix.json").write_text(json.dumps(data))
    source = open_corpus(a / "mix.json", allow_outside=True)
    assert source.masked
    seen = set()
    for window in iter_windows(source, 0, SPEC):
        assert window.mask is not None and not window.quarantined
        for i, (k, s) in enumerate(zip(window.source_index, window.source_id, strict=True)):
            piece = window.mask[window.offsets[i] : window.offsets[i + 1]].tolist()
            if k == 0:
                assert piece == mask_a[s]
            elif second == "jsonl_masked":
                assert piece == mask_b[s - 12]
            else:
                assert piece == [1] * len(docs_b[s - 12])
            seen.add((int(k), int(s)))
    assert len(seen) == 24


def test_inspect_lists_the_mask_reasons_and_counts_supervised_targets(tmp_path):
    report = inspect_corpus(bad_jsonl(tmp_path), capacity=64)
    assert report.quarantined == {"mask_length": 2, "mask_values": 3, "unsupervised": 1}
    assert report.supervised == 2 + 1  # [0,1,1] and [1,1]: targets 2 and 3, and 5
    assert "mask_values" in report.text() and "supervised  3 of 3 targets" in report.text()


FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "corpus"


def windows_digest(path, spec, allow_outside=False):
    """sha256 of every field of every window of epoch 1, in order."""
    h = hashlib.sha256()
    for w in iter_windows(open_corpus(path, allow_outside=allow_outside), 1, spec):
        assert w.mask is None
        fields = [w.epoch, w.index, w.documents, w.documents_split, w.pairs_cut, w.quarantined]
        h.update(json.dumps(fields, sort_keys=True).encode())
        for name, a in w.arrays().items():
            if name == "mask":  # the mask's wire frame, empty here; it came after the pin
                assert a.size == 0
                continue
            if name in ("source", "piece_start"):  # frames since the pin: hashed below
                continue
            h.update(name.encode() + str(a.dtype).encode() + a.tobytes())
        h.update(w.source_index.tobytes())
        if w.piece_start.any():  # a split document's pieces (all 0 when the pin was made)
            h.update(b"piece_start" + w.piece_start.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize(
    "corpus, capacity, digest",
    [
        ("manifest.json", 256, "d482e4215439b52461302cd3f72b59d5028adac9b2db42482a9bf118f87705fb"),
        ("jsonl.json", 256, "460c70e7ef22bab67e9d51489442dcd9ced236a9ea2b03f0aad9461e09ad3428"),
        ("split", 48, "f5c9de890ea7dd6afb73feb04ec6a5594258f595eeacf2444576e1064ec701f2"),
    ],
)
def test_unmasked_windows_are_byte_identical_to_before_masks(tmp_path, corpus, capacity, digest):
    """Pinned with the code before masks existed (commit 69d2882): the fixture corpus,
    shuffled, as shards, as JSON Lines, and split at capacity 48 (re-pinned when windows
    gained each piece's start in its document; their other fields are unchanged)."""
    path = FIXTURE / corpus
    if corpus == "split":
        data = json.loads((FIXTURE / "manifest.json").read_text())
        data["shards"] = [str(FIXTURE / n) for n in data["shards"]]
        data["long_documents"] = "split"
        path = tmp_path / "split.json"
        path.write_text(json.dumps(data))
    spec = CutSpec(
        capacity=capacity,
        window_documents=37,
        window_tokens=3000,
        shuffle=True,
        seed=7,
        shuffle_buffer=50,
    )
    assert windows_digest(path, spec, allow_outside=True) == digest


def test_the_producer_counts_unsupervised_ranges_and_mask_reasons(tmp_path):
    """Through the producer's own pipeline (``tests/_harness.py``: every message
    encoded and decoded): the ranges dropped and the documents quarantined are counted
    once each, as the windows say."""
    from _harness import Harness

    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(2, 80, 60)]
    mask = []
    for doc in docs:  # sparse marks: some ranges of a split document get none
        m = (rng.random(len(doc)) < 0.03).astype(int).tolist()
        m[-1] = 1
        mask.append(m)
    mask[7] = [1] + [0] * (len(docs[7]) - 1)  # unsupervised
    mask[9][0] = 2  # mask_values
    path = split_corpus(tmp_path, docs, mask)
    settings = {"capacity": 16, "window_documents": 7, "window_tokens": 400}
    spec = CutSpec(capacity=16, window_documents=7, window_tokens=400)
    windows = list(iter_windows(open_corpus(path), 0, spec))
    dropped = sum(w.ranges_unsupervised for w in windows)
    reasons = collections.Counter(q["reason"] for w in windows for q in w.quarantined)
    assert dropped > 0 and reasons == {"unsupervised": 1, "mask_values": 1}
    harness = Harness(path, **settings)
    harness.join(b"w1")
    harness.drain(b"c0", 0, 1)
    stats = harness.counters
    assert stats["ranges_unsupervised"] == dropped
    assert stats["documents_split"] == sum(w.documents_split for w in windows)
    assert stats["quarantine_reasons"] == dict(reasons)


def test_labels_mismatch_in_a_mixture_names_the_mixture_document(tmp_path):
    """A random-access mixture gathers each source's masks apart: a bad label of
    source 1 quarantines that document, named by its mixture source id."""
    docs_a, docs_b = documents(10, seed=1), documents(10, seed=2)
    mask_b = masks(docs_b)
    wrong = labels(docs_b, mask_b)
    wrong[6][-1] = (docs_b[6][-1] + 1) % 512
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_shards(a, docs_a)
    write_hf_dataset(b, docs_b, supervision={"labels": wrong}, key="labels")
    data = {
        "format": "streampack-corpus",
        "version": 1,
        "binding": BINDING,
        "sources": [
            {"weight": 1, "shards": ["shard-000", "shard-001"]},
            {"weight": 1, "arrow": ["../b/hf"], "labels": "labels"},
        ],
    }
    (a / "mix.json").write_text(json.dumps(data))
    source = open_corpus(a / "mix.json", allow_outside=True)
    assert source.random_access and source.masked
    windows = list(iter_windows(source, 0, SPEC))
    (q,) = [q for w in windows for q in w.quarantined]
    assert (q["source_id"], q["reason"]) == (10 + 6, "labels_mismatch")
    assert q["location"] == "source 1: ../b/hf/data-00001-of-00002.arrow@0#1"
    for w in windows:
        for i, (k, s) in enumerate(zip(w.source_index, w.source_id, strict=True)):
            piece = w.mask[w.offsets[i] : w.offsets[i + 1]].tolist()
            assert piece == (mask_b[s - 10] if k == 1 else [1] * len(docs_a[s]))


def test_a_masked_corpus_is_opened_and_cut_without_per_document_memory(tmp_path, monkeypatch):
    """100,000 masked documents (shards, and an Arrow file with a mask column): opening
    and cutting the first window allocates less than a copy of the masks would (300
    kB): they stay memory-mapped, like the tokens."""
    import tracemalloc

    import pyarrow as pa

    from streampack.corpus import offsets as offsets_module

    monkeypatch.setattr(offsets_module, "_CHUNK", 4096)  # offsets checked in small chunks
    count = 100_000
    tokens = np.arange(3 * count, dtype=np.int32) % 500
    mask = np.tile(np.array([0, 1, 1], np.uint8), count)
    offsets = np.arange(0, 3 * count + 1, 3, dtype=np.int64)
    np.save(tmp_path / "big.tokens.npy", tokens.astype(np.uint16))
    np.save(tmp_path / "big.offsets.npy", offsets)
    np.save(tmp_path / "big.mask.npy", mask)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), tokens),
            "completion_mask": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), mask),
        }
    )
    with (
        pa.OSFile(str(tmp_path / "big.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    del table, tokens, mask, offsets
    spec = CutSpec(capacity=8, window_documents=64, window_tokens=200)
    for entry in ({"shards": ["big"]}, {"arrow": ["big.arrow"], "mask": "completion_mask"}):
        corpus = manifest(tmp_path, **entry)
        next(iter_windows(open_corpus(corpus), 0, spec))  # imports done before measuring
        heap = pa.total_allocated_bytes()
        tracemalloc.start()
        source = open_corpus(corpus)
        window = next(iter_windows(source, 0, spec))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert source.masked and window.mask is not None and not window.quarantined
        assert peak < 150_000, (entry, peak)
        assert pa.total_allocated_bytes() == heap
