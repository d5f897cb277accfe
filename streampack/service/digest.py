"""``streampack digest``: what one rank would receive, computed in this process.

No sockets, no workers: the same windows (``windows.iter_windows``), packed with
``pack_examples`` (the service sends ``pack_compact`` batches and expands them in the
consumer, so agreeing digests also check that path), the same global numbering and
epoch-tail rule as the producer. The printed JSON line has the fields of
``streampack consume``'s final line, so a deployment can be checked end to end by
comparing the two ``digest`` values.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from ..batch import PackedBatch
from ..client import ResumeError, StreamDigest, resume_cursor
from ..corpus import open_corpus
from ..errors import InvalidConfig
from ..packing import pack_examples
from ..settings import ProducerSettings, add_flags, check_number, check_rank, from_args
from ..windows import CutSpec, iter_windows
from .delivery import rank_share
from .worker import window_examples


def epoch_batches(settings: ProducerSettings, source: Any, epoch: int) -> Iterator[PackedBatch]:
    """The global batch sequence of one epoch, in order."""
    binding = source.binding.to_binding()
    config = settings.pack_config()
    for window in iter_windows(source, epoch, CutSpec.from_settings(settings)):
        if len(window.start) == 0:
            continue
        for batch in pack_examples(window_examples(window.arrays()), binding, config).batches:
            # Each occurrence's source in a mixture, as the producer attaches it.
            yield dataclasses.replace(
                batch, sources=window.source_index[batch.occurrences["ordinal"]]
            )


def rank_stream(
    settings: ProducerSettings,
    rank: int,
    world_size: int,
    start: tuple[int, int, int] | None = None,
) -> Iterator[tuple[int, int, PackedBatch]]:
    """(epoch, global index, batch) of everything rank ``rank`` receives, in order; from
    ``start`` = (epoch, base, index), a resumed cursor (``client.resume_cursor``), when
    given: that epoch's share counts from ``base`` and the rank continues at ``index``."""
    source = open_corpus(settings.corpus_path(), allow_outside=settings.corpus_allow_outside)
    binding = source.binding.to_binding()
    epoch, first_base, first_index = start if start is not None else (0, 0, rank)
    first_epoch = epoch
    while settings.epochs == 0 or epoch < settings.epochs:
        base, begin = (first_base, first_index) if epoch == first_epoch else (0, rank)
        held: collections.deque[tuple[int, PackedBatch]] = collections.deque()
        total = 0
        for index, batch in enumerate(epoch_batches(settings, source, epoch)):
            total = index + 1
            if index >= begin and (index - base) % world_size == rank:
                held.append((index, batch))
            # A held batch is certainly inside the rank's share once W more exist.
            while held and (settings.tail == "fill" or held[0][0] + world_size <= total):
                g, b = held.popleft()
                yield epoch, g, b
        limit = base + rank_share(max(0, total - base), world_size, settings.tail) * world_size
        for g, b in held:
            if g < limit:
                yield epoch, g, b
        for g in range(begin, limit, world_size):
            if g >= total:
                yield (
                    epoch,
                    g,
                    PackedBatch.filler_like(
                        binding, settings.max_rows_per_batch, settings.capacity, settings.policy
                    ),
                )
        if total == 0:
            return  # no documents: every epoch is empty, so an unbounded stream ends
        epoch += 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file; its [producer] table is read")
    parser.add_argument("--rank", type=int, default=0, help="rank (default: 0)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (default: 1)")
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="stop after this many batches (required when epochs = 0)",
    )
    parser.add_argument(
        "--state-in",
        help="start from the cursor(s) in this JSON file, as "
        "consume --state-in does (also another world size's)",
    )
    add_flags(parser, ProducerSettings, skip=("worker_endpoint", "consumer_endpoint"))


def main(args: argparse.Namespace) -> int:
    settings = from_args(ProducerSettings, args)
    check_rank(args.rank, args.world_size)
    if args.max_batches is not None:
        check_number("--max-batches", args.max_batches, minimum=0, integer=True)
    if settings.epochs == 0 and args.max_batches is None:
        raise InvalidConfig("epochs = 0 is an unbounded stream; give --max-batches N")
    start = None
    if args.state_in:
        try:
            with open(args.state_in) as handle:
                saved = json.load(handle)
        except (OSError, ValueError) as exc:
            raise InvalidConfig(
                f"--state-in {args.state_in}: cannot read a JSON cursor: {exc}"
            ) from None
        try:
            start = resume_cursor(saved, args.rank, args.world_size)
        except ResumeError as exc:
            raise InvalidConfig(f"--state-in {args.state_in}: {exc}") from None
    digest = StreamDigest()
    where = {"rank": args.rank, "world_size": args.world_size}
    state = {"epoch": settings.epochs, "index": args.rank, "base": 0} | where
    for epoch, index, batch in rank_stream(settings, args.rank, args.world_size, start):
        if args.max_batches is not None and digest.batches >= args.max_batches:
            base = start[1] if start is not None and epoch == start[0] else 0
            state = {"epoch": epoch, "index": index, "base": base} | where
            break
        digest.update(batch, epoch, index)
    print(json.dumps(digest.summary(args.rank, args.world_size, state)), flush=True)
    return 0
