"""``streampack corpus build`` (a tokenizer built here, real CLI processes) and
``streampack corpus inspect`` over every format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _formats import WRITERS, documents, manifest, write_shard
from _service import ROOT, env

from streampack import BindingMismatch, InvalidConfig
from streampack.corpus import open_corpus
from streampack.corpus.build import build_corpus
from streampack.corpus.inspect import inspect_corpus
from streampack.windows import CutSpec, iter_windows

TEXTS = [
    "the cat sat on the mat",
    "a dog ran",
    "the dog sat",
    "cats and dogs ran on",
    "mat",
    "on the mat the cat sat and the dog ran",
] * 5


def make_tokenizer(path: Path, extra_word: str | None = None) -> Path:
    """A word-level tokenizer trained on TEXTS whose post-processor wraps every
    document in <s> ... </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = TEXTS + ([extra_word] if extra_word else [])
    tokenizer.train_from_iterator(
        corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer.save(str(path))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streampack.cli", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def build(tmp_path: Path, tokenizer: Path, out: str, *extra: str) -> dict:
    text = tmp_path / "text.jsonl"
    if not text.exists():
        text.write_text(
            "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS))
        )
    done = run(
        "corpus",
        "build",
        "--from",
        str(text),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / out),
        *extra,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # a pipe: no progress line
    return json.loads(done.stdout)


def read_documents(corpus: Path) -> list[list[int]]:
    spec = CutSpec(capacity=100, window_documents=1000, window_tokens=10**6)
    out = []
    for window in iter_windows(open_corpus(corpus), 0, spec):
        out += [
            window.tokens[a:b].tolist() for a, b in zip(window.offsets[:-1], window.offsets[1:])
        ]
    return out


def test_build_writes_shards_that_round_trip(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    report = build(tmp_path, tokenizer, "corpus", "--shard-tokens", "40")
    reference = Tokenizer.from_file(str(tokenizer))
    want = [reference.encode(t).ids for t in TEXTS]
    assert all(ids[0] == 1 and ids[-1] == 2 for ids in want)  # BOS/EOS from the tokenizer
    assert read_documents(tmp_path / "corpus") == want
    assert report["documents"] == len(TEXTS) and report["tokens"] == sum(map(len, want))
    # The throughput figures agree with the counts and the time (seconds has 3 decimals).
    assert report["seconds"] > 0
    for count, rate in (("documents", "documents_per_second"), ("tokens", "tokens_per_second")):
        assert abs(report[rate] * report["seconds"] - report[count]) <= 5e-4 * report[rate] + 1
    assert report["shards"] == len(list((tmp_path / "corpus").glob("*.tokens.npy"))) > 1
    assert np.load(tmp_path / "corpus" / "shard-00000.tokens.npy").dtype == np.uint16
    binding = report["binding"]
    assert binding["vocab_size"] == reference.get_vocab_size()
    assert binding["tokenizer"].endswith(
        __import__("hashlib").sha256(tokenizer.read_bytes()).hexdigest()
    )


def test_another_tokenizer_file_gives_another_binding_and_a_mismatch(tmp_path):
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    first = build(tmp_path, make_tokenizer(tmp_path / "a.json"), "a")["binding"]
    second = build(tmp_path, make_tokenizer(tmp_path / "b.json", extra_word="zebra"), "b")[
        "binding"
    ]
    assert first["tokenizer"] != second["tokenizer"]
    trainer_binding = open_corpus(tmp_path / "b").binding.to_binding()
    settings = ProducerSettings(corpus=str(tmp_path / "a"), capacity=32, window_tokens=64)
    _, _, batch = next(iter(rank_stream(settings, 0, 1)))
    with pytest.raises(BindingMismatch):
        batch.check_binding(trainer_binding)


def test_build_from_parquet_and_eos(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    pq.write_table(pa.table({"body": TEXTS[:6]}), tmp_path / "text.parquet", row_group_size=2)
    done = run(
        "corpus",
        "build",
        "--from",
        str(tmp_path / "text.parquet"),
        "--text-column",
        "body",
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / "c"),
        "--eos",
        "</s>",
        "--quiet",
    )
    assert done.returncode == 0, done.stderr
    docs = read_documents(tmp_path / "c")
    assert len(docs) == 6 and all(d[0] == 1 and d[-2:] == [2, 2] for d in docs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--tokenizer", "missing.json"], "tokenizer file '.*missing.json' does not exist"),
        (["--tokenizer", "text.jsonl"], "is not a Hugging Face tokenizer.json"),
        (["--eos", "<nope>"], "--eos '<nope>' is not a token"),
        (["--text-column", "body"], "holds no text under 'body'"),
    ],
)
def test_build_errors_are_one_line(tmp_path, args, match):
    import re

    make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    base = {"--tokenizer": str(tmp_path / "tokenizer.json")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = str(tmp_path / value) if flag == "--tokenizer" else value
    flags = [x for item in base.items() for x in item]
    done = run(
        "corpus",
        "build",
        "--from",
        str(tmp_path / "text.jsonl"),
        "--out",
        str(tmp_path / "out"),
        *flags,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # (after a warning per skipped line)
    assert re.match(r"streampack( corpus)?: error: ", last) and re.search(match, last), done.stderr


def test_build_refuses_an_existing_corpus(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    build(tmp_path, tokenizer, "corpus")
    done = run(
        "corpus",
        "build",
        "--from",
        str(tmp_path / "text.jsonl"),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(tmp_path / "corpus"),
    )
    assert done.returncode == 2 and "already holds a corpus" in done.stderr


def next_fit_rows(pairs: list[int], capacity: int) -> int:
    rows, used = 0, None
    for n in pairs:
        if used is None or used + n > capacity:
            rows, used = rows + 1, 0
        used += n
    return rows


@pytest.mark.parametrize("fmt", sorted(WRITERS) + ["shards", "jsonl"])
def test_inspect_reports_every_format(tmp_path, fmt):
    docs = documents(40)
    docs[7] = [1]  # too short: reported, left out of the figures
    if fmt == "shards":
        corpus = manifest(tmp_path, shards=[write_shard(tmp_path, "s", docs)])
    elif fmt == "jsonl":
        (tmp_path / "d.jsonl").write_text("".join(json.dumps({"tokens": d}) + "\n" for d in docs))
        corpus = manifest(tmp_path, jsonl=["d.jsonl"])
    else:
        corpus = WRITERS[fmt](tmp_path, docs)
    report = inspect_corpus(corpus, capacity=64)
    kept = [d for i, d in enumerate(docs) if i != 7]
    assert report.documents == 40 and report.kept == 39
    assert report.tokens == sum(map(len, kept))
    lengths = sorted(map(len, kept))
    assert report.length_quantiles["min"] == lengths[0]
    assert report.length_quantiles["max"] == lengths[-1]
    assert report.length_quantiles["p50"] == lengths[19]
    assert report.rows == next_fit_rows([len(d) - 1 for d in kept], 64)
    assert report.fill == pytest.approx(sum(len(d) - 1 for d in kept) / (report.rows * 64))
    assert report.quarantined == {"too_short": 1}
    assert report.binding["vocab_size"] == 512
    done = run("corpus", "inspect", str(corpus), "--capacity", "64", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == report.rows
    text = run("corpus", "inspect", str(corpus), "--capacity", "64").stdout
    assert "1 too_short" in text and f"{report.rows} rows" in text


def test_inspect_of_a_broken_corpus_is_one_line(tmp_path):
    (tmp_path / "d.idx").write_bytes(b"MMIDIDX\x00\x00")
    (tmp_path / "d.bin").write_bytes(b"")
    done = run("corpus", "inspect", str(manifest(tmp_path, megatron=["d"])))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "d.idx' is truncated" in done.stderr


@pytest.mark.parametrize("quiet", [False, True])
def test_build_shows_progress_on_a_terminal_only_without_quiet(tmp_path, quiet):
    import os
    import pty

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    controller, terminal = pty.openpty()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "streampack.cli",
            "corpus",
            "build",
            "--from",
            str(tmp_path / "text.jsonl"),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "out"),
            *(["--quiet"] if quiet else []),
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=terminal,
        timeout=120,
    )
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    assert done.returncode == 0
    assert json.loads(done.stdout)["documents"] == len(TEXTS)  # stdout: the result only
    if quiet:
        assert shown == b""
    else:
        assert f"corpus build: {len(TEXTS)} documents".encode() in shown


def build_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("corpus-build")]


def test_batches_encoded_on_several_threads_are_written_in_input_order(tmp_path, monkeypatch):
    """Many batches, one encoder thread per (pretended) core: the shards hold every
    document as encoding it alone gives, in input order; tokenizers' own threads are
    off during the build and the setting is as it was after it."""
    from tokenizers import Tokenizer

    from streampack.corpus import build

    monkeypatch.setattr(build, "usable_cores", lambda: 3)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    rng = np.random.default_rng(0)
    words = " ".join(TEXTS).split()
    texts = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(5 * build._BATCH)]
    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    seen = []
    encode = build._text_encoder

    def watched(*args):
        inner = encode(*args)

        def encode_batch(batch):
            seen.append((threading.current_thread().name, os.environ["TOKENIZERS_PARALLELISM"]))
            time.sleep(0.05)  # slower than reading: the next batch finds this thread busy
            return inner(batch)

        return encode_batch

    monkeypatch.setattr(build, "_text_encoder", watched)
    build_corpus(source, tokenizer, tmp_path / "out", shard_tokens=5000)
    reference = Tokenizer.from_file(str(tokenizer))
    assert read_documents(tmp_path / "out") == [reference.encode(t).ids for t in texts]
    assert {setting for _, setting in seen} == {"false"} and len(seen) == 5
    assert len({name for name, _ in seen}) > 1  # the batches went to more than one thread
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and build_threads() == []


def test_a_reading_error_is_raised_by_the_build(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "text.parquet")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(InvalidConfig, match="has no column 'text'; its columns are \\['body'\\]"):
        build_corpus(tmp_path / "text.parquet", tokenizer, tmp_path / "out")
    assert build_threads() == []


def test_a_failed_write_stops_the_reading_and_encoding_threads(tmp_path):
    """A shard that cannot be written ends the build with the error, and no thread of
    it goes on reading or encoding the rest of the input."""
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 200))
    (tmp_path / "out" / "shard-00001.tokens.npy").mkdir(parents=True)  # np.save fails
    with pytest.raises(IsADirectoryError) as failed:
        build_corpus(source, tokenizer, tmp_path / "out", shard_tokens=50)
    # Stopped by the build itself: the error (held here) still holds its frames.
    assert failed.value.__traceback__ is not None and build_threads() == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "shard-00000.offsets.npy",
        "shard-00000.tokens.npy",
        "shard-00001.tokens.npy",
    ]
