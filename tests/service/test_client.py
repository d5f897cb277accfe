"""BatchStream and StreamDigest: arguments, cursor, prefetch bounds, answers it drops.

Where a test needs a producer that misbehaves on purpose, the test binds a ROUTER
socket and plays the producer itself; the binding check runs against a real one.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack import (
    Binding,
    BindingMismatch,
    CompactBatch,
    Examples,
    InvalidConfig,
    PackConfig,
    PackedBatch,
    ProtocolError,
    StreampackError,
    pack_compact,
    wire,
)
from streampack.client import (
    REUSED_BLOCKS,
    BatchMemory,
    BatchStream,
    ResumeError,
    StreamDigest,
    StreamTimeout,
    resume_cursor,
)
from streampack.settings import ConsumerSettings

BINDING = Binding(vocab_size=512, tokenizer="t", split_receipt="r", partition="train")


class FakeProducer:
    """A ROUTER that records fetches and answers with a scripted function."""

    def __init__(self, answer):
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.answer = answer
        self.fetches: list[dict] = []  # one per batch asked for
        self.messages = 0  # fetch messages (each may ask for several batches)
        self.outstanding_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, *frames = self.router.recv_multipart()
            fetch = wire.decode(frames).fields
            self.messages += 1
            for k in range(fetch["count"]):  # one batch at a time, as the producer serves
                fields = fetch | {"index": fetch["index"] + k * fetch["world_size"]}
                self.fetches.append(fields)
                for reply in self.answer(fields, self):
                    self.router.send_multipart([identity, *reply])

    def close(self):
        self._stop.set()
        self._thread.join()
        self.router.close(linger=0)
        self.context.term()


def filler_frames(epoch, index, binding=BINDING):
    batch = CompactBatch.filler_like(binding, 2, 8)
    fields = {
        "epoch": epoch,
        "index": index,
        "window": -1,
        "batch": -1,
        "filler": True,
        "binding": wire.binding_to_wire(binding),
    } | wire.batch_shape(batch)
    return [bytes(f) for f in wire.encode("batch", fields, wire.batch_arrays(batch))]


def serve_n(per_rank):
    """Answer fetches with filler batches up to ``per_rank`` per rank, then epoch_end;
    one epoch."""

    def answer(fields, _):
        epoch, index, world = fields["epoch"], fields["index"], fields["world_size"]
        if epoch >= 1:
            return [wire.encode("stream_end", {"epochs": 1})]
        if index >= per_rank * world:
            return [
                wire.encode(
                    "epoch_end", {"epoch": 0, "per_rank": per_rank, "total": per_rank * world}
                )
            ]
        return [filler_frames(epoch, index)]

    return answer


@pytest.fixture
def fake():
    producers = []

    def make(answer):
        producers.append(FakeProducer(answer))
        return producers[-1]

    yield make
    for producer in producers:
        producer.close()


def test_rank_receives_its_share_in_order_then_stops(fake):
    producer = fake(serve_n(5))
    with BatchStream(producer.endpoint, rank=1, world_size=3, timeout=30, prefetch=2) as s:
        indices = []
        for batch in s:
            indices.append(s.current)
            assert batch.filler
        assert indices == [(0, 1), (0, 4), (0, 7), (0, 10), (0, 13)]
        assert s.state_dict() == {"epoch": 1, "index": 1, "base": 0, "rank": 1, "world_size": 3}
    assert all(f["rank"] == 1 and f["world_size"] == 3 for f in producer.fetches)


def test_prefetch_bounds_outstanding_requests(fake):
    def never(fields, producer):
        return []

    producer = fake(never)
    with BatchStream(producer.endpoint, rank=0, world_size=2, timeout=0.5, prefetch=3) as s:
        with pytest.raises(StreamTimeout, match="no answer .* within 0.5s for epoch 0 batch 0"):
            next(s)
    assert [f["index"] for f in producer.fetches] == [0, 2, 4]
    assert producer.messages == 1  # one fetch message for the run of three


def test_fetches_top_up_in_runs_once_half_are_answered(fake):
    producer = fake(serve_n(12))
    with BatchStream(producer.endpoint, rank=0, world_size=1, timeout=30, prefetch=4) as s:
        assert sum(1 for _ in s) == 12
    assert [f["index"] for f in producer.fetches][:12] == list(range(12))
    assert producer.messages <= 12 // 2 + 2  # about one message per two batches, not per batch


def test_load_state_dict_resumes_at_the_cursor(fake):
    producer = fake(serve_n(5))
    with BatchStream(producer.endpoint, rank=0, world_size=2, timeout=30) as s:
        s.load_state_dict({"epoch": 0, "index": 6})
        rest = [s.current for _ in s]
    assert rest == [(0, 6), (0, 8)]


@pytest.mark.parametrize(
    "state", [{"epoch": 0, "index": 1}, {"epoch": -1, "index": 0}, {"index": 0}, {}]
)
def test_bad_cursor_is_refused(fake, state):
    with BatchStream("tcp://127.0.0.1:1", rank=0, world_size=2) as s:
        with pytest.raises(StreampackError, match="not a cursor of rank 0 of 2"):
            s.load_state_dict(state)


def states_after(k, world_size, epoch=0):
    """Every rank's state_dict() after k batches each, at world_size."""
    return [
        {"epoch": epoch, "index": k * world_size + r, "rank": r, "world_size": world_size}
        for r in range(world_size)
    ]


