"""Hostile and careless peers of the producer, written with raw zmq for the chaos tier.

Each runs in a thread of the harness process for a bounded time and then closes its
socket: a stranger's fetches, garbage on both sockets, and fake workers that register
and then misbehave. They are the peers, not the thing under test; the producer must
survive every one of them with its stream unchanged.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from streampack import wire

MAX_LIFE = 60.0  # no peer outlives this, whatever the harness does
SLOW_SECONDS = 5.0  # how late the slow worker answers


class Peer(threading.Thread):
    """A thread owning one DEALER socket; ``close()`` ends it within a poll interval."""

    def __init__(self, endpoint: str, body: Callable[[Peer], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.endpoint = endpoint
        self.body = body
        self.stopping = threading.Event()
        self.notes: list[str] = []  # what it saw, for the failure report
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.ROUTING_ID, f"{name}-{uuid.uuid4().hex[:8]}".encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.deadline = time.monotonic() + MAX_LIFE

    def run(self) -> None:
        try:
            self.socket.connect(self.endpoint)
            self.body(self)
        except zmq.ZMQError as exc:  # the socket closed under it by close()
            self.notes.append(f"zmq: {exc}")
        finally:
            self.socket.close(linger=0)
            self.context.term()

    def alive(self) -> bool:
        return not self.stopping.is_set() and time.monotonic() < self.deadline

    def send(self, frames: list[Any]) -> None:
        self.socket.send_multipart([bytes(f) if not isinstance(f, bytes) else f for f in frames])

    def receive(self, timeout: float) -> wire.Message | None:
        """The next well-formed message within ``timeout`` seconds (or while alive)."""
        end = min(time.monotonic() + timeout, self.deadline)
        while self.alive() and time.monotonic() < end:
            if self.socket.poll(50):
                frames = self.socket.recv_multipart()
                try:
                    return wire.decode(frames)
                except wire.ProtocolError as exc:
                    self.notes.append(f"undecodable reply: {exc}")
        return None

    def close(self) -> None:
        self.stopping.set()


# ---------------------------------------------------------------------------- consumers


def stray_fetches(
    rng: random.Random, world_size: int, epochs: int, per_rank: int, wait: float
) -> Callable[[Peer], None]:
    """A stranger (or an old consumer) asks for batches anywhere in the stream: behind,
    ahead, past the end; some twice. With ``wait`` it reads answers for that long,
    otherwise it leaves at once with its fetches still pending at the producer."""
    fetches = []
    for _ in range(rng.randint(1, 4)):
        rank = rng.randrange(world_size)
        epoch = rng.randrange(epochs + 1)
        index = rank + world_size * rng.randrange(per_rank + 2)
        fetches.append(
            {
                "rank": rank,
                "world_size": world_size,
                "epoch": epoch,
                "index": index,
                "count": rng.randint(1, 3),
                "base": 0,
            }
        )
    repeats = rng.choice([1, 1, 3])

    def body(peer: Peer) -> None:
        for _ in range(repeats):
            for fields in fetches:
                peer.send(wire.encode("fetch", fields))
        peer.notes.append(f"fetched {fetches} x{repeats}")
        end = time.monotonic() + wait
        while peer.alive() and time.monotonic() < end:
            peer.receive(end - time.monotonic())

    return body


def garbage(rng: random.Random, max_message_bytes: int) -> Callable[[Peer], None]:
    """Malformed messages of every sort, sent in a random order, answers read briefly."""
    valid = wire.encode(
        "fetch", {"rank": 0, "world_size": 1, "epoch": 0, "index": 0, "count": 1, "base": 0}
    )
    header = bytes(valid[0])
    # msgpack arrays of one element, nested 100,000 deep around a nil (packb refuses to
    # write it, so it is written by hand): deeper than any recursive parser's stack.
    nested = b"\x91" * 100_000 + b"\xc0"
    messages: list[list[bytes]] = [
        [b""],
        [b"\xff\x00garbage"],
        [header[: len(header) // 2]],  # truncated
        [
            msgpack.packb(
                {
                    "v": 99,
                    "k": "fetch",
                    "rank": 0,
                    "world_size": 1,
                    "epoch": 0,
                    "index": 0,
                    "count": 1,
                    "f": [],
                }
            )
        ],  # wrong version
        [msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": "teleport", "f": []})],
        [
            msgpack.packb(
                {
                    "v": wire.PROTOCOL_VERSION,
                    "k": "fetch",
                    "rank": "0",
                    "world_size": 1,
                    "epoch": 0,
                    "index": 0,
                    "count": 1,
                    "f": [],
                }
            )
        ],
        [
            msgpack.packb(
                {
                    "v": wire.PROTOCOL_VERSION,
                    "k": "packed",
                    "epoch": 0,
                    "window": 0,
                    "f": [["occurrences", "occurrence", [5]]],
                }
            )
        ],  # frames missing
        [header, b"an unannounced frame"],
        [msgpack.packb([1, 2, 3])],
        [nested],
        [b"\x00" * (2 * max_message_bytes)],  # over the size limit
        [rng.randbytes(rng.randint(1, 300)) for _ in range(rng.randint(1, 3))],
    ]
    rng.shuffle(messages)

    def body(peer: Peer) -> None:
        for frames in messages:
            peer.send(frames)
        end = time.monotonic() + 1.0
        while peer.alive() and time.monotonic() < end:
            peer.receive(end - time.monotonic())

    return body


def idle_consumer(
    rank: int, world_size: int, epoch: int, index: int, hold: float
) -> Callable[[Peer], None]:
    """A consumer of rank ``rank`` (beside the real one) that fetches the rank's next
    batches from ``(epoch, index)`` on and reads the producer's answers, routes on the
    data plane, for ``hold`` seconds, but never fetches a routed batch from its worker:
    the workers keep those batches (within their store's budget) while the real rank
    takes them."""

    def body(peer: Peer) -> None:
        fields = {"rank": rank, "world_size": world_size, "epoch": epoch, "base": 0}
        peer.send(wire.encode("fetch", fields | {"index": index + world_size, "count": 8}))
        end = time.monotonic() + hold
        kinds: dict[str, int] = {}
        while peer.alive() and time.monotonic() < end:
            message = peer.receive(end - time.monotonic())
            if message is not None:
                kinds[message.kind] = kinds.get(message.kind, 0) + 1
        peer.notes.append(f"answers, never fetched from a worker: {kinds}")

    return body


def wrong_world_fetch(world_size: int) -> Callable[[Peer], None]:
    """A fetch from a job of another size: it must not lock the real job out."""

    def body(peer: Peer) -> None:
        other = world_size + 1
        peer.send(
            wire.encode(
                "fetch",
                {
                    "rank": other - 1,
                    "world_size": other,
                    "epoch": 0,
                    "index": other - 1,
                    "count": 1,
                    "base": 0,
                },
            )
        )
        peer.receive(1.0)

    return body


# ------------------------------------------------------------------------------ workers


def _plan(window: wire.Message) -> tuple[np.ndarray, np.ndarray]:
    """The window's true plan, as an honest worker computes it."""
    from streampack.config import PackConfig
    from streampack.service.plan_check import ranges_plan

    return ranges_plan(window.arrays, PackConfig.from_wire(window.fields["config"]))


def _packed(
    window: wire.Message,
    occurrences: np.ndarray,
    sizes: np.ndarray,
    window_index: int | None = None,
    **overrides: Any,
) -> list[Any]:
    fields = {
        "epoch": window.fields["epoch"],
        "window": window.fields["window"] if window_index is None else window_index,
        "capacity": window.fields["config"]["capacity"],
        "seconds": 0.0,
        "audited": 0,
        "audit_failures": 0,
        "audit_error": "",
    } | overrides
    return wire.encode("packed", fields, {"occurrences": occurrences, "batch_sizes": sizes})


def fake_worker(rng: random.Random, behaviour: str, life: float) -> Callable[[Peer], None]:
    """A worker that registers, heartbeats, takes one window and then misbehaves:

    - ``shifted_plan``: a plan whose occurrence ordinals are off by one (refusable);
    - ``other_window``: the true plan of its window, labelled as the next window;
    - ``unfit_plan``: every document in a batch of its own: well-formed, each document
      once, in order, with its range, but not next-fit: it must be refused;
    - ``foreign_failed``: ``failed`` for windows it was never given (none may be lost);
    - ``forged_counters``: ``packed`` with counters out of range, NaN seconds and a
      newline in its text (the producer must neither crash nor forge a log line);
    - ``hung``: never answers, heartbeats for its whole life (a hung process whose
      heartbeat thread lives on: a backup copy of its window must move the stream on);
    - ``slow``: answers every window it takes correctly, but ``SLOW_SECONDS`` late, for
      its whole life (its copies win; its own answers are duplicates, never errors);
    - ``vanish``: takes a window and disappears at once; six of them in a row
      (``worker_wave``) must not get a window quarantined.
    """

    def heartbeat(peer: Peer) -> None:
        peer.send(wire.encode("heartbeat", {"free": 1, "needs_tokens": False}))

    def body(peer: Peer) -> None:
        end = time.monotonic() + life
        if behaviour == "foreign_failed":
            heartbeat(peer)
            for window in range(rng.randint(1, 4)):
                peer.send(
                    wire.encode(
                        "failed", {"epoch": 0, "window": window, "error": "forged by a stranger"}
                    )
                )
            return
        if behaviour == "forged_counters":
            from streampack.batch import OCCURRENCE_DTYPE

            empty = np.zeros(0, OCCURRENCE_DTYPE)
            for _ in range(2):
                peer.send(
                    wire.encode(
                        "packed",
                        {
                            "epoch": 0,
                            "window": 10**6,
                            "capacity": 1,
                            "seconds": float("nan"),
                            "audited": 2**64 - 1,
                            "audit_failures": -5,
                            "audit_error": "forged\nproducer: forged log line",
                        },
                        {"occurrences": empty, "batch_sizes": np.zeros(0, np.int64)},
                    )
                )
            return
        peer.send(wire.encode("ready", {"credit": 1, "needs_tokens": False}))
        next_beat = 0.0
        late: list[tuple[float, wire.Message]] = []  # the slow worker's answers, when due
        while peer.alive() and time.monotonic() < end:
            if time.monotonic() >= next_beat:
                heartbeat(peer)
                next_beat = time.monotonic() + 0.2
            while late and late[0][0] <= time.monotonic():
                window = late.pop(0)[1]
                peer.send(_packed(window, *_plan(window)))
                peer.send(wire.encode("ready", {"credit": 1, "needs_tokens": False}))
            message = peer.receive(0.1)
            if message is None or message.kind != "window":
                continue
            key = (message.fields["epoch"], message.fields["window"])
            peer.notes.append(f"took window {key}")
            if behaviour == "hung":
                continue
            if behaviour == "slow":
                late.append((time.monotonic() + SLOW_SECONDS, message))
                continue
            if behaviour == "vanish":
                return
            occurrences, sizes = _plan(message)
            if behaviour == "shifted_plan":
                occurrences = occurrences.copy()
                occurrences["ordinal"] += 1
                peer.send(_packed(message, occurrences, sizes))
            elif behaviour == "other_window":
                peer.send(_packed(message, occurrences, sizes, message.fields["window"] + 1))
            elif behaviour == "unfit_plan":
                occurrences = occurrences.copy()
                occurrences["stop"] -= occurrences["start"]
                occurrences["start"] = 0
                occurrences["row"] = 0
                peer.send(_packed(message, occurrences, np.ones(len(occurrences), np.int64)))
            reply = peer.receive(1.0)
            peer.notes.append(f"answer: {reply.kind if reply else None}")
            return  # one window answered wrongly, then it leaves without a word

    return body


# ------------------------------------------------------------------- serving workers

#: How a hostile serving worker alters the batches it serves (its plans are honest, so
#: the producer accepts them and routes consumers to it): ``hang`` takes a consumer's
#: ``get`` and never answers; the others answer at once with a wrong batch.
SERVING_MODES = ("token", "drop", "repeat", "reorder", "other_batch", "hang")


def _spans(batch: Any) -> list[tuple[int, int]]:
    """(first, end) of each occurrence's tokens in ``batch.tokens``."""
    lengths = (batch.occurrences["stop"] - batch.occurrences["start"] + 1).astype(np.int64)
    ends = np.cumsum(lengths)
    return [(int(end - n), int(end)) for n, end in zip(lengths, ends, strict=True)]


def wrong_batch(batch: Any, mode: str, other: Any) -> Any:
    """``batch`` altered as ``mode`` says: one token changed, its last document dropped,
    its first repeated, its first two swapped, or ``other`` (the batch served before,
    another window's or another place's) in its place."""
    import dataclasses

    if mode == "other_batch" and other is not None:
        return other
    spans = _spans(batch)
    if mode in ("drop", "repeat", "reorder") and len(spans) >= 2:
        if mode == "drop":
            order = list(range(len(spans) - 1))
        elif mode == "repeat":
            order = [*range(len(spans)), 0]
        else:
            order = [1, 0, *range(2, len(spans))]

        def pick(array: np.ndarray) -> np.ndarray:
            return np.concatenate([array[spans[i][0] : spans[i][1]] for i in order])

        return dataclasses.replace(
            batch,
            tokens=pick(batch.tokens),
            occurrences=batch.occurrences[order],
            mask=None if batch.mask is None else pick(batch.mask),
        )
    tokens = batch.tokens.copy()  # "token", and the shapes above on a one-document batch
    if tokens.size:
        tokens[0] = (int(tokens[0]) + 1) % batch.binding.vocab_size
    return dataclasses.replace(batch, tokens=tokens)


def serve(mode: str, status: str, argv: list[str]) -> int:
    """Run ``streampack worker`` in this process with its store watched: after every
    change it writes ``ENTRIES NBYTES HIGHEST BUDGET WRONG`` to the file ``status`` (the
    harness reads which workers hold batches, and checks the store never exceeded its
    budget). ``mode`` ``honest`` serves as the real worker does; the others are
    ``SERVING_MODES``."""
    from pathlib import Path

    from streampack import cli
    from streampack.service import worker
    from streampack.service.store import BatchStore

    class WatchedStore(BatchStore):
        highest = 0
        wrong = 0  # batches served altered
        last: Any = None

        def _report(self) -> None:
            self.highest = max(self.highest, self.nbytes)
            line = f"{len(self)} {self.nbytes} {self.highest} {self.budget_bytes} {self.wrong}"
            Path(status).write_text(line + "\n")

        def put(self, key: Any, batch: Any, now: float) -> None:
            super().put(key, batch, now)
            self._report()

        def take(self, key: Any, now: float) -> Any:
            batch = super().take(key, now)
            if batch is not None and mode != "honest":
                served, self.last = wrong_batch(batch, mode, self.last), batch
                self.wrong += 1
                batch = served
            self._report()
            return batch

    class Watched(worker.Worker):
        def __init__(self, settings: Any) -> None:
            super().__init__(settings)
            self.store = WatchedStore(settings.store_bytes, settings.store_seconds)

        def handle_get(self, serving: Any) -> None:
            if mode == "hang":
                serving.recv_multipart()  # taken, never answered
                return
            super().handle_get(serving)

    worker.Worker = Watched  # type: ignore[misc]
    return cli.main(["worker", *argv])


if __name__ == "__main__":
    import sys

    # python peers.py MODE STATUS-FILE WORKER-FLAGS...
    if sys.argv[1] not in ("honest", *SERVING_MODES):
        sys.exit(f"mode {sys.argv[1]!r}: expected honest or one of {', '.join(SERVING_MODES)}")
    sys.exit(serve(sys.argv[1], sys.argv[2], sys.argv[3:]))
