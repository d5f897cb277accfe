"""``streampack corpus build --format prompt-completion|messages`` against TRL's own
SFT dataset preparation: on the same data, tokenizer directory and chat template (a
byte-level BPE trained here with ``tokenizers``, a template with ``{% generation %}``
written here; no download), every example's tokens and mask equal TRL's
``input_ids`` and ``labels != -100``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _chat import CONVERSATIONS, NO_GENERATION, TEMPLATE, make_tokenizer_dir
from _service import ROOT, env

from streampack import BindingMismatch
from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows

PAIRS = [
    # The prompt ends inside a word: "Par" + "is" merge into one BPE token, which TRL
    # (and so streampack) counts as completion.
    {"prompt": "The capital of France is Par", "completion": "is."},
    {"prompt": "What is two", "completion": " plus two? Four."},
    {"prompt": "Name a colour.", "completion": " Blue."},
    {"prompt": "Paris is lovely in spring, and Rome", "completion": " in autumn."},
]


def trl_prepared(rows: list[dict], tokenizer_dir: Path, **config) -> list[dict]:
    """TRL's own SFT dataset preparation (``SFTTrainer`` builds it on construction)
    of ``rows``: its ``input_ids`` and ``labels`` per example."""
    import datasets
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = SFTConfig(
        output_dir=str(tokenizer_dir.parent / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        **config,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    prepared = trainer.train_dataset
    assert len(prepared) == len(rows)  # TRL dropped nothing: the examples line up
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in prepared]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streampack.cli", "corpus", "build", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def build(tmp_path: Path, rows: list[dict], fmt: str, *extra: str, out: str = "corpus") -> dict:
    source = tmp_path / f"{out}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run("--from", str(source), "--out", str(tmp_path / out), "--format", fmt, *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def read_masked(path: Path) -> list[tuple[list[int], list[int]]]:
    """Every document's (tokens, mask), in corpus order, through the window cut."""
    source = open_corpus(path)
    assert source.masked
    got = []
    for window in iter_windows(
        source, 0, CutSpec(capacity=512, window_documents=64, window_tokens=1 << 16)
    ):
        assert not window.quarantined
        for i in range(len(window.start)):
            lo, hi = window.offsets[i], window.offsets[i + 1]
            got.append((window.tokens[lo:hi].tolist(), window.mask[lo:hi].tolist()))
    return got


def as_trl(prepared: list[dict]) -> list[tuple[list[int], list[int]]]:
    return [(r["input_ids"], [int(label != -100) for label in r["labels"]]) for r in prepared]


