"""The trainer-side client: ``BatchStream`` yields this rank's packed batches in order.

Rank ``r`` of ``W`` receives global batches ``r, r + W, r + 2W, ...`` of each epoch;
at an epoch's end every rank has received the same number (the producer fills the tail
with all-padding batches flagged ``filler``, or drops it, as configured), then the
stream moves to the next epoch, until the producer's last epoch.

    with BatchStream("tcp://127.0.0.1:5556", rank=0, world_size=2) as stream:
        for batch in stream:
            train_step(batch.to_torch(device="cuda", pin_memory=True))
            if time_to_checkpoint:
                save(stream.state_dict())     # {"epoch", "index", "rank", "world_size"}

    stream.load_state_dict(saved)             # resume: the rest of the same stream

Resume at another world size (``resume_cursor``): a job checkpointed at ``W`` ranks,
every rank after the same ``k`` batches, has consumed global batches ``0 .. kW - 1``;
rank ``r'`` of ``W'`` continues at global index ``kW + r'``. Give it every rank's
state (a list) to have that checked, or one rank's state to have it trusted.

How it fetches: the client keeps up to ``prefetch`` fetch requests outstanding (fewer
when the batches already held reach ``prefetch_bytes``), each naming the exact
(epoch, global index) it wants, and puts answers back in order. Requests are
idempotent, so a reconnect or a restart never skips or repeats a batch: the cursor is
the whole state. The producer replays whatever it has already forgotten. After
``RESEND_AFTER`` seconds without any answer the client asks again, so a producer that
restarts under running trainers costs them a pause, not their stream. Batches are
expanded into memory that is reused once the trainer has dropped every reference to
an earlier batch (``BatchMemory``).

With the producer's ``data_plane = "workers"`` a batch may arrive as a *route*: the
endpoint of the worker that packed it and the route digest the producer computed from
its own window (``wire.route_digest``: the occurrence records and each range's content
digest). The client fetches the batch's frames from that worker (``get``; at most
``route_timeout`` seconds) and recomputes the digest from them (``wire.frames_digest``,
timed in ``verify_seconds``) before the batch is held, let alone yielded. A mismatch,
a ``missing`` answer, a malformed one or silence makes it ask the producer for the
batch itself (``reroute``: the producer's path is the safety net, so the stream is
exactly the same), counted in ``metrics()``
(``batches_rerouted``; ``worker_batches_refused`` for mismatches, which also make the
producer stop routing to that worker). A worker that timed out is not asked again for
``UNREACHABLE_FOR`` seconds: each of its routes is rerouted at once.

``StreamDigest`` defines the digest ``streampack consume`` and ``streampack digest``
print: SHA-256 over, per batch in order, ``epoch`` and ``index`` (little-endian
int64), the filler flag (one byte), every array of ``PackedBatch.ARRAY_FIELDS``, the
occurrence records (each names its source), as little-endian C-order bytes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from streampack import wire
from streampack.batch import CompactBatch, PackedBatch
from streampack.errors import InvalidConfig, ProtocolError, ResumeError, StreamTimeout
from streampack.examples import Binding
from streampack.settings import ConsumerSettings, check_rank

#: Seconds without any answer after which outstanding fetches are sent again.
RESEND_AFTER = 5.0
#: Seconds a worker that did not answer a ``get`` in time is not asked again.
UNREACHABLE_FOR = 30.0
#: Most worker endpoints a stream keeps a socket open to (the least recently used
#: are closed past it).
MAX_WORKER_SOCKETS = 64


#: Blocks of expanded-batch memory a client keeps for reuse (see ``BatchMemory``).
REUSED_BLOCKS = 4


class BatchMemory:
    """The memory batches are expanded into, reused once the trainer has let go of them.

    Why: a batch expanded into fresh memory is handed back to the operating system by
    ``malloc`` when the trainer drops it, and faulted in again, page by page, for the
    next one; in ``benchmarks/service.py`` that was a third of a consumer's CPU. Each
    batch's arrays are views of one block (``batch.expanded_arrays``), and every array,
    view or zero-copy tensor made from them holds a reference to that block, so a block
    whose only reference is this pool's is free to overwrite. A block still referenced
    is never touched; with every kept block in use, a fresh one replaces the oldest kept
    (which lives on as long as the trainer needs it).
    """

    def __init__(self, blocks: int = REUSED_BLOCKS) -> None:
        self._blocks: list[np.ndarray] = []
        self._size = blocks
        self._oldest = 0
        # What getrefcount reports for an item of the list and nothing else, measured
        # rather than assumed (interpreters differ in the references they count).
        probe = [np.empty(0, np.uint8)]
        self._unreferenced = sys.getrefcount(probe[0])

    def block(self, nbytes: int) -> np.ndarray:
        """A uint8 block of at least ``nbytes`` that nothing outside this pool refers to."""
        blocks = self._blocks
        for i in range(len(blocks)):
            if blocks[i].nbytes >= nbytes and sys.getrefcount(blocks[i]) == self._unreferenced:
                return blocks[i]
        block = np.empty(nbytes, np.uint8)
        if len(blocks) < self._size:
            blocks.append(block)
        else:
            blocks[self._oldest] = block
            self._oldest = (self._oldest + 1) % self._size
        return block


_CURSOR_KEYS = ("epoch", "index", "base", "rank", "world_size")


def _cursor_fields(
    state: Any, default: tuple[int, int] | None, where: str
) -> tuple[int, int, int, int, int]:
    """(epoch, index, base, rank, world_size) of one saved ``state_dict()``, checked. A
    state without ``rank`` and ``world_size`` (saved before they were recorded) is taken
    as ``default`` = (rank, world_size) of the stream, when there is one; without
    ``base``, as base 0."""
    if not isinstance(state, Mapping):
        raise ResumeError(
            f"{where} {state!r} is not a cursor: expected a dict from BatchStream.state_dict()"
        )
    if default is None and not ("rank" in state and "world_size" in state):
        raise ResumeError(
            f"{where} {dict(state)!r} lacks rank and world_size; a list of "
            f"states needs them (state_dict() saves them)"
        )
    rank, world_size = default if default is not None else (-1, 0)
    values: tuple[Any, ...] = (  # checked to be ints just below
        state.get("epoch"),
        state.get("index"),
        state.get("base", 0),
        state.get("rank", rank),
        state.get("world_size", world_size),
    )
    epoch, index, base, rank, world_size = values
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values) or not (
        epoch >= 0
        and world_size >= 1
        and 0 <= rank < world_size
        and 0 <= base <= index
        and (index - base) % world_size == rank
    ):
        raise ResumeError(
            f"{where} {dict(state)!r} is not a cursor of rank {state.get('rank', rank)} of "
            f"{state.get('world_size', world_size)}: expected ints epoch >= 0, "
            f"0 <= base <= index and index = base + rank mod world_size (keys "
            f"{', '.join(_CURSOR_KEYS)}, as state_dict() saves them)"
        )
    return epoch, index, base, rank, world_size


def resume_cursor(
    state: Mapping[str, int] | Sequence[Mapping[str, int]], rank: int, world_size: int
) -> tuple[int, int, int]:
    """(epoch, base, next global index) at which rank ``rank`` of ``world_size`` resumes.

    ``state`` is one rank's ``state_dict()`` or a list of every rank's. Saved at this
    world size, this rank's own state is taken as it is: exact whatever the other ranks
    had consumed. Saved at another world size ``W`` (an elastic resume), the mapping
    assumes the synchronous data-parallel case, every rank having consumed the same
    ``k`` batches of the epoch, i.e. global batches ``0 .. kW - 1`` (``base .. base +
    kW - 1`` when that epoch was itself resumed at ``base``): rank ``r'`` of ``W'``
    then continues at ``base' + r'``, ``base' + r' + W'``, ... with ``base' = base +
    kW``, so the new ranks together receive exactly the batches no old rank received.
    Given every rank's state, the assumption is checked, and states that disagree are
    refused (``ResumeError``): no mapping could then avoid repeating or skipping
    batches. Given one state, it is trusted.
    """
    where = "state"
    if isinstance(state, Mapping):
        states = [state]
    elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)) and state:
        states = list(state)
        where = "a state in the list"
    else:
        raise ResumeError(
            f"state {state!r} is not a cursor: expected a state_dict() or a "
            f"non-empty list of every rank's"
        )
    default = (rank, world_size) if len(states) == 1 else None
    cursors = [_cursor_fields(s, default, where) for s in states]
    saved_world = {c[4] for c in cursors}
    if len(saved_world) != 1:
        raise ResumeError(
            f"the states were saved at different world sizes "
            f"{sorted(saved_world)}; give the states of one checkpoint"
        )
    (saved_world_size,) = saved_world
    if saved_world_size == world_size:
        own = [c for c in cursors if c[3] == rank]
        if own:
            epoch, index, base, _, _ = own[0]
            return epoch, base, index
    if len(cursors) > 1:
        ranks = sorted(c[3] for c in cursors)
        if ranks != list(range(saved_world_size)):
            raise ResumeError(
                f"the list holds the states of ranks {ranks} of {saved_world_size}; an "
                f"elastic resume needs exactly one state per rank 0..{saved_world_size - 1}"
            )

    def consumed(cursor: tuple[int, int, int, int, int]) -> tuple[int, int]:
        """(epoch, global batches of it consumed by the whole job, if in step)."""
        epoch, index, base, r, w = cursor
        return epoch, base + (index - base - r) // w * w

    counts = {consumed(c) for c in cursors}
    if len(counts) != 1:
        detail = ", ".join(
            f"rank {c[3]}: epoch {c[0]} after {(c[1] - c[2] - c[3]) // c[4]}"
            for c in sorted(cursors, key=lambda c: c[3])
        )
        raise ResumeError(
            f"cannot map these states from world size {saved_world_size} to {world_size}: "
            f"the ranks had consumed different numbers of batches ({detail}). An elastic "
            f"resume is exact only for a synchronous checkpoint, where every rank has "
            f"consumed the same number; resume at world size {saved_world_size}, each rank "
            f"from its own state, or checkpoint when the ranks are in step"
        )
    ((epoch, next_base),) = counts
    return epoch, next_base, next_base + rank


class StreamDigest:
    """A running SHA-256 over everything a rank received, in order (see module doc)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.batches = 0
        self.fillers = 0
        self.tokens = 0

    def update(self, batch: PackedBatch, epoch: int, index: int) -> None:
        h = self._hash
        h.update(struct.pack("<qq?", epoch, index, bool(batch.filler)))
        for name in batch.ARRAY_FIELDS:
            array = getattr(batch, name)
            h.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).data)
        h.update(np.ascontiguousarray(batch.occurrences).data)  # each names its source
        self.batches += 1
        self.fillers += int(bool(batch.filler))
        self.tokens += int(np.asarray(batch.valid_lengths).sum())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def summary(self, rank: int, world_size: int, state: dict[str, int]) -> dict[str, Any]:
        """The final JSON line of ``consume`` and ``digest``: equal streams, equal lines."""
        return {
            "rank": rank,
            "world_size": world_size,
            "batches": self.batches,
            "fillers": self.fillers,
            "tokens": self.tokens,
            "digest": self.hexdigest(),
            "state": state,
        }


