"""One chaos run: a real producer, pack workers and trainers under a seeded fault schedule.

``Plan.draw(seed)`` turns a seed into everything a run does: the stream's settings
(small budgets, short heartbeats, small prefetch, so the hard states come in seconds),
the data plane (half the seeds run ``data_plane = "workers"``: the workers serve the
batches, through ``peers.py``, which watches their stores), the number of workers and
ranks, and a schedule of faults, each firing when a given share of the stream has
been delivered. ``Run(plan, workdir).execute()`` starts the
processes (``python -m streampack.cli produce|worker`` and ``trainer.py``, which uses
the real client), fires the faults, and checks every batch as it arrives against the
service's oracle (docs: DESIGN.md §4): the in-process ``digest`` stream of that rank.

What is checked, batch by batch:

- a trainer's *segment* (one process, from the cursor it started from) receives exactly
  the oracle's batches from that cursor on, in order: the right batch at the right
  place, nothing repeated, nothing skipped (exactly once per resume segment);
- a trainer restarted from a checkpoint, also one behind what it had already received,
  receives exactly the rest, through to the end of the stream;
- no trainer ends in an error, the producer never dies of a peer, and the whole run
  finishes before its deadline (a hang is a failure, reported with what each rank had);
- the counters agree with what the ranks read: each client counts the batches its log
  shows; no client refuses more workers' batches than hostile workers altered (an
  honest worker's batch is never refused); without faults that add askers
  (``EXTRA_SERVES``) the producer's batches served equal the batches the ranks read;
  no serving worker's store ever holds more than ``store_bytes``;
- no trainer waits longer than ``WAIT_BOUND`` for one batch, whatever the faults: a
  hung worker (heartbeats, never answers) or a slow one (answers 5 s late) costs about
  ``backup_after`` (1 s), since the trainers' timeout (``TRAINER_TIMEOUT``) is shorter
  than ``window_timeout``. The slowest legitimate waits are a producer restart's and
  those while no healthy worker is left (the real one stopped or replaced, only the
  slow fake answering): 3 to 6 s in seeds 0-11 and 100-111 with those faults.

A failure raises ``ChaosFailure`` with the seed, the schedule as it ran, the symptom
and the command that replays the seed.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _service import FIXTURE, ROOT, env, flags, free_port, start
from peers import (
    SERVING_MODES,
    Peer,
    fake_worker,
    garbage,
    idle_consumer,
    stray_fetches,
    wrong_world_fetch,
)

TRAINER = Path(__file__).resolve().parent / "trainer.py"
PEERS = Path(__file__).resolve().parent / "peers.py"

#: Fault kinds drawn by every run: main survives each of them.
ENABLED = (
    "worker_kill",
    "worker_stop",
    "trainer_kill",
    "trainer_stop",
    "producer_restart",
    "stray_fetch",
    "garbage",
    "shifted_plan",
    "other_window",
    "hung_worker",
    "slow_worker",
    "wrong_world_fetch",
    "unfit_plan",
    "foreign_failed",
    "forged_counters",
    "worker_wave",
    "serving_kill",
    "serving_stop",
    "wrong_batch",
    "hung_get",
    "idle_consumer",
    "tail_drop",  # not a fault: a setting; without it every run uses tail = "fill"
)

#: Faults of the data plane (``data_plane = "workers"``), drawn only in the seeds that
#: run it: a worker killed or stopped while it holds batches consumers are routed to, a
#: serving worker that answers ``get`` with a wrong batch or never, and a consumer
#: that takes routes and never fetches them. The other kinds hit those seeds too.
DATA_PLANE_KINDS = ("serving_kill", "serving_stop", "wrong_batch", "hung_get", "idle_consumer")
#: Faults after which the producer counts batches no rank's log shows (a stranger's
#: fetches, a job of another size's, a killed trainer's prefetch, a restarted
#: producer's fresh counters).
EXTRA_SERVES = (
    "stray_fetch",
    "wrong_world_fetch",
    "idle_consumer",
    "trainer_kill",
    "producer_restart",
)

#: Fault kinds the service does not survive yet, each with what goes wrong: drawn only
#: with CHAOS_FAULTS=all (or by name). A kind moves to ENABLED once it is fixed and the
#: tier passes with it. Empty: the service survives every kind.
DISABLED: dict[str, str] = {}

#: Drawn only when named (or with CHAOS_FAULTS=all), since they lengthen every run
#: they hit. ``late_workers``, not a fault: in half the seeds the workers start
#: LATE_WORKERS seconds after the trainers, whose fetches are resent meanwhile; a
#: resend must cost nothing (batches served equal batches read).
OPT_IN = ("late_workers",)
LATE_WORKERS = 6.0

ALL_KINDS = ENABLED + OPT_IN + tuple(DISABLED)
PEER_KINDS = {
    "stray_fetch",
    "garbage",
    "shifted_plan",
    "other_window",
    "hung_worker",
    "slow_worker",
    "wrong_world_fetch",
    "unfit_plan",
    "foreign_failed",
    "forged_counters",
    "worker_wave",
}

MAX_MESSAGE_BYTES = 1 << 20
#: A trainer's timeout: shorter than window_timeout, so no trainer may wait on a hung
#: worker until its deadline.
TRAINER_TIMEOUT = 10.0
#: The longest any trainer may wait for one batch in a run (see module docstring).
WAIT_BOUND = 9.0


class ChaosFailure(AssertionError):
    """A run broke the oracle, hung, or a process died; the message says how to replay."""


def selected_kinds(spec: str | None) -> tuple[str, ...]:
    """The fault kinds a ``CHAOS_FAULTS`` value names ("" or None: the enabled ones)."""
    if not spec:
        return ENABLED
    if spec == "all":
        return ALL_KINDS
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise ValueError(
            f"CHAOS_FAULTS names unknown fault kinds {unknown}; "
            f"known: {', '.join(ALL_KINDS)} (or 'all')"
        )
    return kinds


@dataclasses.dataclass
class Fault:
    at: float  # share of the stream delivered when it fires
    kind: str
    pick: int  # which target, modulo the candidates at firing time
    hold: float  # seconds a pause lasts / before a replacement starts
    variant: int  # kind-specific choice (kill or continue, how far back, ...)

    def describe(self) -> str:
        return f"{self.kind}@{self.at:.2f}(pick={self.pick},hold={self.hold:.1f},v={self.variant})"


@dataclasses.dataclass
class Plan:
    seed: int
    kinds: tuple[str, ...]
    settings: dict[str, Any]  # producer settings (the oracle reads the stream-shaping ones)
    world_size: int
    workers: int
    prefetch: int
    delay: float
    checkpoint_every: int
    store_bytes: int
    workers_after: float
    faults: list[Fault]
    deadline: float

    @classmethod
    def draw(cls, seed: int, kinds: tuple[str, ...] = ENABLED) -> Plan:
        rng = random.Random(seed)
        epochs = rng.choice([1, 2])
        settings = {
            "corpus": str(FIXTURE),
            "capacity": 256,
            "max_rows_per_batch": 4,
            "window_documents": rng.choice([8, 16, 40]),
            "window_tokens": 3000,
            "epochs": epochs,
            "shuffle": rng.random() < 0.5,
            "seed": rng.randrange(1000),
            "tail": rng.choice(["fill", "drop"]) if "tail_drop" in kinds else "fill",
            # A few batches' worth: the reorder buffer is at its budget most of the time.
            "reorder_budget_bytes": rng.choice([4096, 16384, 65536]),
            "window_budget_bytes": rng.choice([4096, 32768]),
            "heartbeat_timeout": 1.0,
            # Longer than a trainer's timeout (TRAINER_TIMEOUT): a hung worker that only
            # this deadline took windows from would fail the run. Backup copies (after
            # backup_after = 1 s) are what keeps the trainers fed.
            "window_timeout": 30.0,
            # Trainers here resend after 1 s of silence, so 4 s without a word is a gone one.
            "consumer_timeout": 4.0,
            "max_message_bytes": MAX_MESSAGE_BYTES,
            # Plans of both packing policies are checked against the producer's own.
            "policy": rng.choice(["next_fit", "best_fit"]),
        }
        world_size = rng.choice([1, 2, 2, 3])
        faults = []
        fault_kinds = [kind for kind in kinds if kind not in ("tail_drop", "late_workers")]
        # Half the seeds run the data plane; all of them when only its faults are drawn.
        workers_plane = rng.random() < 0.5 or bool(
            fault_kinds and set(fault_kinds) <= set(DATA_PLANE_KINDS)
        )
        settings["data_plane"] = "workers" if workers_plane else "producer"
        if not workers_plane:
            fault_kinds = [kind for kind in fault_kinds if kind not in DATA_PLANE_KINDS]
        count = rng.randint(2, 5) if fault_kinds else 0
        # A data-plane seed's first fault is one of the data plane's, so that a few
        # seeds cover them all.
        plane_kinds = [kind for kind in fault_kinds if kind in DATA_PLANE_KINDS]
        for n in range(count):
            at = round(rng.uniform(0.05, 0.8), 3)
            kind = rng.choice(plane_kinds if n == 0 and plane_kinds else fault_kinds)
            # A hostile serving worker joins with the others: the honest ones pack far
            # ahead (a run's windows are all handed out within seconds), and one that
            # came later would never hold a batch a consumer is routed to.
            at = 0.0 if kind in ("wrong_batch", "hung_get") else at
            faults.append(
                Fault(
                    at=at,
                    kind=kind,
                    pick=rng.randrange(1000),
                    hold=round(rng.uniform(0.3, 2.5), 2),
                    variant=rng.randrange(1000),
                )
            )
        faults.sort(key=lambda f: f.at)
        # About 4 s of streaming whatever the shape, so faults land while it runs.
        per_rank = 49 * epochs / world_size
        delay = round(rng.uniform(2.0, 5.0) / per_rank, 3)
        return cls(
            seed=seed,
            kinds=kinds,
            settings=settings,
            world_size=world_size,
            workers=rng.choice([1, 2]),
            prefetch=rng.choice([1, 2, 4, 8]),
            delay=delay,
            checkpoint_every=rng.choice([2, 3, 5]),
            # A serving worker's store: from about two batches (most are dropped for
            # room and taken from the producer) to more than a run's.
            store_bytes=rng.choice([8192, 65536, 1 << 20]),
            # Drawn last, and only when named, so that it changes no other seed's plan.
            workers_after=LATE_WORKERS if "late_workers" in kinds and rng.random() < 0.5 else 0.0,
            faults=faults,
            deadline=90.0,
        )

    def describe(self) -> str:
        shape = {k: v for k, v in self.settings.items() if k not in ("corpus", "capacity")}
        return (
            f"world_size={self.world_size} workers={self.workers} prefetch={self.prefetch} "
            f"delay={self.delay} checkpoint_every={self.checkpoint_every} "
            f"store_bytes={self.store_bytes} workers_after={self.workers_after} {shape}\n"
            f"  faults: {' '.join(f.describe() for f in self.faults) or 'none'}"
        )


# ------------------------------------------------------------------------------ oracle

_ORACLES: dict[tuple[Any, ...], list[list[tuple[int, int, str]]]] = {}


def oracle(settings: dict[str, Any], world_size: int) -> list[list[tuple[int, int, str]]]:
    """Per rank, the (epoch, index, per-batch digest) list ``streampack digest`` computes."""
    from trainer import batch_digest

    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    shaping = ProducerSettings(
        **{k: v for k, v in settings.items() if k not in ("worker_endpoint", "consumer_endpoint")}
    )
    key = (tuple(sorted(settings.items())), world_size)
    if key not in _ORACLES:
        _ORACLES[key] = [
            [(e, g, batch_digest(b, e, g)) for e, g, b in rank_stream(shaping, r, world_size)]
            for r in range(world_size)
        ]
    return _ORACLES[key]


# ------------------------------------------------------------------------------ a run


@dataclasses.dataclass
class Segment:
    """One trainer process of a rank: the cursor it started from and what it logged."""

    rank: int
    number: int
    log: Path
    proc: subprocess.Popen
    start: tuple[int, int]
    position: int  # index into the rank's oracle list of ``start``
    received: int = 0
    longest_wait: float = 0.0  # seconds, the longest next() of the segment
    checkpoints: list[dict[str, int]] = dataclasses.field(default_factory=list)
    metrics: dict[str, Any] | None = None  # the client's counters, written after END
    ended: bool = False
    error: str = ""
    killed: bool = False
    _offset: int = 0


class Run:
    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.dir = workdir
        self.worker_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.consumer_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.expected = oracle(plan.settings, plan.world_size)
        self.total = sum(len(stream) for stream in self.expected)
        self.producer: subprocess.Popen | None = None
        self.producers: list[subprocess.Popen] = []  # every one started, for cleanup
        self.workers: list[subprocess.Popen] = []
        self.serving_peers: list[subprocess.Popen] = []  # hostile serving workers
        self.stores: dict[int, Path] = {}  # a serving worker's store status file, by pid
        self.stopped: dict[int, subprocess.Popen] = {}  # SIGSTOPped processes by pid
        self.segments: dict[int, list[Segment]] = {r: [] for r in range(plan.world_size)}
        self.peers: list[Peer] = []
        self.later: list[tuple[float, int, str, Any]] = []  # (when, n, what, action)
        self.events: list[str] = []  # what happened, with times, for the report
        self.started = time.monotonic()
        self.delivered = 0
        self.rng = random.Random(plan.seed * 7919 + 1)  # peers' own choices

    # -------------------------------------------------------------- processes

    def _note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:6.2f}s {text}")

    def _output(self, name: str) -> Any:
        return open(self.dir / name, "a")

    def start_producer(self) -> None:
        with self._output("producer.err") as err, self._output("producer.out") as out:
            self.producer = start(
                "produce",
                *flags(self.plan.settings),
                "--worker-endpoint",
                self.worker_endpoint,
                "--consumer-endpoint",
                self.consumer_endpoint,
                stdout=out,
                stderr=err,
            )
        self.producers.append(self.producer)
        self._note(f"producer {self.producer.pid} started")

    @property
    def data_plane(self) -> bool:
        return self.plan.settings["data_plane"] == "workers"

    def start_worker(self, mode: str = "honest") -> None:
        """A pack worker; on the data plane one that serves (through ``peers.py``, which
        watches its store), ``mode`` saying how (``peers.SERVING_MODES``)."""
        worker_flags = ["--connect", self.worker_endpoint, "--heartbeat-interval", "0.2"]
        # A hostile serving worker asks for more windows than the honest ones (credit 3
        # against 1), so that consumers are routed to it within a run's few seconds.
        worker_flags += ["--prefetch", "1" if mode == "honest" else "3"]
        with self._output("workers.err") as err:
            if not self.data_plane:
                proc = start("worker", *worker_flags, stdout=subprocess.DEVNULL, stderr=err)
            else:
                status = self.dir / f"store.{len(self.stores)}"
                worker_flags += ["--serve-endpoint", "tcp://127.0.0.1:*"]
                worker_flags += ["--store-bytes", str(self.plan.store_bytes)]
                proc = subprocess.Popen(
                    [sys.executable, str(PEERS), mode, str(status), *worker_flags],
                    cwd=ROOT,
                    env=env(),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
                self.stores[proc.pid] = status
        (self.workers if mode == "honest" else self.serving_peers).append(proc)
        self._note(f"worker {proc.pid} started" + ("" if mode == "honest" else f" ({mode})"))

    def _store(self, pid: int) -> list[int]:
        """A serving worker's last store status: entries, bytes, highest bytes, budget,
        batches served altered (zeros before its first)."""
        try:
            fields = [int(x) for x in self.stores[pid].read_text().split()]
        except (OSError, ValueError):  # not written yet, or caught mid-write
            fields = []
        return fields if len(fields) == 5 else [0] * 5

    def start_trainer(self, rank: int, cursor: dict[str, int] | None) -> None:
        number = len(self.segments[rank])
        log = self.dir / f"rank{rank}.{number}.log"
        args = [
            sys.executable,
            str(TRAINER),
            "--connect",
            self.consumer_endpoint,
            "--rank",
            str(rank),
            "--world-size",
            str(self.plan.world_size),
            "--log",
            str(log),
            "--prefetch",
            str(self.plan.prefetch),
            "--delay",
            str(self.plan.delay),
            "--checkpoint-every",
            str(self.plan.checkpoint_every),
            "--timeout",
            str(TRAINER_TIMEOUT),
            "--resend-after",
            "1.0",
        ]
        start_at = (0, rank)
        if cursor is not None:
            args += ["--state-in", json.dumps(cursor)]
            start_at = (cursor["epoch"], cursor["index"])
        with self._output(f"rank{rank}.err") as err:
            proc = subprocess.Popen(
                args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=err
            )
        stream = self.expected[rank]
        position = bisect.bisect_left([(e, g) for e, g, _ in stream], start_at)
        self.segments[rank].append(Segment(rank, number, log, proc, start_at, position))
        self._note(
            f"rank {rank} segment {number} (pid {proc.pid}) from {start_at} "
            f"= oracle position {position}/{len(stream)}"
        )

    def _live_workers(self) -> list[subprocess.Popen]:
        return [p for p in self.workers if p.poll() is None and p.pid not in self.stopped]

    def _serving_workers(self) -> list[subprocess.Popen]:
        """Live honest workers holding batches consumers are (or will be) routed to."""
        return [p for p in self._live_workers() if self._store(p.pid)[0] > 0]

    def _live_segments(self) -> list[Segment]:
        out = []
        for segments in self.segments.values():
            last = segments[-1] if segments else None
            if (
                last is not None
                and not last.ended
                and not last.killed
                and last.proc.poll() is None
                and last.proc.pid not in self.stopped
            ):
                out.append(last)
        return out

    def _after(self, seconds: float, what: str, action: Any) -> None:
        bisect.insort(
            self.later,
            (time.monotonic() + seconds, len(self.events) + len(self.later), what, action),
        )

    def _peer(self, endpoint: str, body: Any, name: str) -> None:
        peer = Peer(endpoint, body, name)
        self.peers.append(peer)
        peer.start()

    # -------------------------------------------------------------- faults

    def fire(self, fault: Fault) -> None:
        kind, rng = fault.kind, self.rng
        self._note(f"fault {fault.describe()}")
        if kind in ("worker_kill", "worker_stop", "serving_kill", "serving_stop"):
            live = self._serving_workers() if kind.startswith("serving") else []
            if kind.startswith("serving") and not live:
                self._note("  no worker holds batches now: any live worker instead")
            live = live or self._live_workers()
            if not live:
                self._note("  no live worker: skipped")
                return
            proc = live[fault.pick % len(live)]
            if proc.pid in self.stores:
                entries, nbytes = self._store(proc.pid)[:2]
                self._note(f"  worker {proc.pid} holds {entries} batches ({nbytes} bytes)")
            if kind.endswith("_kill"):
                proc.kill()
                self._note(f"  killed worker {proc.pid}")
                self._after(fault.hold, "replacement worker", self.start_worker)
                return
            proc.send_signal(signal.SIGSTOP)
            self.stopped[proc.pid] = proc
            self._note(f"  stopped worker {proc.pid} for {fault.hold}s")
            if fault.variant % 2:
                self._after(fault.hold, f"continue worker {proc.pid}", lambda: self._continue(proc))
            else:

                def kill_and_replace() -> None:
                    self._continue(proc, kill=True)
                    self.start_worker()

                self._after(fault.hold, f"kill stopped worker {proc.pid}", kill_and_replace)
        elif kind in ("trainer_kill", "trainer_stop"):
            live = self._live_segments()
            if not live:
                self._note("  no live trainer: skipped")
                return
            segment = live[fault.pick % len(live)]
            if kind == "trainer_stop":
                segment.proc.send_signal(signal.SIGSTOP)
                self.stopped[segment.proc.pid] = segment.proc
                self._note(f"  stopped rank {segment.rank} for {fault.hold}s")
                self._after(
                    fault.hold,
                    f"continue rank {segment.rank}",
                    lambda: self._continue(segment.proc),
                )
                return
            segment.killed = True
            segment.proc.kill()
            segment.proc.wait()
            self._read(segment)  # what it logged before it died counts
            cursors = [{"epoch": segment.start[0], "index": segment.start[1]}]
            cursors += segment.checkpoints
            back = fault.variant % 6  # 0: its last checkpoint; more: an older one
            cursor = cursors[max(0, len(cursors) - 1 - back)]
            self._note(
                f"  killed rank {segment.rank} after {segment.received} batches; "
                f"restart from {cursor} ({back} checkpoint(s) back)"
            )
            self._after(
                fault.hold / 2,
                f"restart rank {segment.rank}",
                lambda: self.start_trainer(segment.rank, cursor),
            )
        elif kind == "producer_restart":
            assert self.producer is not None
            if self.producer.poll() is not None:
                self._note("  the producer is down already (restart pending): skipped")
                return
            how = "SIGKILL" if fault.variant % 2 else "SIGTERM"
            self.producer.send_signal(getattr(signal, how))
            try:
                self.producer.wait(15)
            except subprocess.TimeoutExpired:
                raise self.failure(f"producer did not exit within 15s of {how}") from None
            self._note(f"  producer stopped by {how}")
            self._after(fault.hold, "producer restart", self.start_producer)
        elif kind == "wrong_batch":
            self.start_worker(SERVING_MODES[fault.variant % (len(SERVING_MODES) - 1)])
        elif kind == "hung_get":
            self.start_worker("hang")
        elif kind == "idle_consumer":
            live = self._live_segments()
            if not live:
                self._note("  no live trainer to shadow: skipped")
                return
            segment = live[fault.pick % len(live)]
            stream = self.expected[segment.rank]
            at = min(segment.position + segment.received, len(stream) - 1)
            epoch, index, _ = stream[at]
            body = idle_consumer(segment.rank, self.plan.world_size, epoch, index, fault.hold)
            self._note(f"  a consumer fetches as rank {segment.rank} from {(epoch, index)}")
            self._peer(self.consumer_endpoint, body, "idle")
        elif kind in PEER_KINDS:
            self._fire_peer(fault, rng)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def _fire_peer(self, fault: Fault, rng: random.Random) -> None:
        kind, plan = fault.kind, self.plan
        per_rank = max(len(stream) for stream in self.expected)
        if kind == "stray_fetch":
            wait = fault.hold if fault.variant % 2 else 0.0
            body = stray_fetches(rng, plan.world_size, plan.settings["epochs"], per_rank, wait)
            self._peer(self.consumer_endpoint, body, "stray")
        elif kind == "garbage":
            self._peer(self.consumer_endpoint, garbage(rng, MAX_MESSAGE_BYTES), "garbage-c")
            self._peer(self.worker_endpoint, garbage(rng, MAX_MESSAGE_BYTES), "garbage-w")
        elif kind == "wrong_world_fetch":
            self._peer(self.consumer_endpoint, wrong_world_fetch(plan.world_size), "stranger")
        elif kind == "worker_wave":
            for n in range(6):
                self._peer(self.worker_endpoint, fake_worker(rng, "vanish", 5.0), f"wave{n}")
        else:
            behaviour = kind.removesuffix("_worker")
            # Hung and slow workers stay until the end of the run (MAX_LIFE at most).
            life = 10 * 60.0 if kind in ("hung_worker", "slow_worker") else 5.0
            self._peer(self.worker_endpoint, fake_worker(rng, behaviour, life), kind)

    def _continue(self, proc: subprocess.Popen, kill: bool = False) -> None:
        self.stopped.pop(proc.pid, None)
        if proc.poll() is None:
            if kill:
                proc.kill()
            proc.send_signal(signal.SIGCONT)
        self._note(f"  {'killed' if kill else 'continued'} {proc.pid}")

    # -------------------------------------------------------------- checking

    def _read(self, segment: Segment) -> None:
        """Check the segment's new complete lines against the oracle."""
        try:
            with open(segment.log, "rb") as handle:
                handle.seek(segment._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        segment._offset += end
        stream = self.expected[segment.rank]
        for raw in data[:end].decode().splitlines():
            tag, _, rest = raw.partition(" ")
            if tag == "B":
                e, g, digest, waited = rest.split()
                got = (int(e), int(g), digest)
                segment.longest_wait = max(segment.longest_wait, float(waited))
                at = segment.position + segment.received
                want = stream[at] if at < len(stream) else None
                if got != want:
                    raise self.failure(
                        f"rank {segment.rank} segment {segment.number} (from "
                        f"{segment.start}): batch #{segment.received} of the segment is "
                        f"{self._show(got)}; the oracle has {self._show(want)} there"
                        + self._near(stream, got)
                    )
                segment.received += 1
                if not self.delivered:
                    self._note(f"first batch, at rank {segment.rank}")
                self.delivered += 1
            elif tag == "C":
                segment.checkpoints.append(json.loads(rest))
            elif tag == "M":
                segment.metrics = json.loads(rest)
            elif tag == "END":
                if segment.position + segment.received != len(stream):
                    raise self.failure(
                        f"rank {segment.rank} segment {segment.number}: the stream ended "
                        f"after {segment.position + segment.received} of the oracle's "
                        f"{len(stream)} batches (cursor {rest})"
                    )
                segment.ended = True
                self._note(f"rank {segment.rank} segment {segment.number} ended")
            elif tag == "E":
                segment.error = rest

    @staticmethod
    def _show(item: tuple[int, int, str] | None) -> str:
        return (
            "nothing (past the end)"
            if item is None
            else f"(epoch {item[0]}, batch {item[1]}, {item[2][:12]})"
        )

    @staticmethod
    def _near(stream: list[tuple[int, int, str]], got: tuple[int, int, str]) -> str:
        places = [i for i, item in enumerate(stream) if item == got]
        if places:
            return f" (that batch belongs at oracle position {places[0]})"
        if any((e, g) == got[:2] for e, g, _ in stream):
            return " (that place holds different contents in the oracle)"
        return ""

    def failure(self, symptom: str) -> ChaosFailure:
        status = self._status()
        tail = ""
        path = self.dir / "producer.err"
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()
            tail = "\n    ".join(lines[-12:])
        ranks = ", ".join(
            f"rank {r}: "
            + "; ".join(
                f"seg{s.number} from {s.start} got {s.received}"
                + (" END" if s.ended else "")
                + (" KILLED" if s.killed else "")
                + (f" ERROR {s.error}" if s.error else "")
                for s in segs
            )
            for r, segs in self.segments.items()
        )
        return ChaosFailure(
            f"chaos seed {self.plan.seed} FAILED: {symptom}\n"
            f"  plan: {self.plan.describe()}\n"
            f"  ranks: {ranks}\n"
            f"  producer stats: {status}\n"
            f"  events:\n    " + "\n    ".join(self.events) + "\n"
            f"  peers: {[(peer.name, peer.notes) for peer in self.peers]}\n"
            f"  producer log tail:\n    {tail}\n"
            f"  files: {self.dir}\n"
            f"  replay: {replay_command(self.plan)}"
        )

    def _status(self) -> str:
        if self.producer is None or self.producer.poll() is not None:
            return "no producer running"
        from streampack.service.health import check

        status = check(self.consumer_endpoint, 2.0)
        if status is None:
            return "no answer to a health probe within 2s"
        keep = (
            "workers",
            "windows_in_flight",
            "ready_batches",
            "reorder_bytes",
            "pending_fetches",
            "rewinds",
            "windows_reissued",
            "windows_failed",
            "rejected_worker",
            "rejected_consumer",
            "stale_dropped",
            "replayed_dropped",
            "windows_backed_up",
            "backup_wins",
            "duplicates_dropped",
            "batches_served",
            "fillers_served",
            "batches_routed",
            "batches_rerouted",
            "worker_batches_refused",
            "epoch",
        )
        return json.dumps({k: status["stats"].get(k) for k in keep})

    def longest_wait(self) -> tuple[float, str]:
        """The longest any trainer waited for one batch, and which segment it was."""
        return max(
            (
                (segment.longest_wait, f"rank {rank} segment {segment.number}")
                for rank, segments in self.segments.items()
                for segment in segments
            ),
            default=(0.0, "no trainer"),
        )

    # -------------------------------------------------------------- the run

    def execute(self) -> None:
        try:
            self._execute()
        finally:
            self.cleanup()

    def _execute(self) -> None:
        plan = self.plan
        self.start_producer()
        for _ in range(plan.workers):
            if plan.workers_after:
                self._after(plan.workers_after, "a late worker", self.start_worker)
            else:
                self.start_worker()
        for rank in range(plan.world_size):
            self.start_trainer(rank, None)
        faults = list(plan.faults)
        deadline = self.started + plan.deadline
        while True:
            now = time.monotonic()
            while self.later and self.later[0][0] <= now:
                _, _, what, action = self.later.pop(0)
                self._note(what)
                action()
            for segments in self.segments.values():
                segment = segments[-1]
                self._read(segment)
                code = segment.proc.poll()
                if code is not None and not segment.killed and not segment.ended:
                    self._read(segment)
                    if not segment.ended:
                        raise self.failure(
                            f"rank {segment.rank} segment {segment.number} exited {code}: "
                            f"{segment.error or 'without a word (see rank*.err)'}"
                        )
            if (
                self.producer is not None
                and self.producer.poll() is not None
                and self.producer.returncode not in (-signal.SIGKILL, 0)
                and not any("producer restart" in what for _, _, what, _ in self.later)
            ):
                raise self.failure(f"the producer died (exit {self.producer.returncode})")
            done = all(segs and segs[-1].ended for segs in self.segments.values())
            if done and not self.later:
                break
            while faults and self.delivered >= faults[0].at * self.total:
                self.fire(faults.pop(0))
            if now > deadline:
                raise self.failure(
                    f"no end within the run's deadline of {plan.deadline}s "
                    f"({self.delivered} batches delivered of {self.total} expected)"
                )
            time.sleep(0.05)
        for fault in faults:
            self._note(f"fault {fault.describe()} not reached: the stream ended first")
        if self.producer is None or self.producer.poll() is not None:
            raise self.failure("no producer running at the end")
        waited, where = self.longest_wait()
        bound = WAIT_BOUND + plan.workers_after  # the first batch waits for late workers
        if waited > bound:
            raise self.failure(
                f"{where} waited {waited:.2f}s for one batch; no trainer may wait more than "
                f"{bound}s (a hung or slow worker costs about backup_after = 1 s)"
            )
        if self._status().startswith("no answer"):
            raise self.failure("the producer does not answer a health probe at the end")
        self._check_counters()

    def _check_counters(self) -> None:
        """The counters agree with what the ranks read, the clients' and the producer's,
        and no serving worker's store ever held more than its budget."""
        ended = [s for segs in self.segments.values() for s in segs if s.ended]
        for segment in ended:  # its counters follow END: wait (bounded) for them
            try:
                segment.proc.wait(10)
            except subprocess.TimeoutExpired:
                raise self.failure(f"rank {segment.rank} did not exit after its END") from None
            self._read(segment)
            if segment.metrics is None:
                raise self.failure(f"rank {segment.rank} wrote no counters after its END")
            if segment.metrics["batches"] != segment.received:
                raise self.failure(
                    f"rank {segment.rank} segment {segment.number}: the client counts "
                    f"{segment.metrics['batches']} batches, its log {segment.received}"
                )
        for pid in self.stores:
            _, _, highest, budget, _ = self._store(pid)
            if highest > budget:
                raise self.failure(f"worker {pid}'s store held {highest} bytes of {budget}")
        clients = {
            key: sum(s.metrics[key] for s in ended if s.metrics)
            for key in ("batches_from_workers", "batches_rerouted", "worker_batches_refused")
        }
        altered = sum(self._store(p.pid)[4] for p in self.serving_peers)
        self._note(f"clients: {clients}; batches served altered by hostile workers: {altered}")
        if clients["worker_batches_refused"] > altered:
            raise self.failure(
                f"the clients refused {clients['worker_batches_refused']} batches from "
                f"workers; only {altered} were altered (an honest worker's batch refused)"
            )
        if not self.data_plane and clients["batches_from_workers"]:
            raise self.failure(f"data_plane = producer, yet the clients report {clients}")
        stats = json.loads(self._status())
        served = stats["batches_served"] + stats["fillers_served"]
        self._note(f"producer: {served} batches served, {self.delivered} read")
        fired = {
            kind for event in self.events for kind in EXTRA_SERVES if f"fault {kind}@" in event
        }
        if not self.data_plane and stats["batches_routed"]:
            raise self.failure(f"data_plane = producer, yet routes counted: {stats}")
        if fired:  # other askers took batches too: what the ranks read is a lower bound
            return
        if served != self.delivered:
            raise self.failure(
                f"the producer counts {served} batches served (fillers included); the "
                f"ranks read {self.delivered}"
            )
        # (A batch two consumers ask for is routed twice but served once.)
        if stats["batches_routed"] > stats["batches_served"]:
            raise self.failure(f"more batches routed than served: {stats}")

    def cleanup(self) -> None:
        for peer in self.peers:
            peer.close()
        for proc in list(self.stopped.values()):
            if proc.poll() is None:
                proc.kill()
                proc.send_signal(signal.SIGCONT)
        processes = self.workers + self.serving_peers
        processes += [s.proc for segs in self.segments.values() for s in segs]
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        for producer in self.producers:
            if producer.poll() is None:
                producer.terminate()
                try:
                    producer.wait(10)
                except subprocess.TimeoutExpired:
                    producer.kill()
        for proc in processes + self.producers:
            proc.wait()
        for peer in self.peers:
            peer.join(5)


def replay_command(plan: Plan) -> str:
    faults = "" if plan.kinds == ENABLED else f" CHAOS_FAULTS={','.join(plan.kinds)}"
    return f"make chaos CHAOS_SEED={plan.seed}{faults}"


def run_seed(seed: int, workdir: Path, kinds: tuple[str, ...] = ENABLED) -> Run:
    """Draw the plan of ``seed``, run it in ``workdir``; raises ``ChaosFailure``."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(Plan.draw(seed, kinds), workdir)
    run.execute()
    return run
