"""``streampack corpus build|inspect``: prepare a corpus from raw text, or look at one."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = actions.add_parser(
        "build", help="tokenize a .jsonl or .parquet text file into token shards + manifest"
    )
    build.add_argument(
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="FILE.jsonl|FILE.parquet",
        help="the text to tokenize",
    )
    build.add_argument(
        "--text-column",
        default="text",
        help="the field (JSON Lines) or column (Parquet) holding the text",
    )
    build.add_argument(
        "--tokenizer",
        required=True,
        type=Path,
        metavar="tokenizer.json|DIR",
        help="a Hugging Face tokenizers file, or (--format prompt-completion|messages) a "
        "tokenizer directory as AutoTokenizer.from_pretrained reads it; its content hash "
        "is the binding's tokenizer",
    )
    build.add_argument(
        "--format",
        dest="fmt",
        default="text",
        choices=("text", "prompt-completion", "messages"),
        help="text: the --text-column field, every token trained; prompt-completion: "
        "string 'prompt' and 'completion' fields, the completion and its EOS trained; "
        "messages: a list of {'role', 'content'} rendered by the chat template, the "
        "assistant's tokens trained (masked shards: NAME.mask.npy)",
    )
    build.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template replacing the tokenizer's (--format messages); it "
        "must mark the assistant's content with {%% generation %%}...{%% endgeneration %%}",
    )
    build.add_argument(
        "--train-on",
        default="assistant",
        choices=("assistant", "last", "all"),
        help="--format messages: every assistant turn (default), only the last one, or every token",
    )
    build.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="directory to write shards and manifest.json into",
    )
    build.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="append this token to every document (for tokenizers whose "
        "post-processor adds no end-of-sequence token)",
    )
    build.add_argument(
        "--shard-tokens", type=int, default=1 << 26, help="start a new shard after this many tokens"
    )
    build.add_argument("--partition", default="train", help="train, validation or test")
    build.add_argument(
        "--split-receipt",
        default=None,
        help="the binding's split_receipt (default: the input file's sha256)",
    )
    build.add_argument("--quiet", action="store_true", help="no progress line")
    inspect = actions.add_parser(
        "inspect", help="documents, tokens, lengths, next-fit fill and problems of a corpus"
    )
    inspect.add_argument(
        "path", metavar="PATH", help="a corpus manifest or a directory holding manifest.json"
    )
    inspect.add_argument(
        "--capacity", type=int, default=2048, help="prediction pairs per row for the next-fit fill"
    )
    inspect.add_argument(
        "--corpus-allow-outside",
        action="store_true",
        help="let manifest file names lead outside its directory",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    from streampack.errors import InvalidConfig

    if args.action == "build":
        from streampack.corpus.build import build_corpus
        from streampack.progress import Progress

        with Progress("corpus build", unit="documents", enabled=not args.quiet) as progress:
            built = build_corpus(
                args.source,
                args.tokenizer,
                args.out,
                text_column=args.text_column,
                eos=args.eos,
                shard_tokens=args.shard_tokens,
                partition=args.partition,
                split_receipt=args.split_receipt,
                progress=progress,
                fmt=args.fmt,
                chat_template=args.chat_template,
                train_on=args.train_on,
            )
        print(json.dumps({"out": str(args.out), **dataclasses.asdict(built)}))
        return 0
    from streampack.corpus.inspect import inspect_corpus

    if args.capacity < 1:
        raise InvalidConfig(f"--capacity {args.capacity}; expected a positive count of pairs")
    inspected = inspect_corpus(
        args.path, capacity=args.capacity, allow_outside=args.corpus_allow_outside
    )
    print(json.dumps(dataclasses.asdict(inspected)) if args.json else inspected.text())
    return 0