class BatchStream:
    """An iterator of ``PackedBatch`` for one rank, fetched from a producer.

    Args:
        endpoint: the producer's consumer endpoint, e.g. ``tcp://127.0.0.1:5556``.
        rank, world_size: this process's place in the job, ``0 <= rank < world_size``.
        binding: the ``Binding`` this rank expects; a batch with another raises
            ``BindingMismatch`` (rule C9). ``None`` accepts the producer's.
        prefetch: most batches requested ahead.
        prefetch_bytes: most bytes of batches held ahead (bounds memory with big batches).
        timeout: seconds to wait for the next batch before ``StreamTimeout``.
        max_message_bytes: largest frame accepted (``zmq.MAXMSGSIZE``).
        curve_server_key: the producer's Z85 CURVE public key, when it uses CURVE.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        rank: int,
        world_size: int,
        binding: Binding | None = None,
        prefetch: int = 4,
        prefetch_bytes: int = 256 << 20,
        timeout: float = 60.0,
        max_message_bytes: int = 256 << 20,
        curve_server_key: str | None = None,
        route_timeout: float = 2.0,
    ) -> None:
        check_rank(rank, world_size)
        # The checks of ConsumerSettings, whichever way the values came in (InvalidConfig
        # on a bad one); the endpoint is refused here, not when the first fetch connects.
        ConsumerSettings(
            connect=endpoint,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            timeout=timeout,
            max_message_bytes=max_message_bytes,
            curve_server_key=curve_server_key,
            route_timeout=route_timeout,
        )
        self.endpoint = endpoint
        self.route_timeout = route_timeout
        self._workers: dict[str, zmq.Socket] = {}  # endpoint -> socket, oldest use first
        self._unreachable: dict[str, float] = {}  # endpoint -> skipped until (monotonic)
        self.rank = rank
        self.world_size = world_size
        self.binding = binding
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.timeout = timeout
        self.limits = wire.WireLimits(max_frame_bytes=max_message_bytes)
        self._max_message_bytes = max_message_bytes
        self._curve_server_key = curve_server_key
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._epoch = 0
        self._index = rank  # next global index this rank yields
        # First global index of this epoch's share at this world size: 0, except in the
        # epoch an elastic resume continues (rank r gets base + r, base + r + W, ...).
        self._base = 0
        self._requested: list[int] = []  # indices of the current epoch asked for, in order
        self._held: dict[int, CompactBatch] = {}
        self._held_bytes = 0
        self._batch_bytes = 0  # size of the last batch, to bound prefetch by bytes
        self._finished = False
        self._limit: int | None = None  # this epoch's end for this rank, once known
        self.last_epoch_end: dict[str, int] | None = None
        self._memory = BatchMemory()
        self.rejected = 0  # malformed messages received and dropped
        self.resent = 0  # times outstanding fetches were sent again after silence
        self.batches = 0  # batches yielded (fillers included)
        self.fillers = 0
        self.bytes_received = 0  # compact bytes of the batches yielded (as they travelled)
        self.waits = 0  # batches that were not there yet when asked for
        self.seconds_blocked = 0.0  # time next_batch spent waiting for the producer
        self.batches_from_workers = 0  # routed batches fetched and verified
        self.batches_rerouted = 0  # routes given up on: the producer sent the batch
        self.worker_batches_refused = 0  # of those, frames that did not match the digest
        self.verify_seconds = 0.0  # CPU time spent recomputing routed batches' digests
        # Load the check and expand kernels now, not inside the first next_batch. Imported
        # here so that importing this module does not load Numba.
        from streampack.packing import warm_up_kernels

        warm_up_kernels()
        self.current: tuple[int, int] | None = None  # (epoch, index) of the last batch

    @classmethod
    def from_settings(
        cls,
        settings: ConsumerSettings,
        *,
        rank: int,
        world_size: int,
        binding: Binding | None = None,
    ) -> BatchStream:
        """A stream configured by ``settings`` (the ``[consumer]`` table of a settings
        file, or ``streampack consume``'s flags)."""
        return cls(
            settings.connect,
            route_timeout=settings.route_timeout,
            rank=rank,
            world_size=world_size,
            binding=binding,
            prefetch=settings.prefetch,
            prefetch_bytes=settings.prefetch_bytes,
            timeout=settings.timeout,
            max_message_bytes=settings.max_message_bytes,
            curve_server_key=settings.curve_server_key,
        )

    # -- state ----------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """This stream's counters (a fresh dict). ``seconds_blocked`` is the number that
        says whether the data path slows training: the time the trainer waited in
        ``next_batch`` for a batch that had not arrived yet (expansion not included).
        ``streampack.client_metrics`` exports them to Prometheus."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "batches": self.batches,
            "fillers": self.fillers,
            "bytes_received": self.bytes_received,
            "waits": self.waits,
            "seconds_blocked": self.seconds_blocked,
            "rejected": self.rejected,
            "resent": self.resent,
            "batches_from_workers": self.batches_from_workers,
            "batches_rerouted": self.batches_rerouted,
            "worker_batches_refused": self.worker_batches_refused,
            "verify_seconds": self.verify_seconds,
        }

    def state_dict(self) -> dict[str, int]:
        """The cursor: the next batch this rank will yield, and where it stands in the
        job (``rank``, ``world_size``), so a resume at another world size can map it."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "base": self._base,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, int] | Sequence[Mapping[str, int]]) -> None:
        """Continue from ``state``: this rank's ``state_dict()``, another rank's, or a
        list of every rank's, saved at this world size or another (see
        ``resume_cursor``). Drops anything prefetched."""
        self._epoch, self._base, self._index = resume_cursor(state, self.rank, self.world_size)
        self._finished = False
        self._reset_socket()

    # -- socket ---------------------------------------------------------------------

    def _reset_socket(self) -> None:
        """A fresh identity, so answers to requests made before cannot be mistaken."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self._requested.clear()
        self._held.clear()
        self._held_bytes = 0
        self._limit = None

    def _ensure_socket(self) -> zmq.Socket:
        if self._socket is None:
            if self._context is None:
                self._context = zmq.Context()
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.ROUTING_ID, f"c{self.rank}-{uuid.uuid4().hex[:12]}".encode())
            wire.configure_socket(socket, self._max_message_bytes)
            if self._curve_server_key:
                wire.curve_client(socket, self._curve_server_key)
            wire.attach(socket, self.endpoint, field="endpoint", bind=False)
            self._socket = socket
        return self._socket

    def close(self) -> None:
        self._reset_socket()
        for socket in self._workers.values():
            socket.close(linger=0)
        self._workers.clear()
        if self._context is not None:
            # destroy, not term: it closes any socket left open (without lingering)
            # first, so closing can never wait forever.
            self._context.destroy(linger=0)
            self._context = None

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- iteration ------------------------------------------------------------------

    def _request_more(self, socket: zmq.Socket) -> None:
        """Top the outstanding requests up to ``prefetch`` (fewer near ``prefetch_bytes``)
        once half of them have been answered: one fetch message for a run of batches."""
        if len(self._requested) > self.prefetch // 2:
            return
        first = next_index = (
            self._requested[-1] + self.world_size if self._requested else self._index
        )
        count = 0
        while (
            len(self._requested) < self.prefetch
            and (self._limit is None or next_index < self._limit)
            and (
                not self._requested
                or self._held_bytes + self._batch_bytes * len(self._requested) < self.prefetch_bytes
            )
        ):
            self._requested.append(next_index)
            next_index += self.world_size
            count += 1
        if count:
            self._fetch(socket, first, count)

    def _fetch(self, socket: zmq.Socket, index: int, count: int) -> None:
        fields = {
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self._epoch,
            "index": index,
            "count": count,
            "base": self._base,
        }
        socket.send_multipart(wire.encode("fetch", fields), copy=False)

    def _resend(self, socket: zmq.Socket) -> None:
        for index in self._requested:
            if index not in self._held:
                self._fetch(socket, index, 1)
        self.resent += 1

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            try:
                batch = self.next_batch()
            except StopIteration:
                return
            yield batch

    def __next__(self) -> PackedBatch:
        return self.next_batch()

    def next_batch(self) -> PackedBatch:
        """The next batch of this rank; ``StopIteration`` after the producer's last epoch."""
        if self._finished:
            raise StopIteration
        socket = self._ensure_socket()
        asked = time.perf_counter()
        waited = False
        deadline = time.monotonic() + self.timeout
        while True:
            if self._index in self._held:
                compact = self._held.pop(self._index)
                self._held_bytes -= compact.nbytes
                self._requested.remove(self._index)
                self.current = (self._epoch, self._index)
                self._index += self.world_size
                self.batches += 1
                self.fillers += int(compact.filler)
                self.bytes_received += compact.nbytes
                if waited:
                    self.waits += 1
                    self.seconds_blocked += time.perf_counter() - asked
                block = None if compact.filler else self._memory.block(compact.expanded_nbytes)
                return compact.expand(block)
            if self._limit is not None and self._index >= self._limit:
                self._epoch += 1
                self._index = self.rank
                self._base = 0
                self._limit = None
                self._requested.clear()
                self._held.clear()
                self._held_bytes = 0
                continue
            self._request_more(socket)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StreamTimeout(
                    f"rank {self.rank}: no answer from {self.endpoint} within {self.timeout}s "
                    f"for epoch {self._epoch} batch {self._index}; is the producer running?"
                )
            wait = min(remaining, RESEND_AFTER)
            waited = True
            if not socket.poll(int(wait * 1000) + 1, zmq.POLLIN):
                if wait >= RESEND_AFTER:
                    # Silence: the producer may have restarted and lost our fetches. They
                    # are idempotent, so ask again (an answer that comes twice is ignored).
                    self._resend(socket)
                continue
            frames = socket.recv_multipart(copy=False)
            try:
                message = wire.decode(frames, self.limits)
            except ProtocolError:
                self.rejected += 1  # counted and dropped; the next answer may be fine
                continue
            if self._handle(message):
                self._finished = True
                raise StopIteration

    def _hold(self, index: int, batch: CompactBatch) -> None:
        if self.binding is not None:
            batch.check_binding(self.binding)
        if index not in self._held:
            self._held[index] = batch
            size = batch.nbytes
            self._held_bytes += size
            self._batch_bytes = size

    def _take_route(self, f: dict[str, Any]) -> None:
        """Fetch a routed batch from its worker and hold it once its frames match the
        producer's digest; otherwise ask the producer for it (``reroute``)."""
        endpoint = f["endpoint"]
        reason, arrays = self._get_from_worker(endpoint, f)
        if arrays is not None:
            started = time.thread_time()
            digest = wire.frames_digest(arrays)
            self.verify_seconds += time.thread_time() - started
            if digest is None or digest.hex() != f["digest"]:
                reason = "digest"
            else:
                try:
                    batch = wire.compact_batch(f, arrays, self.limits)
                except ProtocolError:
                    reason = "rejected"  # it matched the digest: the producer's own bug
                else:
                    self._hold(f["index"], batch)
                    self.batches_from_workers += 1
                    return
        self.batches_rerouted += 1
        if reason == "digest":
            self.worker_batches_refused += 1
        fields = {
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": f["epoch"],
            "index": f["index"],
            "base": self._base,
            "endpoint": endpoint[:1000],
            "reason": reason,
        }
        self._ensure_socket().send_multipart(wire.encode("reroute", fields), copy=False)

    def _get_from_worker(
        self, endpoint: str, f: dict[str, Any]
    ) -> tuple[str, dict[str, np.ndarray] | None]:
        """The frames of batch (epoch, window, batch) from the worker at ``endpoint``:
        ("", frames), or (why not, None) within ``route_timeout`` seconds."""
        now = time.monotonic()
        if self._unreachable.get(endpoint, 0.0) > now:
            return "timeout", None
        key = {"epoch": f["epoch"], "window": f["window"], "batch": f["batch"]}
        try:
            socket = self._worker_socket(endpoint)
            socket.send_multipart(wire.encode("get", key), copy=False, flags=zmq.NOBLOCK)
        except (zmq.ZMQError, ProtocolError):
            return self._gave_up(endpoint), None
        deadline = now + self.route_timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                break
            try:
                message = wire.decode(socket.recv_multipart(copy=False), self.limits)
            except ProtocolError:
                return "rejected", None
            if message.kind not in ("part", "missing") or message.fields != key:
                continue  # a late answer to an earlier get, or noise: not this batch
            if message.kind == "missing":
                return "missing", None
            return "", message.arrays
        return self._gave_up(endpoint), None

    def _gave_up(self, endpoint: str) -> str:
        """A worker that did not answer: its socket is closed (a late answer cannot be
        mistaken) and it is skipped for ``UNREACHABLE_FOR`` seconds."""
        socket = self._workers.pop(endpoint, None)
        if socket is not None:
            socket.close(linger=0)
        self._unreachable[endpoint] = time.monotonic() + UNREACHABLE_FOR
        while len(self._unreachable) > MAX_WORKER_SOCKETS:
            del self._unreachable[next(iter(self._unreachable))]
        return "timeout"

    def _worker_socket(self, endpoint: str) -> zmq.Socket:
        socket = self._workers.pop(endpoint, None)
        if socket is None:
            if self._context is None:
                self._context = zmq.Context()
            socket = self._context.socket(zmq.DEALER)
            wire.configure_socket(socket, self._max_message_bytes)
            try:
                wire.attach(socket, endpoint, field="route endpoint", bind=False)
            except InvalidConfig as exc:
                raise ProtocolError(str(exc)) from None
            while len(self._workers) >= MAX_WORKER_SOCKETS:
                self._workers.pop(next(iter(self._workers))).close(linger=0)
        self._workers[endpoint] = socket  # most recently used last
        return socket

    def _handle(self, message: wire.Message) -> bool:
        """Take one answer; True when the stream has ended."""
        kind, f = message.kind, message.fields
        if kind == "batch":
            if f["epoch"] != self._epoch or f["index"] not in self._requested:
                return False  # an answer to a request from before a reset
            self._hold(f["index"], wire.batch_from_message(message, self.limits))
            return False
        if kind == "route":
            if f["epoch"] != self._epoch or f["index"] not in self._requested:
                return False  # an answer to a request from before a reset
            if f["index"] not in self._held:
                self._take_route(f)
            return False
        if kind == "epoch_end":
            if f["epoch"] == self._epoch:
                self._limit = self._base + f["per_rank"] * self.world_size
                self._requested = [i for i in self._requested if i < self._limit]
                self.last_epoch_end = dict(f)
            return False
        if kind == "stream_end":
            return True
        if kind == "error":
            raise ProtocolError(f"producer at {self.endpoint} rejected a request: {f['message']}")
        self.rejected += 1  # a valid message a producer never sends a consumer: dropped
        return False
