"""Corpus readers: manifests, window cuts, shuffles and the quarantine screen."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _formats import corpus_manifest, manifest, write_shard

from streampack import InvalidConfig
from streampack.corpus import open_corpus
from streampack.corpus.order import corpus_permutation
from streampack.windows import CutSpec, iter_windows

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "corpus"
BINDING = {"vocab_size": 50, "tokenizer": "t", "split_receipt": "r", "partition": "train"}


def write_shards(root: Path, shards: list[list[list[int]]], dtypes=None) -> Path:
    """A token-shard corpus with the given documents per shard."""
    names = [
        write_shard(root, f"s{index}", docs, (dtypes or {}).get(index, np.int32))
        for index, docs in enumerate(shards)
    ]
    return manifest(root, binding=BINDING, shards=names)


def write_jsonl(root: Path, lines: list[str]) -> Path:
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    path = root / "jsonl.json"
    path.write_text(json.dumps(corpus_manifest(binding=BINDING, jsonl=["docs.jsonl"])))
    return path


def doc(length: int, first: int = 2) -> list[int]:
    return [(first + i) % 48 + 2 for i in range(length)]


def test_windows_close_on_documents_or_tokens(tmp_path):
    lengths = [5, 3, 9, 2, 7, 7, 1, 8]
    source = open_corpus(write_shards(tmp_path, [[doc(n) for n in lengths]]))
    spec = CutSpec(capacity=16, window_documents=4, window_tokens=20)
    windows = list(iter_windows(source, 0, spec))
    assert [w.documents for w in windows] == [4, 3, 1]
    assert [w.source_id.tolist() for w in windows] == [[0, 1, 2, 3], [4, 5], [7]]
    # document 6 has one token: it is cut into window 1 and quarantined there
    assert [(q["source_id"], q["reason"]) for q in windows[1].quarantined] == [(6, "too_short")]
    np.testing.assert_array_equal(windows[0].offsets, [0, 5, 8, 17, 19])
    np.testing.assert_array_equal(windows[2].tokens, doc(8))


def test_shards_and_jsonl_of_the_fixture_give_the_same_windows():
    spec = CutSpec(capacity=256, window_documents=50, window_tokens=3000)
    shards = list(iter_windows(open_corpus(FIXTURE), 0, spec))
    lines = list(iter_windows(open_corpus(FIXTURE / "jsonl.json"), 0, spec))
    assert len(shards) == len(lines) > 5
    for a, b in zip(shards, lines):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(a.source_id, b.source_id)
    # ids from the JSON lines become example ids; shards use the corpus position
    assert lines[0].example_id[0] == 1_000_000 and shards[0].example_id[0] == 0
    assert sum(len(w.start) for w in shards) == 600


def test_windows_span_shards_and_keep_corpus_positions(tmp_path):
    source = open_corpus(write_shards(tmp_path, [[doc(3), doc(4)], [doc(5)]], {0: np.uint16}))
    (window,) = iter_windows(source, 0, CutSpec(capacity=8, window_documents=9, window_tokens=99))
    np.testing.assert_array_equal(window.source_id, [0, 1, 2])
    np.testing.assert_array_equal(window.tokens, doc(3) + doc(4) + doc(5))
    assert window.tokens.dtype == np.uint16  # the wire dtype: the vocabulary fits 16 bits


def test_shuffle_is_a_permutation_of_seed_and_epoch(tmp_path):
    source = open_corpus(write_shards(tmp_path, [[doc(2 + i % 5, i) for i in range(40)]]))
    spec = CutSpec(capacity=8, window_documents=6, window_tokens=30, shuffle=True, seed=7)

    def order(epoch):
        return np.concatenate([w.source_id for w in iter_windows(source, epoch, spec)])

    assert sorted(order(0).tolist()) == list(range(40))
    np.testing.assert_array_equal(order(0), order(0))
    np.testing.assert_array_equal(order(0), corpus_permutation(40, 7, 0))
    assert not np.array_equal(order(0), order(1))


def test_bounded_shuffle_buffer_for_json_lines(tmp_path):
    path = write_jsonl(tmp_path, [json.dumps({"tokens": doc(3, i)}) for i in range(30)])
    source = open_corpus(path)
    spec = CutSpec(
        capacity=8, window_documents=4, window_tokens=99, shuffle=True, seed=3, shuffle_buffer=5
    )
    first = np.concatenate([w.source_id for w in iter_windows(source, 0, spec)])
    again = np.concatenate([w.source_id for w in iter_windows(source, 0, spec)])
    assert sorted(first.tolist()) == list(range(30))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, np.arange(30))
    # a buffer of 5 can move a document at most 4 places earlier
    assert all(position >= source_id - 4 for position, source_id in enumerate(first))


def test_start_window_skips_without_renumbering(tmp_path):
    source = open_corpus(write_shards(tmp_path, [[doc(3, i) for i in range(20)]]))
    spec = CutSpec(capacity=8, window_documents=3, window_tokens=99, shuffle=True, seed=1)
    full = list(iter_windows(source, 2, spec))
    tail = list(iter_windows(source, 2, spec, start_window=4))
    assert [w.index for w in tail] == [w.index for w in full[4:]]
    for a, b in zip(full[4:], tail):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_bad_documents_are_quarantined_with_reasons(tmp_path):
    lines = [
        json.dumps({"tokens": doc(4)}),
        json.dumps({"tokens": [2, 3, 99]}),  # out of vocabulary (50)
        json.dumps({"tokens": [5]}),  # one token
        json.dumps({"tokens": doc(12)}),  # longer than capacity + 1 = 9
        '{"tokens": [1, 2',  # malformed
        json.dumps({"tokens": [1.5, 2.0, 3.0]}),  # wrong dtype
        json.dumps({"tokens": doc(6), "start": 4, "stop": 9}),  # range outside
        json.dumps({"tokens": [-1, 2, 3]}),  # negative id
        json.dumps({"tokens": doc(9), "start": 2, "stop": 7, "id": 42}),  # a good range
        json.dumps(["not", "an", "object"]),
    ]
    source = open_corpus(write_jsonl(tmp_path, lines))
    windows = list(
        iter_windows(source, 0, CutSpec(capacity=8, window_documents=4, window_tokens=99))
    )
    reasons = {q["source_id"]: q["reason"] for w in windows for q in w.quarantined}
    assert reasons == {
        1: "out_of_vocabulary",
        2: "too_short",
        3: "too_long",
        4: "malformed",
        5: "wrong_dtype",
        6: "bad_range",
        7: "out_of_vocabulary",
        9: "malformed",
    }
    kept = np.concatenate([w.source_id for w in windows])
    np.testing.assert_array_equal(kept, [0, 8])
    last = windows[2]
    assert last.start.tolist() == [2] and last.stop.tolist() == [7]
    assert last.example_id.tolist() == [42]
    details = {q["source_id"]: q for w in windows for q in w.quarantined}
    assert "vocabulary is [0, 50)" in details[1]["detail"]
    assert details[4]["location"] == "docs.jsonl:5"


def test_a_huge_uint32_token_is_its_documents_problem(tmp_path):
    """A value out of the vocabulary is a document's problem (quarantined alone); a
    shard of a dtype that holds no token ids is the file's (test_corpus_file_problems)."""
    source = open_corpus(
        write_shards(
            tmp_path, [[doc(3), doc(3)], [doc(4)], [[2, 2**32 - 1, 3]]], {1: ">i4", 2: np.uint32}
        )
    )
    (window,) = iter_windows(source, 0, CutSpec(capacity=8, window_documents=9, window_tokens=99))
    assert [(q["source_id"], q["reason"]) for q in window.quarantined] == [(3, "out_of_vocabulary")]
    np.testing.assert_array_equal(window.tokens, doc(3) + doc(3) + doc(4))


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        ({"format": "other"}, "expected 'streampack-corpus'"),
        ({"format": "streampack-corpus", "version": 9}, "version 9"),
        ({"format": "streampack-corpus", "version": 1, "binding": {"vocab_size": 3}}, "binding"),
        (corpus_manifest(binding=BINDING), "exactly one of"),
        (corpus_manifest(binding=BINDING, shards=[]), "non-empty list"),
        (corpus_manifest(binding=BINDING, shards=["x"]), "shard 'x' tokens .* does not exist"),
        (corpus_manifest(binding=dict(BINDING, partition="dev"), shards=["x"]), "partition"),
    ],
)
def test_bad_manifests_are_config_errors(tmp_path, manifest, match):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidConfig, match=match):
        open_corpus(tmp_path)


