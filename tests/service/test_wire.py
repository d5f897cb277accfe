"""The wire protocol: pinned header bytes, round trips, and every rejection path."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest
import zmq

from streampack import (
    Binding,
    CompactBatch,
    Examples,
    InvalidArray,
    InvalidConfig,
    PackConfig,
    ProtocolError,
    pack_compact,
    pack_examples,
    wire,
)
from streampack.digests import range_digests

BINDING = Binding(vocab_size=266, tokenizer="fixture", split_receipt="r1", partition="train")


WORKED = [[0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]]
WORKED_CONFIG = PackConfig(capacity=6, max_rows_per_batch=2)


def worked_batch():
    """The worked example (A, B, C at capacity 6) as one packed batch."""
    return pack_examples(Examples.from_documents(WORKED), BINDING, WORKED_CONFIG).batches[0]


def worked_compact() -> CompactBatch:
    (compact,) = pack_compact(Examples.from_documents(WORKED), BINDING, WORKED_CONFIG)
    return compact


def test_ready_header_bytes_are_pinned():
    header = wire.encode_header("ready", {"credit": 2, "needs_tokens": False})
    assert header == bytes.fromhex(
        "85"
        "a176"
        "0a"
        "a16b"
        "a5" + b"ready".hex() + "a6" + b"credit".hex() + "02"
        "ac" + b"needs_tokens".hex() + "c2"
        "a166"
        "90"
    )
    assert len(header) == 37


def test_fetch_header_bytes_are_pinned():
    header = wire.encode_header(
        "fetch", {"rank": 1, "world_size": 2, "epoch": 0, "index": 3, "count": 4, "base": 0}
    )
    expected = (
        b"\x89\xa1v\x0a\xa1k\xa5fetch\xa4rank\x01\xaaworld_size\x02"
        b"\xa5epoch\x00\xa5index\x03\xa5count\x04\xa4base\x00\xa1f\x90"
    )
    assert header == expected


def test_data_plane_headers_are_pinned():
    """Version 9: a worker's ``serving`` announcement and a consumer's ``get`` (version
    10 bytes)."""
    assert wire.encode_header("serving", {"endpoint": "tcp://127.0.0.1:7000"}) == (
        b"\x84\xa1v\x0a\xa1k\xa7serving\xa8endpoint\xb4tcp://127.0.0.1:7000\xa1f\x90"
    )
    assert wire.encode_header("get", {"epoch": 1, "window": 2, "batch": 3}) == (
        b"\x86\xa1v\x0a\xa1k\xa3get\xa5epoch\x01\xa6window\x02\xa5batch\x03\xa1f\x90"
    )
    # version 10: a route's digest is the route digest (wire.route_digest), 64 hex digits
    binding = {"vocab_size": 266, "tokenizer": "t", "split_receipt": "r", "partition": "train"}
    route = {
        "epoch": 0,
        "index": 1,
        "window": 0,
        "batch": 1,
        "filler": False,
        "step_targets": -1,
        "binding": binding,
        "rows": 2,
        "capacity": 6,
        "policy": "next_fit",
        "endpoint": "tcp://127.0.0.1:7000",
        "digest": "ab" * 32,
    }
    assert wire.encode_header("route", route) == (
        b"\x8f\xa1v\x0a\xa1k\xa5route\xa5epoch\x00\xa5index\x01\xa6window\x00\xa5batch\x01"
        b"\xa6filler\xc2\xacstep_targets\xff\xa7binding\x84\xaavocab_size\xcd\x01\x0a"
        b"\xa9tokenizer\xa1t\xadsplit_receipt\xa1r\xa9partition\xa5train\xa4rows\x02"
        b"\xa8capacity\x06\xa6policy\xa8next_fit\xa8endpoint\xb4tcp://127.0.0.1:7000"
        b"\xa6digest\xd9\x40" + b"ab" * 32 + b"\xa1f\x90"
    )


def test_route_digest_covers_the_records_and_each_ranges_content_and_is_pinned():
    """Version 10: the digest a route carries is SHA-256 over the occurrence records,
    then each occurrence's content digest (``digests.range_digests``). A consumer
    recomputes it from the frames a worker serves (a part message decoded); one token
    changed, a record changed, a token dtype changed, a mask added or a range dropped
    is another digest (or none at all)."""
    compact = worked_compact()
    tokens = compact.tokens.astype(wire.token_dtype(BINDING.vocab_size))
    arrays = wire.batch_arrays(compact) | {"tokens": tokens}
    lengths = compact.occurrences["range_stop"] - compact.occurrences["range_start"]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    contents = range_digests(tokens, offsets)
    digest = wire.route_digest(compact.occurrences, contents)
    part = wire.decode(wire.encode("part", {"epoch": 0, "window": 0, "batch": 0}, arrays))
    assert wire.frames_digest(part.arrays) == digest
    expected = hashlib.sha256(compact.occurrences.tobytes() + contents.tobytes()).digest()
    assert digest == expected
    assert digest.hex() == "".join(
        [
            "f658496e00b36df4f793938ac436affc",
            "8717ce93e2a1417348db86fb27258489",
        ]
    )
    changed = np.array(tokens)
    changed[0] += 1
    assert wire.frames_digest(arrays | {"tokens": changed}) != digest
    occurrences = np.array(compact.occurrences)
    occurrences["source_id"][0] += 1
    assert wire.frames_digest(arrays | {"occurrences": occurrences}) != digest
    # the same values in another dtype are other bytes on the wire: another digest
    assert wire.frames_digest(arrays | {"tokens": tokens.astype(np.int32)}) != digest
    ones = np.ones(tokens.shape, np.uint8)
    assert wire.frames_digest(arrays | {"mask": ones}) != digest
    # tokens that are not exactly the records' ranges: no digest at all
    assert wire.frames_digest(arrays | {"tokens": tokens[:-1]}) is None
    assert wire.frames_digest(arrays | {"occurrences": compact.occurrences[1:]}) is None


def test_a_route_with_part_frames_gives_the_batch():
    compact = worked_compact()
    fields = {
        "epoch": 0,
        "index": 0,
        "window": 0,
        "batch": 0,
        "filler": False,
        "binding": wire.binding_to_wire(compact.binding),
        "endpoint": "tcp://127.0.0.1:7000",
        "digest": "00" * 32,
    } | wire.batch_shape(compact)
    route = wire.decode(wire.encode("route", fields))
    part = wire.decode(
        wire.encode("part", {"epoch": 0, "window": 0, "batch": 0}, wire.batch_arrays(compact))
    )
    got = wire.compact_batch(route.fields, part.arrays)
    assert got.expand().digest() == compact.expand().digest()
    with pytest.raises(wire.ProtocolError, match="'reroute' message field 'reason'"):
        wire.encode(
            "reroute",
            {
                "rank": 0,
                "world_size": 1,
                "epoch": 0,
                "index": 0,
                "base": 0,
                "endpoint": "",
                "reason": 1,
            },
        )


def test_window_header_lists_frames_with_dtype_and_shape():
    arrays = {
        "tokens": np.arange(5, dtype=np.int32),
        "offsets": np.array([0, 2, 5]),
        "doc": np.arange(2),
        "start": np.zeros(2, np.int64),
        "stop": np.array([2, 3]),
        "piece_start": np.array([0, 130]),
        "source": np.array([0, 1], np.int32),
        "source_id": np.array([7, 8]),
        "example_id": np.array([7, 8]),
        "mask": np.zeros(0, np.uint8),
    }
    fields = {
        "epoch": 0,
        "window": 3,
        "binding": wire.binding_to_wire(BINDING),
        "config": {},
        "with_tokens": True,
    }
    frames = wire.encode("window", fields, arrays)
    header = msgpack.unpackb(frames[0])
    assert header["f"][0] == ["tokens", "<i4", [5]]
    assert header["f"][1] == ["offsets", "<i8", [3]]
    assert header["f"][5:7] == [["piece_start", "<i8", [2]], ["source", "<i4", [2]]]
    assert bytes(frames[1]) == np.arange(5, dtype="<i4").tobytes()
    assert bytes(frames[6]) == bytes.fromhex("00000000000000008200000000000000")
    assert bytes(frames[7]) == bytes.fromhex("0000000001000000")
    message = wire.decode(frames)
    assert message.kind == "window" and message.fields["window"] == 3
    np.testing.assert_array_equal(message.arrays["stop"], [2, 3])
    examples = wire.window_examples(message.arrays)
    assert (examples.piece_start.tolist(), examples.source.tolist()) == ([0, 130], [0, 1])


def batch_fields(compact, **overrides):
    fields = {
        "epoch": 0,
        "index": 0,
        "window": 0,
        "batch": 0,
        "filler": False,
        "binding": wire.binding_to_wire(BINDING),
    } | wire.batch_shape(compact)
    return fields | overrides


def test_batch_travels_compact_and_expands_to_the_packed_batch():
    compact = worked_compact()
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    header = msgpack.unpackb(frames[0])
    assert (header["rows"], header["capacity"]) == (2, 6)
    assert header["f"][0] == ["tokens", "<i4", [12]]
    assert header["f"][1] == ["occurrences", "occurrence", [3]]
    assert bytes(frames[1]) == np.array(sum(WORKED, []), "<i4").tobytes()
    zmq_frames = [zmq.Frame(bytes(f)) for f in frames]
    received = wire.batch_from_message(wire.decode(zmq_frames))
    # The compact arrays are views of the received frames, not copies.
    assert np.shares_memory(received.tokens, np.frombuffer(zmq_frames[1].buffer, np.uint8))
    batch, again = worked_batch(), received.expand()
    assert again.digest() == batch.digest()
    for name in batch.ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(again, name), getattr(batch, name))
    assert again.occurrences.tobytes() == batch.occurrences.tobytes()
    assert again.binding == BINDING
    np.testing.assert_array_equal(
        again.inputs, [[0, 99, 100, 0, 101, -1], [0, 102, 103, 104, -1, -1]]
    )


def test_a_batch_costs_about_four_bytes_per_cell_on_the_wire():
    compact = worked_compact()
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    assert sum(len(bytes(f)) for f in frames[1:]) == 12 * 4 + 3 * 64
    assert worked_batch().stats()["cells"] * 23 == 276


def with_sources(compact: CompactBatch, sources: list[int]) -> CompactBatch:
    occurrences = compact.occurrences.copy()
    occurrences["source"] = sources
    return dataclasses.replace(compact, occurrences=occurrences)


def test_each_occurrences_source_index_travels_in_its_record():
    """The worked batch as if A and C came from mixture source 2 and B from source 0: the
    records' ``source`` survives the wire and the expansion, and labels every cell."""
    compact = with_sources(worked_compact(), [2, 0, 2])
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    assert [spec[0] for spec in msgpack.unpackb(frames[0])["f"]] == [
        "tokens",
        "occurrences",
        "mask",
    ]
    # ordinal (8 bytes), row, start, stop, segment (4 each), then source
    assert bytes(frames[2])[64 + 24 : 64 + 32] == bytes.fromhex("0000000000000000")
    assert bytes(frames[2])[128 + 24 : 128 + 32] == bytes.fromhex("0200000000000000")
    batch = wire.batch_from_message(wire.decode(frames)).expand()
    assert batch.sources.tolist() == [2, 0, 2] and batch.sources.dtype == np.int32
    assert batch.cell_sources().tolist() == [[2, 2, 2, 0, 0, -1], [2, 2, 2, 2, -1, -1]]
    assert worked_batch().sources.tolist() == [0, 0, 0]  # one source: all 0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("source", -1, "source index -1; accepted: 0..2147483647"),
        ("source", 2**31, "source index 2147483648; accepted: 0..2147483647"),
        ("range_start", -3, "range_start -3; accepted: >= 0"),
    ],
)
def test_bad_locations_in_a_batch_are_refused(field, value, match):
    compact = worked_compact()
    occurrences = compact.occurrences.copy()
    occurrences[field][1] = value
    if field == "range_start":
        occurrences["range_stop"][1] = value + 3  # the range keeps its length
    with pytest.raises(InvalidArray, match=match):
        dataclasses.replace(compact, occurrences=occurrences).checked(max_cells=12)
    frames = wire.encode(
        "batch", batch_fields(compact), wire.batch_arrays(compact) | {"occurrences": occurrences}
    )
    with pytest.raises(ProtocolError, match=match):
        wire.batch_from_message(wire.decode(frames))


