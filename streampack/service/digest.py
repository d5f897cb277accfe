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

from .. import wire
from ..batch import PackedBatch
from ..client import ResumeError, StreamDigest, resume_cursor
from ..corpus import open_corpus
from ..errors import InvalidConfig
from ..loss import step_range
from ..packing import pack_examples
from ..settings import ProducerSettings, add_flags, check_number, check_rank, from_args
from ..windows import CutSpec, iter_windows
from .delivery import rank_share


def epoch_batches(settings: ProducerSettings, source: Any, epoch: int) -> Iterator[PackedBatch]:
    """The global batch sequence of one epoch, in order."""
    binding = source.binding.to_binding()
    config = settings.pack_config()
    for window in iter_windows(source, epoch, CutSpec.from_settings(settings)):
        if len(window.start) == 0:
            continue
        yield from pack_examples(wire.window_examples(window.arrays()), binding, config).batches


def rank_stream(
    settings: ProducerSettings,
    rank: int,
    world_size: int,
    start: tuple[int, int, int] | None = None,
) -> Iterator[tuple[int, int, PackedBatch]]:
    """(epoch, global index, batch) of everything rank ``rank`` receives, in order; from
    ``start`` = (epoch, base, index), a resumed cursor (``client.resume_cursor``), when
    given: that epoch's share counts from ``base`` and the rank continues at ``index``.
    Each batch carries its step's targets (``streampack.loss``), as the producer sends."""
    source = open_corpus(
        settings.corpus_path(),
        allow_outside=settings.corpus_allow_outside,
        storage=settings.storage(),
    )
    binding = source.binding.to_binding()
    epoch, first_base, first_index = start if start is not None else (0, 0, rank)
    first_epoch = epoch
    steps = settings.accumulation  # micro-batches per rank in one optimizer step
    while settings.epochs == 0 or epoch < settings.epochs:
        base, begin = (first_base, first_index) if epoch == first_epoch else (0, rank)
        held: collections.deque[tuple[int, PackedBatch]] = collections.deque()
        counts: list[int] = []  # loss-eligible targets of every global batch so far

        total = 0
        for index, batch in enumerate(epoch_batches(settings, source, epoch)):
            total = index + 1
            counts.append(int(batch.loss_mask.sum()))
            if index >= begin and (index - base) % world_size == rank:
                held.append((index, batch))
            # A held batch is certainly inside the rank's share once W more exist, and
            # its step's targets are known once the whole step is.
            while (
                held
                and (settings.tail == "fill" or held[0][0] + world_size <= total)
                and step_range(held[0][0], world_size, steps, base)[1] <= total
            ):
                g, b = held.popleft()
                yield epoch, g, _with_step(b, g, counts, world_size, steps, base, None)
        limit = base + rank_share(max(0, total - base), world_size, settings.tail) * world_size
        end = min(total, limit)  # batches past it are fillers or left out: they count 0
        for g, b in held:
            if g < limit:
                yield epoch, g, _with_step(b, g, counts, world_size, steps, base, end)
        for g in range(begin, limit, world_size):
            if g >= total:
                yield (
                    epoch,
                    g,
                    _with_step(
                        PackedBatch.filler_like(
                            binding, settings.max_rows_per_batch, settings.capacity, settings.policy
                        ),
                        g,
                        counts,
                        world_size,
                        steps,
                        base,
                        end,
                    ),
                )
        if total == 0:
            return  # no documents: every epoch is empty, so an unbounded stream ends
        epoch += 1


def _with_step(
    batch: PackedBatch,
    g: int,
    counts: list[int],
    world_size: int,
    accumulation: int,
    base: int,
    end: int | None,
) -> PackedBatch:
    """``batch`` (global batch ``g``) with the targets of its step: the counts of the
    step's batches, those at or past ``end`` (fillers, a drop tail's leftovers) 0."""
    first, stop = step_range(g, world_size, accumulation, base)
    step = sum(counts[first : stop if end is None else min(stop, end)])
    return dataclasses.replace(batch, step_targets=step)


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
