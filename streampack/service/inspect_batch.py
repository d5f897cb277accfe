"""``streampack inspect``: a picture of one batch, in the terminal and as a PNG.

The batch comes from one of:

- the worked example (the default; ``--fixture`` names another ``input.json``);
- a corpus and the service's settings: ``--corpus PATH --batch G [--epoch E]`` is global
  batch ``G`` of epoch ``E`` exactly as the producer numbers it (``--config`` and the
  ``produce`` flags that change the stream apply);
- a file ``streampack consume --save-batch FILE.npz`` wrote (``--batch-file``).

The terminal rendering (``streampack.render.batch_text``) is printed to stdout, in
colour on a terminal (``--color``/``--no-color`` decide; ``NO_COLOR`` is honoured);
``--png FILE`` also draws it with matplotlib.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

from ..batch import PackedBatch
from ..errors import InvalidConfig
from ..render import batch_png, batch_text, load_batch
from ..settings import ProducerSettings, add_flags, check_output_path, from_args


def worked_example(fixture: str | None) -> PackedBatch:
    """The worked example's one batch."""
    from ..packing import pack_examples
    from ..trace import find_fixture, load_worked_example

    examples, binding, config, _ = load_worked_example(find_fixture(fixture))
    return pack_examples(examples, binding, config).batches[0]


def corpus_batch(settings: ProducerSettings, epoch: int, index: int) -> PackedBatch:
    """Global batch ``index`` of ``epoch``, as the service numbers it."""
    from ..corpus import open_corpus
    from .digest import epoch_batches

    if epoch < 0 or index < 0:
        raise InvalidConfig(f"--epoch {epoch} --batch {index}; accepted: both >= 0")
    if settings.epochs and epoch >= settings.epochs:
        raise InvalidConfig(f"--epoch {epoch}; the stream has epochs 0..{settings.epochs - 1}")
    source = open_corpus(
        settings.corpus_path(),
        allow_outside=settings.corpus_allow_outside,
        storage=settings.storage(),
    )
    batch = next(itertools.islice(epoch_batches(settings, source, epoch), index, None), None)
    if batch is None:
        total = sum(1 for _ in epoch_batches(settings, source, epoch))
        raise InvalidConfig(
            f"--batch {index}; epoch {epoch} of this corpus and these settings "
            f"has batches 0..{total - 1}"
        )
    return batch


def use_colour(choice: bool | None) -> bool:
    """Colour on a terminal unless told otherwise (``NO_COLOR`` turns the default off)."""
    if choice is not None:
        return choice
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("which batch (default: the worked example)")
    source.add_argument(
        "--fixture",
        default=None,
        help="worked-example input.json (default: fixtures/seed/input.json)",
    )
    source.add_argument(
        "--batch-file",
        default=None,
        help="a batch saved by `streampack consume --save-batch FILE.npz`",
    )
    source.add_argument(
        "--batch",
        type=int,
        default=0,
        help="with --corpus: the global batch index in its epoch (default: 0)",
    )
    source.add_argument(
        "--epoch", type=int, default=0, help="with --corpus: the epoch (default: 0)"
    )
    source.add_argument("--config", help="TOML settings file; its [producer] table is read")
    parser.add_argument(
        "--row",
        type=int,
        default=0,
        help="the row shown in detail, with its permission matrix (default: 0)",
    )
    parser.add_argument("--png", default=None, help="also draw the picture into this PNG file")
    parser.add_argument(
        "--width",
        type=int,
        default=100,
        help="terminal columns to fit the text into (default: 100)",
    )
    parser.add_argument(
        "--color",
        dest="color",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="ANSI colours (default: on a terminal only, and not with NO_COLOR)",
    )
    add_flags(
        parser,
        ProducerSettings,
        skip=("worker_endpoint", "consumer_endpoint", "metrics_port", "metrics_address"),
    )


def main(args: argparse.Namespace) -> int:
    settings = from_args(ProducerSettings, args)
    if args.png:
        check_output_path("--png", args.png)
    batch: Any
    if args.batch_file:
        batch, title = load_batch(args.batch_file), f"batch from {args.batch_file}"
    elif settings.corpus is not None:
        batch = corpus_batch(settings, args.epoch, args.batch)
        title = f"epoch {args.epoch} batch {args.batch} of {settings.corpus}"
    else:
        batch, title = worked_example(args.fixture), "the worked example"
    if not 0 <= args.row < batch.rows:
        raise InvalidConfig(f"--row {args.row}; this batch has rows 0..{batch.rows - 1}")
    sys.stdout.write(
        batch_text(
            batch, row=args.row, title=title, width=args.width, colour=use_colour(args.color)
        )
    )
    if args.png:
        batch_png(batch, args.png, row=args.row, title=title)
    return 0
