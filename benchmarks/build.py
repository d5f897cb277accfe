"""``corpus build`` beside the tokenizer alone and beside ``datasets.map``; prints JSON.

The same generated texts (``--documents`` of 100..400 words drawn from a Zipf-like
vocabulary of 5000 made-up words, seeded), one JSON Lines file ``{"text": ...}``, and a
byte-level BPE of ``--vocab`` tokens trained here with ``tokenizers`` (no download),
whose post-processor wraps each document in ``<s> ... </s>``. Measured in one run,
each best of ``--repeats`` rounds, taking turns:

* ``encode_batch`` / ``encode_batch_fast``: the tokenizer alone, every text already in
  memory, in one call (tokenizers' own Rust threads on every CPU, its default). The
  build calls ``encode_batch_fast`` where the installed tokenizers has it, a batch per
  thread of its own with that pool off.
* ``build``: ``streampack corpus build`` in process (``build_corpus``): reading the
  file, hashing it for the binding, encoding, writing the shards and the manifest.
* ``datasets_map``: the usual Hugging Face way, ``Dataset.from_json`` then
  ``.map(tokenize, batched=True, num_proc=2)`` with the same tokenizer call and
  ``save_to_disk`` (Arrow), with a fresh cache directory each round so nothing is
  reused. Its worker processes are forked, where tokenizers runs one thread each.

* ``build_cli`` and ``build_parts``: the build as a ``streampack corpus build`` process
  on every CPU, and as ``--parts`` processes at once (``--shard I/N``, each pinned to
  its share of the CPUs, as N machines would run it) followed by ``corpus merge``: on
  one machine the parts share its CPUs, so this measures what splitting costs (start-up,
  the merge's hash of the input) more than what N machines gain.

Checked (outside the timings): the build and the peer wrote the same tokens, document
by document, and the merged parts the single build's. Reported: wall and CPU seconds,
documents/s and tokens/s of each, the build's ratios of throughput to each of the
others (above 1: the build is faster), and ``parts_vs_cli`` (above 1: the parts were
faster than one process).

    .venv/bin/python benchmarks/build.py [--documents 20000] [--repeats 2] [--seed 0] [--parts 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streampack.corpus.build import build_corpus
from streampack.corpus.parts import merge_parts


def make_texts(documents: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(5000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    return [
        " ".join(rng.choices(words, weights, k=rng.randint(100, 400))) for _ in range(documents)
    ]


def train_tokenizer(texts: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts[:2000], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    tokenizer.save(str(path))


def timed(run: Callable[[], object]) -> tuple[float, float, object]:
    """Wall seconds, CPU seconds (this process and the children it waited for) and
    what ``run`` returned."""
    before, start = os.times(), time.perf_counter()
    value = run()
    wall, after = time.perf_counter() - start, os.times()
    cpu = sum(after[:4]) - sum(before[:4])  # user, system, children's user and system
    return wall, cpu, value


def encode(tokenizer_path: Path, texts: list[str], method: str) -> int:
    """Tokens of ``texts`` encoded in one call of ``method``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encodings = getattr(tokenizer, method)(texts, add_special_tokens=True)
    return sum(len(e) for e in encodings)


