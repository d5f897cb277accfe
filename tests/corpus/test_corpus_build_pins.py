"""``corpus build`` output pinned: the files the sequential build wrote (commit 4c3d5a3,
one ``encode_batch`` call at a time, each document added to the shard on its own),
byte for byte, for every format — tokens, offsets, masks, the manifest, the report and
the warnings about skipped records.

Each case has more records than one encoding batch (1024), bad records among them
(before, inside and after a batch boundary; for ``messages`` a conversation with no
assistant token, skipped only after it is tokenized, next to rows skipped before), and
shards small enough to end inside a batch. The tokenizer is ``_chat``'s byte-level BPE,
trained here: its files are pinned first, so a tokenizers release that trains another
one fails there, not as a changed build."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from _chat import CONVERSATIONS, make_tokenizer_dir

from streampack.corpus.build import build_corpus
from streampack.corpus.tables import HEADER_NAME, ROWS_NAME, TABLE_KEY, open_table

RECORDS = 2100
WORDS = "the capital of France is Paris lovely in spring and Rome autumn two plus Four".split()


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))


def text_lines(rng: random.Random) -> list[str]:
    lines = [json.dumps({"text": sentence(rng), "n": i}) for i in range(RECORDS)]
    lines[3] = "{not json"
    lines[1023] = json.dumps({"body": "no text field"})
    lines[1024] = json.dumps({"text": 7})
    lines[2050] = json.dumps(["a list"])
    lines[7] = json.dumps({"text": ""})  # an empty text is a document (its EOS only)
    lines[8] = json.dumps({"text": "caf\u00e9 \u00fcber \U0001f600 Paris"})
    return lines


def pair_lines(rng: random.Random) -> list[str]:
    lines = [
        json.dumps({"prompt": sentence(rng), "completion": " " + sentence(rng)})
        for _ in range(RECORDS)
    ]
    lines[2] = json.dumps({"prompt": "only a prompt"})
    lines[1022] = "[1, 2"
    lines[1030] = json.dumps({"prompt": 3, "completion": "x"})
    lines[1500] = json.dumps({"prompt": "ends with", "completion": " it</s>"})
    return lines


def conversation_lines(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(RECORDS):
        turns = rng.choice(CONVERSATIONS)
        lines.append(json.dumps({"messages": [{**t, "content": sentence(rng)} for t in turns]}))
    lines[1] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    lines[4] = json.dumps({"messages": "not a list"})
    lines[1023] = json.dumps({"messages": [{"role": "user"}]})
    lines[1024] = json.dumps({"messages": [{"role": "user", "content": "still none"}]})
    return lines


def write_jsonl(lines: Callable[[random.Random], list[str]]) -> Callable[[Path, str], Path]:
    def write(root: Path, case: str) -> Path:
        path = root / "input.jsonl"
        path.write_text("".join(line + "\n" for line in lines(random.Random(case))))
        return path

    return write


def write_parquet(root: Path, case: str) -> Path:
    """The text lines' texts as a Parquet column (None for a line without one), in
    row groups that do not line up with the encoding batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = []
    for line in text_lines(random.Random(case)):
        try:
            texts.append(json.loads(line).get("text"))
        except (ValueError, AttributeError):
            texts.append(None)
    path = root / "input.parquet"
    texts = [t if isinstance(t, str) else None for t in texts]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=700)
    return path