def test_prompt_completion_gives_trls_tokens_and_completion_mask(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    built = build(tmp_path, PAIRS, "prompt-completion", "--tokenizer", str(tokenizer))
    ours = read_masked(tmp_path / "corpus")
    theirs = as_trl(trl_prepared(PAIRS, tokenizer, completion_only_loss=True))
    assert ours == theirs
    # The cases are what they claim: a merge across the boundary, and the EOS trained.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer))
    prompt_ids = hf(PAIRS[0]["prompt"])["input_ids"]
    assert ours[0][0][: len(prompt_ids)] != prompt_ids
    assert all(tokens[-1] == hf.eos_token_id and mask[-1] == 1 for tokens, mask in ours)
    assert built["supervised"] == sum(sum(mask) for _, mask in ours)
    assert json.loads((tmp_path / "corpus" / "manifest.json").read_text())["mask"] is True


def test_messages_give_trls_tokens_and_assistant_masks(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    rows = [{"messages": m} for m in CONVERSATIONS]
    build(tmp_path, rows, "messages", "--tokenizer", str(tokenizer))
    ours = read_masked(tmp_path / "corpus")
    assert ours == as_trl(trl_prepared(rows, tokenizer, assistant_only_loss=True))
    assert all(0 < sum(mask) < len(mask) for _, mask in ours)


def test_train_on_last_is_trls_final_assistant_turn(tmp_path):
    """TRL's oracle for "only the last turn": the conversation as a prompt (every turn
    but the last) and a completion (the last), with both completion-only and
    assistant-only loss: the final turn's generation block."""
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    rows = [{"messages": m} for m in CONVERSATIONS]
    build(tmp_path, rows, "messages", "--tokenizer", str(tokenizer), "--train-on", "last")
    ours = read_masked(tmp_path / "corpus")
    split = [{"prompt": m[:-1], "completion": m[-1:]} for m in CONVERSATIONS]
    theirs = as_trl(
        trl_prepared(split, tokenizer, completion_only_loss=True, assistant_only_loss=True)
    )
    assert ours == theirs
    everything = build(tmp_path, rows, "messages", "--tokenizer", str(tokenizer), out="all_turns")
    assert everything["supervised"] > sum(sum(mask) for _, mask in ours)


def test_train_on_all_marks_every_token_of_trls_rendering(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok", template=NO_GENERATION)
    rows = [{"messages": m} for m in CONVERSATIONS]
    build(tmp_path, rows, "messages", "--tokenizer", str(tokenizer), "--train-on", "all")
    ours = read_masked(tmp_path / "corpus")
    theirs = trl_prepared(rows, tokenizer)
    assert [t for t, _ in ours] == [r["input_ids"] for r in theirs]
    assert all(set(mask) == {1} for _, mask in ours)


def test_a_template_without_generation_is_refused_with_the_fix(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok", template=NO_GENERATION)
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    done = run(
        "--from",
        str(source),
        "--out",
        str(tmp_path / "out"),
        "--format",
        "messages",
        "--tokenizer",
        str(tokenizer),
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert re.search(
        r"the chat template of '.*tok' has no \{% generation %\} block, so transformers "
        r"cannot mark the assistant's tokens \(--train-on assistant would train nothing\); "
        r"wrap each assistant message's content \(and its end-of-turn token\) in "
        r"\{% generation %\}...\{% endgeneration %\} and pass it with --chat-template FILE, "
        r"or use --train-on all",
        line,
    ), line
    assert not (tmp_path / "out" / "manifest.json").exists()
    # The fix it names works: the same tokenizer with --chat-template.
    (tmp_path / "fixed.jinja").write_text(TEMPLATE)
    build(
        tmp_path,
        [{"messages": CONVERSATIONS[0]}],
        "messages",
        "--tokenizer",
        str(tokenizer),
        "--chat-template",
        str(tmp_path / "fixed.jinja"),
    )
    assert (
        read_masked(tmp_path / "corpus")[0][1]
        == as_trl(
            trl_prepared(
                [{"messages": CONVERSATIONS[0]}],
                make_tokenizer_dir(tmp_path / "tok2"),
                assistant_only_loss=True,
            )
        )[0][1]
    )


def test_another_chat_template_gives_another_binding_and_a_mismatch(tmp_path):
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    rows = [{"messages": m} for m in CONVERSATIONS]
    first = build(tmp_path, rows, "messages", "--tokenizer", str(tokenizer), out="a")
    # The same words, one space more in the template: other tokens, so another binding.
    (tmp_path / "other.jinja").write_text(TEMPLATE.replace("}}\n{%", "}} \n{%", 1))
    second = build(
        tmp_path,
        rows,
        "messages",
        "--tokenizer",
        str(tokenizer),
        "--chat-template",
        str(tmp_path / "other.jinja"),
        out="b",
    )
    assert first["binding"]["tokenizer"] != second["binding"]["tokenizer"]
    assert first["binding"]["tokenizer"].startswith("tokenizer directory sha256:")
    assert " chat_template sha256:" in first["binding"]["tokenizer"]
    trainer_binding = open_corpus(tmp_path / "b").binding.to_binding()
    settings = ProducerSettings(corpus=str(tmp_path / "a"), capacity=64, window_tokens=256)
    _, _, batch = next(iter(rank_stream(settings, 0, 1)))
    with pytest.raises(BindingMismatch):
        batch.check_binding(trainer_binding)


def test_records_without_the_fields_are_skipped_and_counted(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    rows = [PAIRS[0], {"prompt": "only a prompt"}, {"prompt": 3, "completion": "x"}, PAIRS[1]]
    built = build(tmp_path, rows, "prompt-completion", "--tokenizer", str(tokenizer))
    assert (built["documents"], built["skipped"]) == (2, 2)
    shards = sorted((tmp_path / "corpus").glob("*.mask.npy"))
    assert len(shards) == 1 and np.load(shards[0]).dtype == np.uint8


def test_a_tokenizer_json_with_eos_gives_what_its_directory_gives(tmp_path):
    tokenizer = make_tokenizer_dir(tmp_path / "tok")
    build(tmp_path, PAIRS, "prompt-completion", "--tokenizer", str(tokenizer), out="dir")
    build(
        tmp_path,
        PAIRS,
        "prompt-completion",
        "--tokenizer",
        str(tokenizer / "tokenizer.json"),
        "--eos",
        "</s>",
        out="file",
    )
    assert read_masked(tmp_path / "dir") == read_masked(tmp_path / "file")


@pytest.mark.parametrize(
    ("fmt", "args", "match"),
    [
        (
            "prompt-completion",
            ["--tokenizer", "tok/tokenizer.json"],
            "--format prompt-completion ends each completion with the EOS token, and "
            "'.*tokenizer.json' names none; give --eos TOKEN",
        ),
        (
            "messages",
            ["--tokenizer", "tok/tokenizer.json"],
            "--tokenizer '.*tokenizer.json' has no chat template; give one with "
            "--chat-template FILE",
        ),
        (
            "messages",
            ["--tokenizer", "tok", "--chat-template", "missing.jinja"],
            "chat template '.*missing.jinja' does not exist",
        ),
        (
            "prompt-completion",
            ["--tokenizer", "tok", "--eos", "<nope>"],
            "--eos '<nope>' is not a token of",
        ),
        (
            "text",
            ["--tokenizer", "tok/tokenizer.json", "--chat-template", "t.jinja"],
            "--chat-template applies to --format messages only",
        ),
        (
            "messages",
            ["--tokenizer", "nowhere"],
            "--tokenizer '.*nowhere' is neither a tokenizer directory",
        ),
    ],
)
def test_fine_tuning_build_errors_are_one_line(tmp_path, fmt, args, match):
    make_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({**PAIRS[0], "messages": CONVERSATIONS[0]}) + "\n")
    paths = {"--tokenizer", "--chat-template"}  # flags whose values are files here
    flags = [str(tmp_path / a) if i % 2 and args[i - 1] in paths else a for i, a in enumerate(args)]
    done = run("--from", str(source), "--out", str(tmp_path / "out"), "--format", fmt, *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(r"streampack( corpus)?: error: ", last) and re.search(match, last), last