@pytest.mark.parametrize(("saved", "k", "resumed"), [(4, 3, 2), (2, 5, 3), (3, 0, 5), (3, 4, 6)])
def test_resume_at_another_world_size_starts_each_rank_after_every_consumed_batch(
    saved, k, resumed
):
    """Global batches 0..kW-1 were consumed: the new ranks receive kW, kW+1, ... between
    them, each exactly once, whether given every rank's state or one rank's."""
    states = states_after(k, saved, epoch=1)
    starts = [resume_cursor(states, r, resumed) for r in range(resumed)]
    assert starts == [(1, k * saved, k * saved + r) for r in range(resumed)]
    for one in states:
        assert [resume_cursor(one, r, resumed) for r in range(resumed)] == starts


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 60), saved=st.integers(1, 8), resumed=st.integers(1, 8), data=st.data())
def test_an_elastic_resume_covers_every_real_batch_exactly_once(total, saved, resumed, data):
    """Whatever the sizes: the k batches per rank consumed at ``saved`` ranks, then each
    resumed rank's share from its cursor to the tail (``tail = "fill"``, counted from
    the base as the producer counts it), hold every real global batch exactly once, and
    every resumed rank the same number."""
    per_rank = -(-total // saved)
    k = data.draw(st.integers(0, per_rank))
    consumed = [g for g in range(k * saved) if g < total]
    shares = []
    for rank in range(resumed):
        epoch, base, index = resume_cursor(states_after(k, saved), rank, resumed)
        limit = base + -(-max(0, total - base) // resumed) * resumed
        shares.append(list(range(index, limit, resumed)))
    assert len({len(share) for share in shares}) == 1
    real = sorted(consumed + [g for share in shares for g in share if g < total])
    assert real == list(range(total))


def test_resume_at_the_same_world_size_takes_each_ranks_own_state():
    """Unequal counts are exact at the same world size: each rank continues its own."""
    states = states_after(3, 2)
    states[1]["index"] = 1 + 2 * 7
    assert resume_cursor(states, 1, 2) == (0, 0, 15)
    assert resume_cursor(states, 0, 2) == (0, 0, 6)


def test_a_resumed_epoch_can_be_checkpointed_and_resumed_again():
    """4 ranks after 3 batches (12 consumed), then 3 ranks after 2 more each (18): a
    resume at 2 ranks continues at 18 and 19."""
    first = [
        dict(
            zip(("epoch", "base", "index"), resume_cursor(states_after(3, 4), r, 3)),
            rank=r,
            world_size=3,
        )
        for r in range(3)
    ]
    assert [s["index"] for s in first] == [12, 13, 14]
    second = [s | {"index": s["index"] + 2 * 3} for s in first]
    assert [resume_cursor(second, r, 2) for r in range(2)] == [(0, 18, 18), (0, 18, 19)]


@pytest.mark.parametrize(
    ("states", "match"),
    [
        (
            [states_after(3, 4)[0], states_after(2, 4)[1], *states_after(3, 4)[2:]],
            r"different numbers of batches \(rank 0: epoch 0 after 3, rank 1: epoch 0 after 2",
        ),
        (states_after(3, 4)[:3], r"ranks \[0, 1, 2\] of 4; an elastic resume needs exactly one"),
        ([*states_after(1, 2), *states_after(1, 3)], "different world sizes \\[2, 3\\]"),
        ([{"epoch": 0, "index": 0}, {"epoch": 0, "index": 1}], "lacks rank and world_size"),
        ({"epoch": 0, "index": 6, "rank": 1, "world_size": 4}, "not a cursor of rank 1 of 4"),
        ({"epoch": 0, "index": 6, "base": 8, "rank": 2, "world_size": 4}, "0 <= base <= index"),
        ([], "non-empty list"),
        ("epoch=0", "not a cursor"),
    ],
)
def test_states_that_cannot_be_mapped_are_refused_saying_why(states, match):
    with pytest.raises(ResumeError, match=match):
        resume_cursor(states, 0, 3)


def test_load_state_dict_of_another_world_size_fetches_the_mapped_batches(fake):
    def twelve(fields, _):
        """12 global batches; a rank's share counts from the fetch's base."""
        epoch, index, world, base = (fields[k] for k in ("epoch", "index", "world_size", "base"))
        if epoch >= 1:
            return [wire.encode("stream_end", {"epochs": 1})]
        per_rank = -(-(12 - base) // world)
        if index >= base + per_rank * world:
            return [wire.encode("epoch_end", {"epoch": 0, "per_rank": per_rank, "total": 12})]
        return [filler_frames(epoch, index)]

    producer = fake(twelve)
    with BatchStream(producer.endpoint, rank=1, world_size=2, timeout=30) as s:
        s.load_state_dict(states_after(2, 3))  # 6 consumed at world size 3
        rest = [s.current for _ in s]
    assert rest == [(0, 7), (0, 9), (0, 11)]
    assert s.state_dict() == {"epoch": 1, "index": 1, "base": 0, "rank": 1, "world_size": 2}
    assert {f["base"] for f in producer.fetches if f["epoch"] == 0} == {6}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank = 2 is not a rank of world_size 2"),
        ({"rank": 0, "world_size": 0}, "world_size = 0"),
        ({"rank": 0, "world_size": 1, "prefetch": 0}, "prefetch = 0"),
        ({"rank": 0, "world_size": 1, "timeout": 0}, "timeout = 0"),
        ({"rank": 0, "world_size": 1, "max_message_bytes": 10}, "max_message_bytes = 10"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(InvalidConfig, match=match):
        BatchStream("tcp://127.0.0.1:1", **kwargs)


def test_a_stream_from_consumer_settings_takes_every_field():
    settings = ConsumerSettings(
        connect="tcp://127.0.0.1:1",
        prefetch=2,
        prefetch_bytes=4096,
        timeout=5.0,
        max_message_bytes=8192,
    )
    with BatchStream.from_settings(settings, rank=1, world_size=3, binding=BINDING) as stream:
        assert (stream.endpoint, stream.rank, stream.world_size, stream.binding) == (
            "tcp://127.0.0.1:1",
            1,
            3,
            BINDING,
        )
        assert (stream.prefetch, stream.prefetch_bytes, stream.timeout) == (2, 4096, 5.0)
        assert stream.limits.max_frame_bytes == 8192


def test_binding_mismatch_raises(fake):
    producer = fake(serve_n(2))
    other = Binding(vocab_size=512, tokenizer="t", split_receipt="r2", partition="train")
    with BatchStream(producer.endpoint, rank=0, world_size=1, binding=other, timeout=30) as s:
        with pytest.raises(BindingMismatch, match="split_receipt: batch has 'r'"):
            next(s)


def test_malformed_answers_are_dropped_and_counted(fake):
    def garbage_first(fields, producer):
        if len(producer.fetches) == 1:
            stray = wire.encode_header("ready", {"credit": 1, "needs_tokens": False})
            return [[b"\x00garbage"], [stray], filler_frames(fields["epoch"], fields["index"])]
        return serve_n(1)(fields, producer)

    producer = fake(garbage_first)
    with BatchStream(producer.endpoint, rank=0, world_size=1, timeout=30, prefetch=1) as s:
        assert len(list(s)) == 1
        assert s.rejected == 2  # the garbage and the stray 'ready'


def test_error_answer_raises(fake):
    def refuse(fields, producer):
        return [wire.encode("error", {"message": "world_size 3 differs"})]

    producer = fake(refuse)
    with BatchStream(producer.endpoint, rank=0, world_size=3, timeout=30) as s:
        with pytest.raises(ProtocolError, match="rejected a request: world_size 3 differs"):
            next(s)


def test_stream_digest_definition_is_pinned():
    batch = PackedBatch.filler_like(BINDING, 1, 2)
    digest = StreamDigest()
    digest.update(batch, 3, 5)
    h = hashlib.sha256(struct.pack("<qq?", 3, 5, True))
    for name in PackedBatch.ARRAY_FIELDS:
        h.update(getattr(batch, name).tobytes())
    h.update(batch.occurrences.tobytes())
    assert digest.hexdigest() == h.hexdigest()
    assert (digest.batches, digest.fillers, digest.tokens) == (1, 1, 0)
    assert np.array_equal(batch.inputs, [[-1, -1]])


def test_batch_memory_reuses_a_block_only_once_nothing_refers_to_it():
    memory = BatchMemory()
    held = memory.block(100)[8:24].view(np.int32)  # a view of a view refers to the block
    block = weakref.ref(held.base)  # to name the block without holding it
    assert memory.block(100) is not block()
    del held
    assert memory.block(100) is block()
    assert memory.block(200) is not block()  # too small for the ask


def test_batch_memory_keeps_a_bounded_number_of_blocks():
    memory = BatchMemory()
    held = [memory.block(64) for _ in range(3 * REUSED_BLOCKS)]
    assert len({id(b) for b in held}) == len(held)  # all in use: every ask is a new block
    del held
    kept = {id(memory.block(64)) for _ in range(3 * REUSED_BLOCKS)}
    assert len(kept) == 1  # the same free block, over and over


def real_batches(count):
    examples = Examples.from_documents(
        [[1 + (d * 7 + j) % 500 for j in range(3 + d % 9)] for d in range(12 * count)]
    )
    config = PackConfig(capacity=16, max_rows_per_batch=2)
    return pack_compact(examples, BINDING, config)[:count]


def test_batches_the_trainer_keeps_are_never_overwritten(fake):
    """Every batch is kept while the stream goes on expanding into reused memory: each
    must still hold exactly its own cells at the end."""
    compacts = real_batches(3 * REUSED_BLOCKS)

    def answer(fields, _):
        epoch, index = fields["epoch"], fields["index"]
        if epoch >= 1:
            return [wire.encode("stream_end", {"epochs": 1})]
        if index >= len(compacts):
            return [
                wire.encode(
                    "epoch_end", {"epoch": 0, "per_rank": len(compacts), "total": len(compacts)}
                )
            ]
        compact = compacts[index]
        batch_fields = {
            "epoch": 0,
            "index": index,
            "window": 0,
            "batch": index,
            "filler": False,
            "binding": wire.binding_to_wire(BINDING),
        }
        return [
            wire.encode(
                "batch", batch_fields | wire.batch_shape(compact), wire.batch_arrays(compact)
            )
        ]

    producer = fake(answer)
    with BatchStream(producer.endpoint, rank=0, world_size=1, timeout=30) as stream:
        kept = [batch.inputs for batch in stream]  # one field is enough to hold the block
        assert len(kept) == len(compacts)
        for inputs, compact in zip(kept, compacts):
            np.testing.assert_array_equal(inputs, compact.expand().inputs)
    with BatchStream(producer.endpoint, rank=0, world_size=1, timeout=30) as stream:
        blocks = {id(batch.inputs.base) for batch in stream}  # each dropped at once
        assert len(blocks) <= 2