def build(source: Path, tokenizer_path: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    build_corpus(source, tokenizer_path, out)


def build_processes(source: Path, tokenizer_path: Path, out: Path, parts: int | None) -> None:
    """``corpus build`` as processes: one on every CPU, or ``parts`` at once, each on
    its share of the CPUs, then the merge."""
    shutil.rmtree(out, ignore_errors=True)
    cores = sorted(os.sched_getaffinity(0))
    count = parts or 1
    command = [sys.executable, "-m", "streampack.cli", "corpus", "build", "--quiet"]
    command += ["--from", str(source), "--tokenizer", str(tokenizer_path), "--out", str(out)]
    children = []
    for index in range(count):
        mine = set(cores[index * len(cores) // count : (index + 1) * len(cores) // count])
        children.append(
            subprocess.Popen(
                command + ([] if parts is None else ["--shard", f"{index}/{parts}"]),
                stdout=subprocess.DEVNULL,
                preexec_fn=lambda cpus=mine or set(cores): os.sched_setaffinity(0, cpus),
            )
        )
    if any(child.wait() for child in children):
        raise SystemExit("a corpus build process failed")
    if parts is not None:
        merge_parts(out, parts)


def same_corpus(a: Path, b: Path) -> bool:
    """Whether two built corpora hold the same tokens and documents, in order."""

    def arrays(corpus: Path) -> tuple[np.ndarray, np.ndarray]:
        names = json.loads((corpus / "manifest.json").read_text())["shards"]
        tokens = np.concatenate([np.load(corpus / f"{n}.tokens.npy") for n in names])
        lengths = np.concatenate([np.diff(np.load(corpus / f"{n}.offsets.npy")) for n in names])
        return tokens, lengths

    return all(np.array_equal(x, y) for x, y in zip(arrays(a), arrays(b)))


def datasets_map(source: Path, tokenizer_path: Path, out: Path, work: Path) -> None:
    import datasets
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in encode(batch["text"], add_special_tokens=True)]}

    shutil.rmtree(out, ignore_errors=True)
    cache = Path(tempfile.mkdtemp(dir=work))  # fresh: from_json and map reuse nothing
    # The forked workers would turn tokenizers' threads off anyway (with a warning each).
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        table = datasets.Dataset.from_json(str(source), cache_dir=str(cache))
        table = table.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
        table.save_to_disk(str(out))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
        shutil.rmtree(cache, ignore_errors=True)


def same_tokens(corpus: Path, peer: Path) -> bool:
    """Whether the build's shards and the peer's Arrow hold the same documents."""
    import datasets

    manifest = json.loads((corpus / "manifest.json").read_text())
    tokens = np.concatenate([np.load(corpus / f"{n}.tokens.npy") for n in manifest["shards"]])
    lengths = np.concatenate(
        [np.diff(np.load(corpus / f"{n}.offsets.npy")) for n in manifest["shards"]]
    )
    theirs = datasets.load_from_disk(str(peer))["input_ids"]
    their_lengths = np.array([len(ids) for ids in theirs])
    return bool(
        np.array_equal(lengths, their_lengths)
        and np.array_equal(
            tokens.astype(np.int64), np.fromiter((t for ids in theirs for t in ids), np.int64)
        )
    )


def rates(wall: float, cpu: float, documents: int, tokens: int) -> dict[str, float]:
    return {
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "documents_per_s": round(documents / wall, 1),
        "m_tokens_per_s": round(tokens / wall / 1e6, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=int, default=2, help="processes of build_parts")
    args = parser.parse_args()
    import datasets
    import tokenizers

    datasets.disable_progress_bars()
    texts = make_texts(args.documents, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source, tokenizer_path = work / "texts.jsonl", work / "tokenizer.json"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        train_tokenizer(texts, args.vocab, tokenizer_path)
        methods = ["encode_batch"]
        if hasattr(tokenizers.Tokenizer, "encode_batch_fast"):
            methods.append("encode_batch_fast")
        runs: dict[str, Callable[[], object]] = {
            **{m: functools.partial(encode, tokenizer_path, texts, m) for m in methods},
            "build": functools.partial(build, source, tokenizer_path, work / "corpus"),
            "datasets_map": functools.partial(
                datasets_map, source, tokenizer_path, work / "arrow", work
            ),
            "build_cli": functools.partial(
                build_processes, source, tokenizer_path, work / "cli", None
            ),
            "build_parts": functools.partial(
                build_processes, source, tokenizer_path, work / "parts", args.parts
            ),
        }
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        counts: set[object] = set()
        for _ in range(args.repeats):
            for name, run in runs.items():
                seconds, cpu_seconds, value = timed(run)
                if name in methods:
                    counts.add(value)
                wall[name] = min(wall.get(name, float("inf")), seconds)
                cpu[name] = min(cpu.get(name, float("inf")), cpu_seconds)
        same = same_tokens(work / "corpus", work / "arrow")
        parts_same = same_corpus(work / "corpus", work / "parts")
    (tokens,) = counts
    assert isinstance(tokens, int)
    others = [name for name in runs if not name.startswith("build")]
    print(
        json.dumps(
            {
                "benchmark": "corpus_build",
                "documents": args.documents,
                "tokens": tokens,
                "repeats": args.repeats,
                "cpus": len(os.sched_getaffinity(0)),
                "tokenizers": tokenizers.__version__,
                "datasets": datasets.__version__,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                **{name: rates(wall[name], cpu[name], args.documents, tokens) for name in runs},
                "same_tokens_as_datasets": same,
                "parts": args.parts,
                "parts_same_as_build": parts_same,
                "parts_vs_cli": round(wall["build_cli"] / wall["build_parts"], 3),
                # The build's throughput over each other's: in wall seconds, and in CPU
                # seconds (the steadier figure on a machine that others load too).
                **{f"build_vs_{n}": round(wall[n] / wall["build"], 3) for n in others},
                **{f"build_vs_{n}_cpu": round(cpu[n] / cpu["build"], 3) for n in others},
            },
            indent=1,
        )
    )
    if not same:
        raise SystemExit("the build and datasets.map wrote different tokens")
    if not parts_same:
        raise SystemExit("the merged parts differ from the single build")


if __name__ == "__main__":
    main()