def test_missing_manifest_says_what_is_accepted(tmp_path):
    with pytest.raises(InvalidConfig, match="directory holding manifest.json"):
        open_corpus(tmp_path)


def test_inconsistent_offsets_are_rejected(tmp_path):
    write_shards(tmp_path, [[doc(3)]])
    np.save(tmp_path / "s0.offsets.npy", np.array([0, 5], dtype=np.int64))
    with pytest.raises(InvalidConfig, match="end at the token count 3"):
        open_corpus(tmp_path)


def test_bundled_corpus_is_regenerated_byte_for_byte(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", FIXTURE / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    for path in sorted(FIXTURE.iterdir()):
        if path.is_file() and path.suffix != ".py":
            assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


# Corpus-reading defects: each is one clear InvalidConfig naming the file, or a
# quarantined document, never a crash or a hang.


def test_deeply_nested_json_line_is_quarantined_not_a_crash(tmp_path):
    lines = [
        json.dumps({"tokens": doc(4)}),
        "[" * 100_000,
        '{"tokens": [2, 3, 1' + "9" * 5000 + "]}",
        json.dumps({"tokens": doc(5)}),
    ]
    source = open_corpus(write_jsonl(tmp_path, lines))
    (window,) = iter_windows(source, 0, CutSpec(capacity=8, window_documents=9, window_tokens=99))
    assert [(q["source_id"], q["reason"]) for q in window.quarantined] == [
        (1, "malformed"),
        (2, "malformed"),
    ]
    assert "nested too deeply" in window.quarantined[0]["detail"]
    np.testing.assert_array_equal(window.source_id, [0, 3])


def test_digest_survives_a_deeply_nested_line(tmp_path):
    import subprocess
    import sys

    path = write_jsonl(tmp_path, [json.dumps({"tokens": doc(4)}), "[" * 100_000])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "streampack.cli",
            "digest",
            "--corpus",
            str(path),
            "--rank",
            "0",
            "--world-size",
            "1",
            "--capacity",
            "8",
            "--window-tokens",
            "99",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["batches"] == 1


def test_blank_lines_are_skipped_and_counted_not_documents(tmp_path):
    """As pandas and datasets read JSON Lines: a whitespace-only line is no document
    (it takes no source id, so later lines keep theirs), and a bad line after it is
    still named by its own line number."""
    lines = [
        json.dumps({"tokens": doc(4)}),
        "",
        "   \t",
        json.dumps({"tokens": doc(5)}),
        "",
        "not json",
    ]
    source = open_corpus(write_jsonl(tmp_path, lines))
    (window,) = iter_windows(source, 0, CutSpec(capacity=8, window_documents=9, window_tokens=99))
    assert [(q["source_id"], q["reason"], q["location"]) for q in window.quarantined] == [
        (2, "malformed", "docs.jsonl:6"),
    ]
    np.testing.assert_array_equal(window.source_id, [0, 1])  # line 4 is source id 1
    assert window.documents == 3
    assert source.blank_lines == 3


def test_a_manifest_that_is_not_utf8_is_one_clear_error(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b'{"format": "streampack-corpus\xff\xfe"}')
    with pytest.raises(InvalidConfig, match="manifest.json' is not UTF-8 text"):
        open_corpus(tmp_path)


def test_a_zero_byte_offsets_file_is_one_clear_error(tmp_path):
    write_shards(tmp_path, [[doc(3)]])
    (tmp_path / "s0.offsets.npy").write_bytes(b"")
    with pytest.raises(InvalidConfig, match=r"offsets '.*s0\.offsets\.npy' is empty \(0 bytes\)"):
        open_corpus(tmp_path)


def test_a_truncated_tokens_file_is_one_clear_error(tmp_path):
    write_shards(tmp_path, [[doc(300)]])
    data = (tmp_path / "s0.tokens.npy").read_bytes()
    (tmp_path / "s0.tokens.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidConfig, match=r"s0\.tokens\.npy' is not a readable \.npy file"):
        open_corpus(tmp_path)


def test_decreasing_offsets_name_the_document(tmp_path):
    write_shards(tmp_path, [[doc(3), doc(3)]])
    np.save(tmp_path / "s0.offsets.npy", np.array([0, 4, 2, 6], dtype=np.int64))
    with pytest.raises(InvalidConfig, match="offsets decrease at document 1 \\(4 then 2\\)"):
        open_corpus(tmp_path)


def test_an_empty_corpus_is_refused(tmp_path):
    write_shards(tmp_path, [[]])
    with pytest.raises(InvalidConfig, match="holds no documents"):
        open_corpus(tmp_path)


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "sub/../../outside"])
def test_manifest_names_may_not_leave_the_corpus_directory(tmp_path, name):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shards(tmp_path, [[doc(3)]])  # a real shard one level up
    (tmp_path / "outside.jsonl").write_text(json.dumps({"tokens": doc(3)}) + "\n")
    for key, entry in (("shards", name), ("jsonl", name + ".jsonl")):
        manifest(corpus, binding=BINDING, **{key: [entry]})
        with pytest.raises(InvalidConfig, match="absolute path|leads outside the corpus"):
            open_corpus(corpus)