def test_tokens_of_a_small_vocabulary_travel_as_uint16_and_expand_the_same():
    compact = worked_compact()
    narrow = CompactBatch(
        tokens=compact.tokens.astype(wire.token_dtype(BINDING.vocab_size)),
        occurrences=compact.occurrences,
        rows=compact.rows,
        capacity=compact.capacity,
        binding=BINDING,
    )
    frames = wire.encode("batch", batch_fields(narrow), wire.batch_arrays(narrow))
    assert msgpack.unpackb(frames[0])["f"][0] == ["tokens", "<u2", [12]]
    assert len(bytes(frames[1])) == 12 * 2
    received = wire.batch_from_message(wire.decode(frames))
    assert received.tokens.dtype == np.uint16
    assert received.expand().digest() == worked_batch().digest()
    wide = Binding(vocab_size=70_000, tokenizer="t", split_receipt="r", partition="train")
    assert wire.token_dtype(wide.vocab_size) == np.int32


def window_of(examples: Examples, epoch: int, index: int):
    """The window a producer would send holding exactly ``examples`` (mask included)."""
    from streampack.windows import Window

    return Window(
        epoch=epoch,
        index=index,
        documents=len(examples),
        tokens=examples.tokens,
        offsets=examples.offsets,
        start=examples.start,
        stop=examples.stop,
        source_id=examples.source_id,
        example_id=examples.example_id,
        quarantined=[],
        source_index=examples.source,
        piece_start=examples.piece_start,
        mask=examples.mask,
    )


