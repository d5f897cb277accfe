"""A producer's ``Coordinator`` driven without sockets: simulated workers and consumers.

Every message still goes through ``wire.encode`` and ``wire.decode``, so what a test
sends and receives is exactly what would cross a socket; only the sockets and the
clock are replaced (``Harness.now`` advances when a test says so).
"""

from __future__ import annotations

from typing import Any

from _service import FIXTURE, SMALL

from streampack import wire
from streampack.config import PackConfig
from streampack.corpus import open_corpus
from streampack.service.coordinator import Coordinator
from streampack.service.plan_check import ranges_plan
from streampack.settings import ProducerSettings


class Harness:
    """One coordinator, the messages it sent, and helpers that play its peers."""

    def __init__(self, corpus: Any = FIXTURE, **settings: Any) -> None:
        merged = {"corpus": str(corpus), **SMALL, **settings}
        self.settings = ProducerSettings(**merged)
        self.now = 0.0
        self.sent: dict[bytes, list[wire.Message]] = {}
        self.unreachable: set[bytes] = set()
        self.log: list[str] = []
        self.held: dict[bytes, dict[tuple[int, int], tuple[int, int, str]]] = {}
        self.coordinator = Coordinator(
            self.settings,
            open_corpus(self.settings.corpus),
            send_worker=self._deliver,
            send_consumer=self._deliver,
            log=self.log.append,
        )

    def _deliver(
        self, identity: bytes, kind: str, fields: dict[str, Any], arrays: dict[str, Any] | None
    ) -> bool:
        if identity in self.unreachable:
            return False
        frames = [bytes(frame) for frame in wire.encode(kind, fields, arrays)]
        self.sent.setdefault(identity, []).append(wire.decode(frames))
        return True

    @property
    def counters(self) -> dict[str, Any]:
        return self.coordinator.stats()

    # -- peers ---------------------------------------------------------------------

    def from_worker(
        self,
        identity: bytes,
        kind: str,
        fields: dict[str, Any],
        arrays: dict[str, Any] | None = None,
    ) -> None:
        self.coordinator.on_worker(identity, wire.encode(kind, fields, arrays), self.now)

    def from_consumer(self, identity: bytes, kind: str, fields: dict[str, Any]) -> None:
        self.coordinator.on_consumer(identity, wire.encode(kind, fields), self.now)

    def fetch(
        self,
        identity: bytes,
        rank: int,
        world_size: int,
        epoch: int,
        index: int,
        count: int = 1,
        base: int = 0,
    ) -> None:
        self.from_consumer(
            identity,
            "fetch",
            {
                "rank": rank,
                "world_size": world_size,
                "epoch": epoch,
                "index": index,
                "count": count,
                "base": base,
            },
        )

    def join(self, identity: bytes, credit: int = 2) -> None:
        self.from_worker(identity, "ready", {"credit": credit, "needs_tokens": False})

    def step(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.coordinator.tick(self.now)
        self.coordinator.pump(self.now)

    def take(self, identity: bytes, kind: str | None = None) -> list[wire.Message]:
        """The messages sent to ``identity`` since the last take (of ``kind`` only)."""
        messages = self.sent.get(identity, [])
        taken = [m for m in messages if kind is None or m.kind == kind]
        self.sent[identity] = [m for m in messages if m not in taken]
        return taken

    @staticmethod
    def honest_plan(window: wire.Message) -> dict[str, Any]:
        """What a correct worker answers: the plan of ``ranges_plan``."""
        occurrences, sizes = ranges_plan(
            window.arrays, PackConfig.from_wire(window.fields["config"])
        )
        return {"occurrences": occurrences, "batch_sizes": sizes}

    @staticmethod
    def packed_fields(window: wire.Message, **overrides: Any) -> dict[str, Any]:
        return {
            "epoch": window.fields["epoch"],
            "window": window.fields["window"],
            "capacity": window.fields["config"]["capacity"],
            "seconds": 0.001,
            "audited": 0,
            "audit_failures": 0,
            "audit_error": "",
        } | overrides

    def work(self, identity: bytes, limit: int | None = None) -> int:
        """Let worker ``identity`` answer its windows honestly (each answer followed by
        ``ready`` for one more, as the real worker does). Returns windows answered."""
        answered = 0
        while limit is None or answered < limit:
            windows = self.take(identity, "window")
            if not windows:
                self.step()
                windows = self.take(identity, "window")
                if not windows:
                    return answered
            for window in windows:
                self.from_worker(
                    identity, "packed", self.packed_fields(window), self.honest_plan(window)
                )
                self.from_worker(identity, "ready", {"credit": 1, "needs_tokens": False})
                answered += 1
            self.step()
        return answered

    def batches(self, identity: bytes) -> list[tuple[int, int, str]]:
        """(epoch, index, digest) of each batch sent to ``identity`` since the last call."""
        out = []
        for message in self.take(identity, "batch"):
            batch = wire.batch_from_message(message)
            out.append((message.fields["epoch"], message.fields["index"], batch.expand().digest()))
        return out

    def drain(
        self,
        identity: bytes,
        rank: int,
        world_size: int,
        *,
        epoch: int = 0,
        index: int | None = None,
        workers: tuple[bytes, ...] = (b"w1",),
        prefetch: int = 4,
        until: int | None = None,
    ) -> list[tuple[int, int, str]]:
        """A consumer as the client behaves: ``prefetch`` outstanding fetches, in order,
        moving to the next epoch at ``epoch_end``, until ``stream_end`` (or ``until``
        batches). Workers pack whenever the consumer waits."""
        index = rank if index is None else index
        got: list[tuple[int, int, str]] = []
        asked: list[tuple[int, int]] = []
        # Batches answered and not yet taken are kept across calls, as a client keeps
        # them: it never asks the same identity again for a batch it was answered.
        held = self.held.setdefault(identity, {})
        limit: int | None = None  # this epoch's end for this rank, once told
        idle = 0
        while until is None or len(got) < until:
            if limit is not None and index >= limit:
                epoch, index, asked, limit = epoch + 1, rank, [], None
                held.clear()
            while len(asked) < prefetch:
                nxt = asked[-1][1] + world_size if asked else index
                if limit is not None and nxt >= limit:
                    break
                asked.append((epoch, nxt))
                self.fetch(identity, rank, world_size, epoch, nxt)
            for item in self.batches(identity):
                held[(item[0], item[1])] = item
            for message in self.take(identity):
                if message.kind == "stream_end":
                    return got
                assert message.kind == "epoch_end", message
                if message.fields["epoch"] == epoch:
                    limit = message.fields["per_rank"] * world_size
                    asked = [k for k in asked if k[1] < limit]
            progressed = False
            while (epoch, index) in held:
                got.append(held.pop((epoch, index)))
                asked.remove((epoch, index))
                index += world_size
                progressed = True
                if until is not None and len(got) >= until:
                    return got
            if not progressed and not (limit is not None and index >= limit):
                answered = sum(self.work(w, limit=1) for w in workers)
                self.step()
                idle = 0 if answered else idle + 1
                assert idle < 50, f"stalled at {(epoch, index)}: {self.counters}"
        return got