def test_names_outside_the_directory_open_when_allowed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shards(tmp_path, [[doc(3), doc(4)]])
    manifest(corpus, binding=BINDING, shards=[str(tmp_path / "s0")])
    assert open_corpus(corpus, allow_outside=True).num_documents == 2


def test_a_symlink_leading_out_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (tmp_path / "secret.jsonl").write_text(json.dumps({"tokens": doc(3)}) + "\n")
    (corpus / "docs.jsonl").symlink_to(tmp_path / "secret.jsonl")
    manifest(corpus, binding=BINDING, jsonl=["docs.jsonl"])
    with pytest.raises(InvalidConfig, match="leads outside the corpus"):
        open_corpus(corpus)


@pytest.mark.parametrize("which", ["tokens", "jsonl"])
def test_a_fifo_is_refused_not_read(tmp_path, which):
    import os

    if which == "tokens":
        write_shards(tmp_path, [[doc(3)]])
        (tmp_path / "s0.tokens.npy").unlink()
        os.mkfifo(tmp_path / "s0.tokens.npy")
        path = tmp_path
    else:
        path = write_jsonl(tmp_path, [json.dumps({"tokens": doc(3)})])
        (tmp_path / "docs.jsonl").unlink()
        os.mkfifo(tmp_path / "docs.jsonl")
    with pytest.raises(InvalidConfig, match="is not a regular file"):
        open_corpus(path)