def test_a_worker_sends_plans_and_the_producer_adds_the_window_tokens():
    """``packed`` carries a window's plans only; the tokens come from the window."""
    from streampack.packing import plan_compact

    examples = Examples.from_documents(WORKED)
    occurrences, sizes = plan_compact(examples, BINDING, WORKED_CONFIG)
    fields = {
        "epoch": 1,
        "window": 2,
        "capacity": 6,
        "seconds": 0.001,
        "audited": 0,
        "audit_failures": 0,
        "audit_error": "",
    }
    packed = wire.decode(
        wire.encode("packed", fields, {"occurrences": occurrences, "batch_sizes": sizes})
    )
    assert list(packed.arrays) == ["occurrences", "batch_sizes"]
    assert packed.arrays["batch_sizes"].tolist() == [3]
    window = window_of(examples, epoch=1, index=2)
    tokens = window.selected_tokens(0, 3)
    np.testing.assert_array_equal(tokens, worked_compact().tokens)
    rebuilt = CompactBatch(
        tokens=tokens, occurrences=packed.arrays["occurrences"], rows=2, capacity=6, binding=BINDING
    )
    assert rebuilt.checked(max_cells=12).expand().digest() == worked_batch().digest()
    np.testing.assert_array_equal(window.selected_tokens(1, 3), WORKED[1] + WORKED[2])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"capacity": 4}, "columns out of range"),
        ({"rows": 3}, "no gap"),
        ({"rows": 1 << 40}, "rows x capacity"),
        ({"filler": True}, "filler exactly when"),
    ],
)
def test_an_inconsistent_batch_message_is_rejected(overrides, match):
    compact = worked_compact()
    frames = wire.encode("batch", batch_fields(compact, **overrides), wire.batch_arrays(compact))
    with pytest.raises(ProtocolError, match=match):
        wire.batch_from_message(wire.decode(frames))


