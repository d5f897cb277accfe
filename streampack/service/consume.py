"""``streampack consume``: an example trainer loop on ``streampack.client.BatchStream``.

It drains one rank's stream as fast as it can (or ``--delay`` seconds per batch, to
play a slow trainer), shows a progress line on stderr when that is a terminal, and
prints one JSON line on stdout at the end: batches, fillers, tokens, seconds, tokens/s,
CPU seconds, the running ``StreamDigest`` of everything received and the resume cursor.
``--state-in`` resumes from a cursor saved by ``--state-out``; ``--record`` writes the
identity of every occurrence received (source_id, range_start, range_stop, source: its
document and range in the corpus, ``OCCURRENCE_DTYPE``) as a ``.npy`` file, which the
tests use to check that every selected pair arrived exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..client import BatchStream, StreamDigest
from ..errors import InternalError, InvalidConfig, StreampackError
from ..progress import Progress
from ..settings import (
    ConsumerSettings,
    add_flags,
    check_number,
    check_output_path,
    check_rank,
    from_args,
)


def occurrence_ids(batch: Any) -> np.ndarray:
    """[n, 4] int64: (source_id, range_start, range_stop, source) of each occurrence:
    which document of which source, and which of its tokens."""
    occ = batch.occurrences
    return (
        np.stack([occ["source_id"], occ["range_start"], occ["range_stop"], occ["source"]], axis=1)
        .astype(np.int64)
        .reshape(-1, 4)
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file; its [consumer] table is read")
    parser.add_argument("--rank", type=int, default=0, help="this rank (default: 0)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (default: 1)")
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="stop after this many batches (default: the whole stream)",
    )
    parser.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds to sleep per batch, to act as a slow trainer (default: 0)",
    )
    parser.add_argument("--state-in", help="resume from the cursor in this JSON file")
    parser.add_argument("--state-out", help="write the final cursor to this JSON file")
    parser.add_argument("--record", help="write received occurrence identities to this .npy")
    parser.add_argument(
        "--save-batch",
        metavar="FILE.npz",
        help="save the last batch received (with --max-batches N, this "
        "rank's N-th) for `streampack inspect --batch-file`",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress line (there is none unless stderr is a terminal)",
    )
    parser.add_argument(
        "--no-digest",
        dest="digest",
        action="store_false",
        help="skip hashing (measure transport alone); digest is then empty",
    )
    add_flags(parser, ConsumerSettings)


def read_cursor(path: str) -> Any:
    """The JSON cursor ``--state-out`` wrote to ``path`` (checked by ``load_state_dict``)."""
    accepted = 'expected a JSON cursor as --state-out writes, e.g. {"epoch": 0, "index": 0}'
    try:
        with open(path, "rb") as handle:
            return json.load(handle)
    except OSError as exc:
        raise InvalidConfig(f"--state-in {path!r}: {exc.strerror}; {accepted}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise InvalidConfig(f"--state-in {path!r} is not JSON ({exc}); {accepted}") from None


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: the old cursor survives a crash."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


def _checked_before_start(args: argparse.Namespace) -> Any:
    """Check everything the run will need at its end before it drains the stream (the
    flags, and that each output file can be written); the cursor ``--state-in`` holds,
    or None."""
    check_rank(args.rank, args.world_size)
    check_number("--delay", args.delay, minimum=0)
    if args.max_batches is not None:
        check_number("--max-batches", args.max_batches, minimum=0, integer=True)
    cursor = read_cursor(args.state_in) if args.state_in else None
    for flag, path in (
        ("--state-out", args.state_out),
        ("--record", args.record),
        ("--save-batch", args.save_batch),
    ):
        if path:
            check_output_path(flag, path)
    return cursor


def _receive(
    stream: BatchStream,
    args: argparse.Namespace,
    digest: StreamDigest,
    records: list[np.ndarray],
    started: float,
    stopping: Callable[[], bool],
) -> Any:
    """Take batches until the stream ends, ``--max-batches`` or SIGTERM (``stopping``),
    into ``digest`` (and ``records`` with ``--record``), with a progress line; the last
    batch when ``--save-batch`` asks for it, else None."""
    last: Any = None
    progress = Progress(f"rank {args.rank}", total=args.max_batches, enabled=not args.quiet)
    progress.start()
    while not stopping():
        if args.max_batches is not None and digest.batches >= args.max_batches:
            break
        try:
            batch = stream.next_batch()
        except StopIteration:
            break
        if stream.current is None:
            raise InternalError("BatchStream.current unset after next_batch returned")
        epoch, index = stream.current
        if args.digest:
            digest.update(batch, epoch, index)
        else:
            digest.batches += 1
            digest.fillers += int(batch.filler)
            digest.tokens += int(batch.valid_lengths.sum())
        if args.record:
            records.append(occurrence_ids(batch))
        if args.save_batch:
            last = batch
        if args.delay:
            time.sleep(args.delay)
        if progress.enabled:
            blocked = stream.seconds_blocked / max(time.perf_counter() - started, 1e-9)
            progress.update(
                digest.batches,
                digest.tokens,
                note=f"epoch {epoch} batch {index}, waiting for data {blocked:.0%} of the time",
            )
    progress.close()
    return last


def _write_outputs(
    args: argparse.Namespace, state: dict[str, int], last: Any, records: list[np.ndarray]
) -> None:
    """The files the flags ask for: the cursor, the last batch, the occurrence record."""
    if args.state_out:
        write_atomically(args.state_out, json.dumps(state))
    if args.save_batch and last is not None:
        from ..render import save_batch

        save_batch(last, args.save_batch)
    if args.record:
        np.save(args.record, np.concatenate(records) if records else np.zeros((0, 4), np.int64))


def main(args: argparse.Namespace) -> int:
    settings = from_args(ConsumerSettings, args)
    cursor = _checked_before_start(args)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    digest = StreamDigest()
    records: list[np.ndarray] = []
    with BatchStream.from_settings(settings, rank=args.rank, world_size=args.world_size) as stream:
        if cursor is not None:
            try:
                stream.load_state_dict(cursor)
            except StreampackError as exc:
                raise InvalidConfig(f"--state-in {args.state_in!r}: {exc}") from None
        # The clock starts once the stream is built (it loads its compiled expand kernel,
        # a one-off cost per process), at the first request: the rate is the stream's.
        started = time.perf_counter()
        cpu_started = time.process_time()
        last = _receive(stream, args, digest, records, started, lambda: stopping)
        state = stream.state_dict()
        verify_seconds = stream.metrics()["verify_seconds"]
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    _write_outputs(args, state, last, records)
    print(
        json.dumps(
            digest.summary(args.rank, args.world_size, state)
            | {
                "seconds": round(seconds, 3),
                "tokens_per_second": round(digest.tokens / seconds, 1) if seconds else 0.0,
                "cpu_seconds": round(cpu_seconds, 3),
                "verify_seconds": round(verify_seconds, 3),
                "digest": digest.hexdigest() if args.digest else "",
            }
        ),
        flush=True,
    )
    return 0