CASES = {
    # name: (input writer, build_corpus keywords)
    "text": (write_jsonl(text_lines), {"eos": "</s>", "shard_tokens": 3000}),
    "text-parquet": (write_parquet, {"eos": "</s>", "shard_tokens": 4000}),
    "text-one-shard": (write_jsonl(text_lines), {"eos": "</s>"}),
    "prompt-completion": (
        write_jsonl(pair_lines),
        {"fmt": "prompt-completion", "shard_tokens": 5000},
    ),
    "messages": (write_jsonl(conversation_lines), {"fmt": "messages", "shard_tokens": 7000}),
    "messages-last": (write_jsonl(conversation_lines), {"fmt": "messages", "train_on": "last"}),
    "messages-all": (
        write_jsonl(conversation_lines),
        {"fmt": "messages", "train_on": "all", "shard_tokens": 20000},
    ),
}
# sha256 over every file but the manifest and the document table (name and bytes, names in
# order): the shards as the sequential build wrote them.
PINS = {
    "messages": "581a604b22ef616100e2d78c4bcf26c2d02ca2755547156e5d78c438ebc0146f",
    "messages-all": "6c558f76821a9213d0cd292df2746ade5a7a803ddd994e1b0c51d83abdca863f",
    "messages-last": "560688ba148a7b422e86ddd61472fe5635081efc1afa3340934f429ed4c5a6ff",
    "prompt-completion": "f3e3462d50f783307c636c3b0900f9b7c76b63b5df1577c34159143086a272e8",
    "text": "a6080d20c859e19c47853906f1fc4d2d33867b8e0a57e5cf35be5a421706f29a",
    "text-one-shard": "6c20a66de02e240d73ea0f9920112b6f1edb5f736dbd1ca0097b1591a98d9567",
    "text-parquet": "53ba739c3c1bc042f7cf220632becf97ccdf682704ed39f9e5527c99ea85a9ca",
}
REPORTS = {
    "messages": {
        "documents": 2096,
        "shards": 59,
        "skipped": 4,
        "supervised": 171244,
        "tokens": 414845,
    },
    "messages-all": {
        "documents": 2098,
        "shards": 21,
        "skipped": 2,
        "supervised": 412115,
        "tokens": 412115,
    },
    "messages-last": {
        "documents": 2096,
        "shards": 1,
        "skipped": 4,
        "supervised": 101935,
        "tokens": 416015,
    },
    "prompt-completion": {
        "documents": 2097,
        "shards": 40,
        "skipped": 3,
        "supervised": 102126,
        "tokens": 201206,
    },
    "text": {"documents": 2096, "shards": 35, "skipped": 4, "supervised": None, "tokens": 104241},
    "text-one-shard": {
        "documents": 2096,
        "shards": 1,
        "skipped": 4,
        "supervised": None,
        "tokens": 103504,
    },
    "text-parquet": {
        "documents": 2096,
        "shards": 26,
        "skipped": 4,
        "supervised": None,
        "tokens": 103639,
    },
}
FURTHER = " (further skips are only counted)"  # on the last warning logged
WARNINGS = {
    "messages": [
        "input.jsonl:2: no assistant tokens to train on; skipped",
        "input.jsonl:5: no 'messages' list of {'role', 'content'} strings; skipped",
        "input.jsonl:1024: no 'messages' list of {'role', 'content'} strings; skipped" + FURTHER,
    ],
    "messages-all": [
        "input.jsonl:5: no 'messages' list of {'role', 'content'} strings; skipped",
        "input.jsonl:1024: no 'messages' list of {'role', 'content'} strings; skipped",
    ],
    "messages-last": [
        "input.jsonl:2: no assistant tokens to train on; skipped",
        "input.jsonl:5: no 'messages' list of {'role', 'content'} strings; skipped",
        "input.jsonl:1024: no 'messages' list of {'role', 'content'} strings; skipped" + FURTHER,
    ],
    "prompt-completion": [
        "input.jsonl:3: no string 'prompt' and 'completion' fields; skipped",
        "input.jsonl:1023: no string 'prompt' and 'completion' fields; skipped",
        "input.jsonl:1031: no string 'prompt' and 'completion' fields; skipped" + FURTHER,
    ],
    "text": [
        "input.jsonl:4: no string 'text' field; line skipped",
        "input.jsonl:1024: no string 'text' field; line skipped",
        "input.jsonl:1025: no string 'text' field; line skipped" + FURTHER,
    ],
    "text-one-shard": [
        "input.jsonl:4: no string 'text' field; line skipped",
        "input.jsonl:1024: no string 'text' field; line skipped",
        "input.jsonl:1025: no string 'text' field; line skipped" + FURTHER,
    ],
    "text-parquet": [],
}
# The tokenizer the pins were made with (sha256 of each file of the directory).
TOKENIZER_FILES = {
    "chat_template.jinja": "5696fd7478ad8577eb73dbaf0290304ef7aaeddb54e47f58b1359773e5af590b",
    "tokenizer.json": "a55e2efba8ce14b7470480e00b003174345713b9c54b48b27e744d19890f3529",
    "tokenizer_config.json": "d9f784ad1d2fa2079b734d2470f1fbff319f6d9d1591c2306451c8f977c43626",
}


def files_digest(out: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(out.iterdir()):
        if path.name not in ("manifest.json", HEADER_NAME, ROWS_NAME):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok") / "tok")


def test_the_pins_tokenizer_is_the_one_trained_here(tokenizer_dir):
    assert {p.name: sha256(p) for p in sorted(tokenizer_dir.iterdir())} == TOKENIZER_FILES


@pytest.mark.parametrize("case", sorted(CASES))
def test_build_writes_the_pinned_files(tmp_path, tokenizer_dir, case, caplog):
    write, options = CASES[case]
    source = write(tmp_path, case)
    # The text format takes the tokenizer.json; the fine-tuning formats the directory.
    tokenizer = tokenizer_dir / "tokenizer.json" if "fmt" not in options else tokenizer_dir
    with caplog.at_level(logging.WARNING, logger="streampack.corpus.build"):
        report = build_corpus(source, tokenizer, tmp_path / "out", **options)
    got = {
        "documents": report.documents,
        "tokens": report.tokens,
        "shards": report.shards,
        "skipped": report.skipped,
        "supervised": report.supervised,
    }
    print(case, files_digest(tmp_path / "out"), got, caplog.messages)
    assert files_digest(tmp_path / "out") == PINS[case]
    assert got == REPORTS[case]
    assert caplog.messages == WARNINGS[case]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["binding"] == report.binding
    assert manifest["binding"]["split_receipt"] == f"{source.name} sha256:{sha256(source)}"
    names = [f"shard-{i:05d}" for i in range(report.shards)]
    assert manifest == {
        "format": "streampack-corpus",
        "version": 1,
        "binding": report.binding,
        "shards": names,
        **({"mask": True} if "fmt" in options else {}),
        TABLE_KEY: HEADER_NAME,
    }
    table = open_table(tmp_path / "out")
    assert table is not None and len(table) == report.documents
    assert (tmp_path / "out" / "manifest.json").read_text() == json.dumps(manifest, indent=1) + "\n"