def _header(**overrides):
    header = {"v": wire.PROTOCOL_VERSION, "k": "ready", "credit": 1, "needs_tokens": False, "f": []}
    header.update(overrides)
    return msgpack.packb(header)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "expected a msgpack map"),
        ([_header(v=2)], "protocol version 2 is not supported"),
        ([_header(k="launch")], "unknown message kind 'launch'"),
        ([_header(credit="many")], "field 'credit'"),
        ([_header(credit=True)], "field 'credit'"),
        ([_header(extra=1)], "header keys"),
        ([msgpack.packb({"v": wire.PROTOCOL_VERSION, "k": "ready", "f": []})], "header keys"),
        ([_header(), b"x"], "announces 0 frame"),
        ([b"\x81\xa1v" + b"\xdb" + (1 << 20).to_bytes(4, "big") + b"x" * (1 << 20)], "exceeds"),
        ([_header(f=list(range(1000)))], "not valid msgpack"),
        ([_header(credit=b"\x00" * 10)], "not valid msgpack"),
    ],
)
def test_malformed_headers_are_rejected(frames, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode(frames)


def _window_frames(**spec_overrides):
    arrays = {name: np.zeros(2, np.int64) for name in wire.WINDOW_FRAMES}
    arrays["tokens"] = np.zeros(4, np.int32)
    arrays["mask"] = np.zeros(0, np.uint8)
    fields = {"epoch": 0, "window": 0, "binding": {}, "config": {}, "with_tokens": True}
    frames = wire.encode("window", fields, arrays)
    header = msgpack.unpackb(frames[0])
    for index, spec in spec_overrides.items():
        header["f"][int(index[1:])] = spec
    return [msgpack.packb(header), *[bytes(f) for f in frames[1:]]]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"f0": ["tokens", "<i4", [5]]}, "has 16 bytes; its header says shape"),
        ({"f0": ["tokens", "<f8", [2]]}, "expected 'tokens' with dtype <i4 or <u2"),
        ({"f0": ["tokens", "O", [4]]}, "expected 'tokens' with dtype"),
        ({"f1": ["tokens", "<i8", [2]]}, "expected 'offsets'"),
        ({"f0": ["tokens", "<i4", [2, 2, 1]]}, "at most 2"),
        ({"f0": ["tokens", "<i4", [-4]]}, "non-negative"),
        ({"f0": ["tokens", "<i4", [1 << 40]]}, "exceeds max_frame_bytes"),
        ({"f0": ["tokens", "<i4"]}, "is not \\[name, dtype, shape\\]"),
    ],
)
def test_frames_that_disagree_with_their_header_are_rejected(overrides, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode(_window_frames(**overrides))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"f5": ["piece_start", "<i4", [2]]}, "expected 'piece_start' with dtype <i8"),
        ({"f5": ["piece_start", "<i8", [3]]}, r"'piece_start' has 16 bytes; .* of <i8 = 24"),
        ({"f6": ["source", "<i8", [2]]}, "expected 'source' with dtype <i4"),
        ({"f6": ["source", "<i4", [3]]}, r"'source' has 8 bytes; .* of <i4 = 12 bytes"),
    ],
)
def test_a_location_frame_of_the_wrong_dtype_or_size_is_rejected(overrides, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode(_window_frames(**overrides))


@pytest.mark.parametrize(
    ("frame", "values", "match"),
    [
        ("piece_start", np.zeros(3, np.int64), r"piece_start frame of shape \[3\] for 2 documents"),
        ("piece_start", np.zeros(1, np.int64), r"piece_start frame of shape \[1\] for 2 documents"),
        ("source", np.zeros(0, np.int32), r"source frame of shape \[0\] for 2 documents"),
        ("piece_start", np.array([0, -5]), "piece_start frame holds -5; accepted: >= 0"),
        ("source", np.array([-1, 0], np.int32), "source frame holds -1; accepted: >= 0"),
    ],
)
def test_a_location_frame_that_is_not_one_value_per_document_is_refused(frame, values, match):
    """Self-consistent frames (bytes as the header says) that do not give each document
    one location are refused as malformed, before any packing."""
    arrays = {name: np.zeros(2, np.int64) for name in wire.WINDOW_FRAMES}
    arrays |= {"tokens": np.zeros(4, np.int32), "source": np.zeros(2, np.int32)}
    arrays |= {"mask": np.zeros(0, np.uint8), "offsets": np.array([0, 2, 4]), frame: values}
    arrays["stop"] = np.array([2, 2])
    fields = {"epoch": 0, "window": 0, "binding": {}, "config": {}, "with_tokens": True}
    message = wire.decode(wire.encode("window", fields, arrays))
    with pytest.raises(ProtocolError, match=match):
        wire.check_window_frames(message.arrays)
    with pytest.raises(ProtocolError, match=match):
        wire.window_examples(message.arrays)


def test_limits_are_configurable():
    frames = wire.encode("ready", {"credit": 1, "needs_tokens": False})
    with pytest.raises(ProtocolError, match="max_header_bytes=8"):
        wire.decode(frames, wire.WireLimits(max_header_bytes=8))
    with pytest.raises(ProtocolError, match="must be an int >= 1"):
        wire.WireLimits(max_ndim=0)


def test_encoder_refuses_what_the_decoder_would_refuse():
    with pytest.raises(ProtocolError, match="missing field 'credit'"):
        wire.encode("ready", {})
    with pytest.raises(ProtocolError, match="unknown field"):
        wire.encode("ready", {"credit": 1, "needs_tokens": False, "speed": 2})
    with pytest.raises(ProtocolError, match="unknown message kind"):
        wire.encode("shutdown", {})
    with pytest.raises(ProtocolError, match="frames"):
        wire.encode(
            "ready", {"credit": 1, "needs_tokens": False}, {"tokens": np.zeros(1, np.int32)}
        )


def test_encoding_converts_byte_order_to_little_endian():
    arrays = {name: np.zeros(1, ">i8") for name in wire.WINDOW_FRAMES}
    arrays["tokens"] = np.array([1, 256], dtype=">i4")
    arrays["mask"] = np.zeros(0, np.uint8)
    fields = {"epoch": 0, "window": 0, "binding": {}, "config": {}, "with_tokens": True}
    frames = wire.encode("window", fields, arrays)
    assert bytes(frames[1]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_binding_from_wire_rejects_a_bad_binding():
    with pytest.raises(ProtocolError, match="binding"):
        wire.binding_from_wire({"vocab_size": 4})
    with pytest.raises(ProtocolError, match="invalid"):
        wire.binding_from_wire(
            {"vocab_size": 4, "tokenizer": "t", "split_receipt": "r", "partition": "dev"}
        )


def test_maxmsgsize_is_set_on_sockets():
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    try:
        wire.configure_socket(socket, 12345)
        assert socket.getsockopt(zmq.MAXMSGSIZE) == 12345
        assert socket.getsockopt(zmq.LINGER) == 0
    finally:
        socket.close()
        context.term()


def test_the_policy_that_placed_a_batch_travels_in_its_header():
    """Version 6: the batch header says which PackConfig.policy placed it, and the
    consumer's batch reports it in stats()."""
    config = PackConfig(capacity=6, max_rows_per_batch=2, policy="best_fit", open_rows=2)
    (compact,) = pack_compact(Examples.from_documents(WORKED), BINDING, config)
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    header = frames[0]
    assert msgpack.unpackb(header)["policy"] == "best_fit"
    # ... "capacity": 6, "policy": "best_fit", then "f"
    assert (
        bytes.fromhex(
            "a8" + b"capacity".hex() + "06a6" + b"policy".hex() + "a8" + b"best_fit".hex() + "a166"
        )
        in header
    )
    batch = wire.batch_from_message(wire.decode(frames)).expand()
    assert batch.policy == "best_fit" and batch.stats()["policy"] == "best_fit"
    assert worked_batch().stats()["policy"] == "next_fit"


def test_a_batch_header_with_an_unknown_policy_is_refused():
    compact = worked_compact()
    frames = wire.encode(
        "batch", batch_fields(compact, policy="first_fit"), wire.batch_arrays(compact)
    )
    with pytest.raises(ProtocolError, match="policy 'first_fit'; accepted: 'next_fit'"):
        wire.batch_from_message(wire.decode(frames))


@pytest.mark.parametrize(
    "config",
    [
        PackConfig(capacity=256, max_rows_per_batch=4),
        PackConfig(
            capacity=64, max_rows_per_batch=3, max_cells=128, policy="best_fit", open_rows=5
        ),
    ],
)
def test_a_pack_config_travels_whole_in_a_window_header(config):
    header = msgpack.unpackb(msgpack.packb(config.to_wire()))  # as the header carries it
    assert PackConfig.from_wire(header) == config
    with pytest.raises(ProtocolError, match="window config .* is malformed"):
        PackConfig.from_wire(header | {"rows": 4})
    with pytest.raises(InvalidConfig, match="open_rows"):
        PackConfig.from_wire(header | {"policy": "next_fit", "open_rows": 5})


# -- version 7: the supervision mask travels with the tokens it marks -------------------

WORKED_MASKS = [[0, 0, 1, 1], [1, 0, 1], [0, 1, 0, 1, 1]]


def masked_compact() -> CompactBatch:
    examples = Examples.from_documents(WORKED, masks=WORKED_MASKS)
    (compact,) = pack_compact(examples, BINDING, WORKED_CONFIG)
    return compact


def test_a_masked_batch_sends_one_mask_byte_per_token_and_expands_to_the_packed_batch():
    compact = masked_compact()
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    header = msgpack.unpackb(frames[0])
    assert header["v"] == wire.PROTOCOL_VERSION
    assert header["f"][2] == ["mask", "|u1", [12]]
    assert bytes(frames[3]) == bytes.fromhex("000001010100010001000101")
    received = wire.batch_from_message(wire.decode([zmq.Frame(bytes(f)) for f in frames]))
    assert received.mask.tolist() == sum(WORKED_MASKS, [])
    examples = Examples.from_documents(WORKED, masks=WORKED_MASKS)
    (want,) = pack_examples(examples, BINDING, WORKED_CONFIG).batches
    batch = received.expand()
    assert batch.digest() == want.digest() != worked_batch().digest()
    assert batch.loss_mask.tolist() == [
        [False, True, True, False, True, False],
        [True, False, True, True, False, False],
    ]


def test_an_unmasked_batch_sends_an_empty_mask_frame_and_arrives_unmasked():
    compact = worked_compact()
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    assert msgpack.unpackb(frames[0])["f"][2] == ["mask", "|u1", [0]]
    assert bytes(frames[3]) == b""
    received = wire.batch_from_message(wire.decode(frames))
    assert received.mask is None
    assert received.expand().digest() == worked_batch().digest()


def _masked_batch_frames(mask: np.ndarray, code: str = "|u1") -> list[bytes]:
    compact = masked_compact()
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    header = msgpack.unpackb(frames[0])
    header["f"][2] = ["mask", code, list(mask.shape)]
    return [msgpack.packb(header), *[bytes(f) for f in frames[1:3]], mask.tobytes()]


@pytest.mark.parametrize(
    ("mask", "code", "match"),
    [
        (np.ones(11, np.uint8), "|u1", r"mask frame of shape \[11\] for tokens of shape \[12\]"),
        (np.ones(13, np.uint8), "|u1", r"mask frame of shape \[13\]"),
        (np.full(12, 2, np.uint8), "|u1", "mask frame holds 2 at 0; accepted: 0 or 1"),
        (np.ones(12, "<i4"), "<i4", r"expected 'mask' with dtype \|u1"),
        (np.ones(12, np.bool_), "|b1", r"expected 'mask' with dtype \|u1"),
    ],
)
def test_a_malformed_mask_frame_is_refused_like_any_malformed_message(mask, code, match):
    with pytest.raises(ProtocolError, match=match):
        wire.batch_from_message(wire.decode(_masked_batch_frames(mask, code)))


def test_a_window_carries_its_mask_to_a_worker_that_needs_tokens_only():
    from streampack.wire import window_examples

    examples = Examples.from_documents(WORKED, masks=WORKED_MASKS)
    window = window_of(examples, epoch=0, index=0)
    fields = {"epoch": 0, "window": 0, "binding": {}, "config": {}, "with_tokens": True}
    message = wire.decode(wire.encode("window", fields, window.arrays()))
    assert msgpack.unpackb(wire.encode("window", fields, window.arrays())[0])["f"][9] == [
        "mask",
        "|u1",
        [12],
    ]
    received = window_examples(message.arrays)
    assert received.mask.tolist() == sum(WORKED_MASKS, [])
    unmasked = dataclasses.replace(window, mask=None)
    plain = window_examples(wire.decode(wire.encode("window", fields, unmasked.arrays())).arrays)
    assert plain.mask is None
    short = window.arrays() | {"mask": examples.mask[:5]}
    with pytest.raises(ProtocolError, match=r"mask frame of shape \[5\] for tokens of shape"):
        window_examples(wire.decode(wire.encode("window", fields, short)).arrays)


def test_a_batch_header_carries_its_steps_targets_and_a_bad_count_is_refused():
    compact = dataclasses.replace(masked_compact(), step_targets=40)
    frames = wire.encode("batch", batch_fields(compact), wire.batch_arrays(compact))
    # ... "filler": false, "step_targets": 40, then "binding"
    assert (
        bytes.fromhex("a6" + b"filler".hex() + "c2ac" + b"step_targets".hex() + "28") in (frames[0])
    )
    assert wire.batch_from_message(wire.decode(frames)).expand().step_targets == 40
    unknown = wire.encode("batch", batch_fields(masked_compact()), wire.batch_arrays(compact))
    assert wire.batch_from_message(wire.decode(unknown)).step_targets is None  # sent as -1
    # A step includes the batch: fewer targets than the batch's own 6 is refused.
    short = wire.encode("batch", batch_fields(compact, step_targets=5), wire.batch_arrays(compact))
    with pytest.raises(ProtocolError, match="step_targets 5; accepted: an integer >= .* 6"):
        wire.batch_from_message(wire.decode(short))
