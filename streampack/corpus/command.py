"""``streampack corpus build|merge|digest|inspect``: prepare a corpus from raw text (on
one machine, or in parts on many: ``build --shard I/N`` then ``merge``), compute its
per-document table (``digest``), or look at one."""

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
        metavar="FILE.jsonl|FILE.parquet",
        help="the text to tokenize: a path or a URL (s3://, gs://, hf://, https://, ...)",
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
        metavar="DIR|URL",
        help="directory or store folder (s3://bucket/corpus) to write shards and "
        "manifest.json into; the manifest is written last",
    )
    build.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="build only part I of N (from 0) of the input, into OUT/part-I-of-N/; when "
        "all N are built, corpus merge writes the manifest",
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
    _storage_flags(build)
    merge = actions.add_parser(
        "merge", help="write the manifest of a corpus built in parts (corpus build --shard I/N)"
    )
    merge.add_argument(
        "--out", required=True, metavar="DIR|URL", help="the --out every part was built into"
    )
    merge.add_argument("--parts", required=True, type=int, metavar="N", help="the N of --shard I/N")
    _storage_flags(merge)
    digest = actions.add_parser(
        "digest",
        help="compute the per-document table (content digest, length, token range, "
        "supervised targets) of a corpus, beside its manifest or into --out",
    )
    digest.add_argument(
        "path",
        metavar="PATH|URL",
        help="a corpus manifest, a directory holding manifest.json, or a URL of either",
    )
    digest.add_argument(
        "--out",
        default=None,
        metavar="DIR|URL",
        help="write the table here (default: beside the manifest, which then names it "
        "under document_table)",
    )
    digest.add_argument(
        "--corpus-allow-outside",
        action="store_true",
        help="let manifest file names lead outside its directory",
    )
    _storage_flags(digest)
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


def _storage_flags(parser: argparse.ArgumentParser) -> None:
    from streampack.settings import FIELD_HELP

    for name in ("endpoint_url", "region"):
        parser.add_argument(
            f"--corpus-{name.replace('_', '-')}",
            dest=f"corpus_{name}",
            default=None,
            help=FIELD_HELP[f"corpus_{name}"].replace("a remote corpus's", "--from/--out URLs'"),
        )


def main(args: argparse.Namespace) -> int:
    from streampack.errors import InvalidConfig

    if args.action in ("build", "merge", "digest"):
        from streampack.corpus.build import BUILD_CACHE_BYTES
        from streampack.settings import StorageOptions

        storage = StorageOptions(
            endpoint_url=args.corpus_endpoint_url,
            region=args.corpus_region,
            cache_bytes=BUILD_CACHE_BYTES,
        )
    if args.action == "digest":
        from streampack.corpus.tables import digest_corpus

        written = digest_corpus(
            args.path, args.out, storage=storage, allow_outside=args.corpus_allow_outside
        )
        print(json.dumps(written))
        return 0
    if args.action == "merge":
        from streampack.corpus.parts import merge_parts

        print(json.dumps(merge_parts(args.out, args.parts, storage)))
        return 0
    if args.action == "build":
        from streampack.corpus.build import build_corpus
        from streampack.corpus.parts import Part
        from streampack.progress import Progress

        shard = None if args.shard is None else Part.parse(args.shard)
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
                shard=shard,
                storage=storage,
            )
        out = {"out": str(args.out), **dataclasses.asdict(built)}
        if shard is not None:
            out["part"] = str(shard)
        print(json.dumps(out))
        return 0
    from streampack.corpus.inspect import inspect_corpus

    if args.capacity < 1:
        raise InvalidConfig(f"--capacity {args.capacity}; expected a positive count of pairs")
    inspected = inspect_corpus(
        args.path, capacity=args.capacity, allow_outside=args.corpus_allow_outside
    )
    print(json.dumps(dataclasses.asdict(inspected)) if args.json else inspected.text())
    return 0
