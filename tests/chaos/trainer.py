"""The chaos tier's trainer: one rank of a job, every batch it receives written down.

A real consumer process on the real client (``BatchStream``), which the harness kills,
pauses and restarts. It appends one line per event to ``--log`` (flushed at once, so a
``kill -9`` loses at most a half-written last line, which the harness ignores)::

    S {"epoch": e, "index": g}      the cursor this segment starts from
    B e g DIGEST WAIT               a batch: its place, its per-batch digest and the
                                    seconds ``next()`` waited for it
    C {"epoch": e, "index": g}      a checkpoint: ``state_dict()`` after the batch above
    END {"epoch": e, "index": g}    the stream ended; the final cursor
    M {...}                         then the client's counters (``BatchStream.metrics()``)
    E message                       the client raised: one line, then exit status 3

``DIGEST`` is ``StreamDigest`` over that one batch (place, filler flag, arrays and
occurrence records), the same function the harness applies to the in-process
``digest`` stream.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

import streampack.client as client
from streampack.client import BatchStream, StreamDigest
from streampack.errors import StreampackError


def batch_digest(batch: Any, epoch: int, index: int) -> str:
    """SHA-256 of one batch at its place in the stream (``StreamDigest`` of it alone)."""
    digest = StreamDigest()
    digest.update(batch, epoch, index)
    return digest.hexdigest()


def _write(log: TextIO, line: str) -> None:
    log.write(line + "\n")
    log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--state-in", help="cursor to resume from, as JSON text")
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per batch")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument(
        "--resend-after",
        type=float,
        default=client.RESEND_AFTER,
        help="seconds of silence before fetches are sent again",
    )
    args = parser.parse_args(argv)
    # Short silences are the point here: a restarted producer is asked again quickly.
    client.RESEND_AFTER = args.resend_after
    with (
        open(args.log, "a") as log,
        BatchStream(
            args.connect,
            rank=args.rank,
            world_size=args.world_size,
            prefetch=args.prefetch,
            timeout=args.timeout,
            max_message_bytes=1 << 20,
        ) as stream,
    ):
        try:
            if args.state_in:
                stream.load_state_dict(json.loads(args.state_in))
            _write(log, "S " + json.dumps(stream.state_dict()))
            received = 0
            while True:
                asked = time.monotonic()
                try:
                    batch = next(stream)
                except StopIteration:
                    break
                waited = time.monotonic() - asked
                epoch, index = stream.current
                _write(log, f"B {epoch} {index} {batch_digest(batch, epoch, index)} {waited:.3f}")
                received += 1
                if received % args.checkpoint_every == 0:
                    _write(log, "C " + json.dumps(stream.state_dict()))
                if args.delay:
                    time.sleep(args.delay)
        except StreampackError as exc:
            _write(log, f"E {type(exc).__name__}: {exc}".replace("\n", " "))
            return 3
        _write(log, "END " + json.dumps(stream.state_dict()))
        _write(log, "M " + json.dumps(stream.metrics()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
