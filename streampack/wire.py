"""The wire protocol between producer, pack workers and consumers (version 10).

Every message is a ZeroMQ multipart message::

    frame 0      header: one msgpack map, keys in this order
                   "v"  protocol version (int, 10)
                   "k"  kind (str, one of KINDS)
                   ...  the kind's fields, in the order KINDS lists them
                   "f"  one [name, dtype, shape] triple per following frame
    frame 1..n   raw array bytes, C order, little-endian, exactly
                 prod(shape) * itemsize bytes each

For example ``encode_header("ready", {"credit": 2, "needs_tokens": False})`` is these
37 bytes (the tests pin them)::

    85                    map of 5
    a1 76 0a              "v": 10
    a1 6b a5 72 65 61 64 79      "k": "ready"
    a6 63 72 65 64 69 74 02      "credit": 2
    ac 6e 65 65 64 73 5f 74 6f 6b 65 6e 73 c2      "needs_tokens": false
    a1 66 90              "f": []

Kinds and directions (P producer, W pack worker, C consumer or health probe):

    ready      W->P  credit needs_tokens         a worker can take `credit` more windows;
                                                 it needs their tokens (to audit) or not
    heartbeat  W->P  free needs_tokens           liveness; re-registers after a producer
                                                 restart
    window     P->W  epoch window binding config with_tokens
                                                 frames: tokens offsets doc start stop
                                                 piece_start source source_id example_id
                                                 mask (tokens and mask empty unless
                                                 with_tokens: planning needs only ranges;
                                                 `piece_start`, int64, and `source`,
                                                 int32, per document, version 8: what
                                                 the occurrence records carry to locate
                                                 each document in the corpus)
    packed     W->P  epoch window capacity seconds audited audit_failures audit_error
                                                 frames: occurrences batch_sizes (the plans
                                                 of all the window's batches: records in
                                                 order, records per batch; the producer
                                                 takes the tokens from its own window)
    failed     W->P  epoch window error          packing raised; the window goes to another
                                                 worker (quarantined once MAX_LOSSES proven
                                                 workers lost it: service/registry.py)
    fetch      C->P  rank world_size epoch index count base
                                                 ask for global batches `index`, `index +
                                                 world_size`, ... (`count` of them) of `epoch`;
                                                 this rank's share of the epoch is `base +
                                                 rank`, `base + rank + world_size`, ...
                                                 (`base` is 0 except in the epoch an elastic
                                                 resume continues: see client.resume_cursor)
    batch      P->C  epoch index window batch filler step_targets binding rows
                                                 capacity policy
                                                 (`policy`: the PackConfig.policy that
                                                 placed the batch, version 6;
                                                 `step_targets`: the loss-eligible
                                                 targets of the batch's optimizer step
                                                 for the asking rank's world size, -1
                                                 unknown, version 7)
                                                 frames: tokens occurrences mask
                                                 (a compact batch: the selected tokens,
                                                 occurrence records, which name each
                                                 occurrence's source since version 8,
                                                 and the tokens' supervision mask,
                                                 version 7)
    route      P->C  epoch index window batch filler step_targets binding rows
                                                 capacity policy endpoint digest
                                                 (version 9, data_plane = "workers") a
                                                 `batch` without its frames: the worker at
                                                 `endpoint` holds them as batch `batch` of
                                                 `window`; `digest` is the hex route digest
                                                 of its frames (``route_digest``, version
                                                 10: over the occurrence records and each
                                                 range's content digest), which the
                                                 producer computes from its window
    reroute    C->P  rank world_size epoch index base endpoint reason
                                                 (version 9) send batch `index` itself: the
                                                 route to `endpoint` failed (`reason`:
                                                 "digest" - the frames did not match,
                                                 "missing", "timeout" or "rejected")
    epoch_end  P->C  epoch per_rank total        `index` is past this rank's share
    stream_end P->C  epochs                      no more epochs
    serving    W->P  endpoint                    this worker serves the batches of the windows
                                                 it packs with their tokens to consumers at
                                                 `endpoint` (version 9; see service/store.py)
    get        C->W  epoch window batch          the batch `batch` of window `window` of
                                                 `epoch`, from a worker that serves (version 9)
    part       W->C  epoch window batch          the answer to `get`: frames tokens occurrences
                                                 mask, the compact batch's frames as in
                                                 `batch`; the consumer checks them against
                                                 the producer's digest (``frames_digest``)
    missing    W->C  epoch window batch          this worker does not hold that batch (never
                                                 held, already delivered, expired or dropped
                                                 for room)
    health     C->P  (none)                      are you serving?
    status     P->C  serving stats               answer to `health`
    error      any   message                     the message received was rejected

A ``mask`` frame (version 7) is the supervision mask of the message's ``tokens``
(rule C5): uint8, one 0 or 1 per token, or empty when the corpus has no mask (a real
batch always has tokens, so empty cannot be mistaken for a mask). A mask of another
length, or a value other than 0/1, is refused like any malformed message; so is a
window's ``piece_start`` or ``source`` frame that is not one value >= 0 per document
(``check_window_frames``).

Frame dtypes come from a fixed short list per frame name (``FRAME_DTYPES``: tokens may
be int32, or uint16 when the vocabulary fits); a receiver never builds a
dtype from a string it was sent. A receiver rejects (``ProtocolError``) an unknown
version or kind, a missing, extra or mistyped field, a frame list that disagrees with
the header, a frame whose size disagrees with its shape, and anything over its
``WireLimits``, and a compact batch that ``CompactBatch.checked`` refuses. ``pickle``
is never used. Arrays decoded from ``zmq.Frame`` objects
share the frame's memory (no copy) and are read-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import numpy as np

from streampack.batch import OCCURRENCE_DTYPE, CompactBatch
from streampack.digests import range_digests
from streampack.errors import InvalidArray, InvalidConfig, ProtocolError
from streampack.examples import Binding, Examples

if TYPE_CHECKING:
    import zmq

PROTOCOL_VERSION = 10

_INT = "int"
_STR = "str"
_BOOL = "bool"
_MAP = "map"
_FLOAT = "float"

# A batch travels compact (``streampack.CompactBatch``): its occurrence records and the
# selected tokens, 2 to 4 bytes per cell; the receiver expands it into the 23 bytes per
# cell of a ``PackedBatch``. From a worker only the plans travel, a whole window's in
# one message: the producer cut the window, so it already holds every token a plan
# selects (version 3; version 2 sent the tokens back, batch by batch, as well — a third
# of all the bytes the producer moved, and a message per batch). Nor does a window carry
# its tokens to a worker that only plans (version 4): next-fit needs the ranges alone,
# and the tokens were half the bytes of a window message and a copy in the worker.
# The supervision mask (version 7) travels with the tokens it marks, one byte a token,
# and only with them: a worker that only plans needs neither. Since version 8 the
# occurrence records locate every occurrence in the corpus (its source, and its range
# in document coordinates): a window carries each document's source and piece start,
# and the batch's separate per-occurrence ``sources`` frame is gone.
# Version 9 adds the data plane's messages: a worker that serves announces its consumer
# endpoint (``serving``), and a consumer fetches a batch's frames from it (``get``,
# answered ``part`` or ``missing``).
BATCH_FRAMES = ("tokens", "occurrences", "mask")
PLAN_FRAMES = ("occurrences", "batch_sizes")
WINDOW_FRAMES = (
    "tokens",
    "offsets",
    "doc",
    "start",
    "stop",
    "piece_start",
    "source",
    "source_id",
    "example_id",
    "mask",
)

# Which batch a worker serves: the window's own numbering, which the worker knows.
_PART_KEY = (("epoch", _INT), ("window", _INT), ("batch", _INT))

_BATCH_FIELDS = (
    ("epoch", _INT),
    ("index", _INT),
    ("window", _INT),
    ("batch", _INT),
    ("filler", _BOOL),
    ("step_targets", _INT),
    ("binding", _MAP),
    ("rows", _INT),
    ("capacity", _INT),
    ("policy", _STR),
)
#: The reasons a consumer gives in ``reroute``.
REROUTE_REASONS = ("digest", "missing", "timeout", "rejected")

# kind -> (fields in order with their types, frame names in order)
KINDS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "ready": ((("credit", _INT), ("needs_tokens", _BOOL)), ()),
    "heartbeat": ((("free", _INT), ("needs_tokens", _BOOL)), ()),
    "window": (
        (
            ("epoch", _INT),
            ("window", _INT),
            ("binding", _MAP),
            ("config", _MAP),
            ("with_tokens", _BOOL),
        ),
        WINDOW_FRAMES,
    ),
    "packed": (
        (
            ("epoch", _INT),
            ("window", _INT),
            ("capacity", _INT),
            ("seconds", _FLOAT),
            ("audited", _INT),
            ("audit_failures", _INT),
            ("audit_error", _STR),
        ),
        PLAN_FRAMES,
    ),
    "failed": ((("epoch", _INT), ("window", _INT), ("error", _STR)), ()),
    "fetch": (
        (
            ("rank", _INT),
            ("world_size", _INT),
            ("epoch", _INT),
            ("index", _INT),
            ("count", _INT),
            ("base", _INT),
        ),
        (),
    ),
    "batch": (_BATCH_FIELDS, BATCH_FRAMES),
    "route": (
        (
            *_BATCH_FIELDS,
            ("endpoint", _STR),
            ("digest", _STR),
        ),
        (),
    ),
    "reroute": (
        (
            ("rank", _INT),
            ("world_size", _INT),
            ("epoch", _INT),
            ("index", _INT),
            ("base", _INT),
            ("endpoint", _STR),
            ("reason", _STR),
        ),
        (),
    ),
    "epoch_end": ((("epoch", _INT), ("per_rank", _INT), ("total", _INT)), ()),
    "stream_end": ((("epochs", _INT),), ()),
    "serving": ((("endpoint", _STR),), ()),
    "get": (_PART_KEY, ()),
    "part": (_PART_KEY, BATCH_FRAMES),
    "missing": (_PART_KEY, ()),
    "health": ((), ()),
    "status": ((("serving", _BOOL), ("stats", _MAP)), ()),
    "error": ((("message", _STR),), ()),
}

_MAX_FRAMES = max(len(frames) for _, frames in KINDS.values())

# The dtypes each frame may have; the first is what ``encode`` converts other arrays to.
# Tokens travel as uint16 when the vocabulary fits (``token_dtype``): half the bytes.
FRAME_DTYPES: dict[str, tuple[str, ...]] = {
    "tokens": ("<i4", "<u2"),
    "offsets": ("<i8",),
    "doc": ("<i8",),
    "start": ("<i8",),
    "stop": ("<i8",),
    "piece_start": ("<i8",),
    "source": ("<i4",),
    "source_id": ("<i8",),
    "example_id": ("<i8",),
    "occurrences": ("occurrence",),
    "batch_sizes": ("<i8",),
    "mask": ("|u1",),
}

#: The ``mask`` frame of a message without one.
NO_MASK = np.zeros(0, np.uint8)


def _occurrence_dtype() -> np.dtype:
    return np.dtype(OCCURRENCE_DTYPE).newbyteorder("<")


_DTYPE_CACHE: dict[str, np.dtype] = {}


def frame_dtype(code: str) -> np.dtype:
    """The dtype of a frame dtype code of ``FRAME_DTYPES`` (never any other string)."""
    dtype = _DTYPE_CACHE.get(code)
    if dtype is None:
        dtype = _occurrence_dtype() if code == "occurrence" else np.dtype(code)
        _DTYPE_CACHE[code] = dtype
    return dtype


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest frame dtype of tokens in ``0..vocab_size-1``: uint16 when the
    vocabulary fits, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireLimits:
    """What a receiver accepts. Larger messages are rejected before they are parsed."""

    max_header_bytes: int = 1 << 16
    max_frame_bytes: int = 256 << 20
    max_message_bytes: int = 256 << 20  # all frames of one message together
    max_ndim: int = 2
    max_str_len: int = 1 << 14
    max_container_len: int = 256

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProtocolError(f"WireLimits.{field.name} = {value!r} must be an int >= 1")


DEFAULT_LIMITS = WireLimits()


@dataclasses.dataclass
class Message:
    """A decoded message: its kind, header fields and named arrays (frame order)."""

    kind: str
    fields: dict[str, Any]
    arrays: dict[str, np.ndarray]


# Exact Python types, as msgpack decodes them (a bool is not an int here).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    _INT: (int,),
    _STR: (str,),
    _BOOL: (bool,),
    _MAP: (dict,),
    _FLOAT: (int, float),
}
# Per kind: every header key, and (name, accepted types) per field, for decode's loop.
_HEADER_KEYS = {
    kind: frozenset({"v", "k", "f", *(name for name, _ in schema)})
    for kind, (schema, _) in KINDS.items()
}
_FIELD_CHECKS = {
    kind: tuple((name, _FIELD_TYPES[kind_of]) for name, kind_of in schema)
    for kind, (schema, _) in KINDS.items()
}


def _check_field(kind: str, name: str, kind_of: str, value: Any) -> None:
    if type(value) not in _FIELD_TYPES[kind_of]:
        raise ProtocolError(
            f"{kind!r} message field {name!r} = {value!r} has type "
            f"{type(value).__name__}; expected {kind_of}"
        )


def encode_header(
    kind: str,
    fields: Mapping[str, Any] | None = None,
    specs: Sequence[tuple[str, str, Sequence[int]]] = (),
) -> bytes:
    """The msgpack header of a ``kind`` message with ``fields`` and frame ``specs``."""
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {sorted(KINDS)}")
    schema, frame_names = KINDS[kind]
    fields = dict(fields or {})
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": kind}
    for name, kind_of in schema:
        if name not in fields:
            raise ProtocolError(f"{kind!r} message is missing field {name!r}")
        value = fields.pop(name)
        _check_field(kind, name, kind_of, value)
        header[name] = value
    if fields:
        raise ProtocolError(f"{kind!r} message has unknown field(s) {sorted(fields)}")
    names = tuple(spec[0] for spec in specs)
    if names != frame_names:
        raise ProtocolError(f"{kind!r} message frames {names}; expected {frame_names}")
    header["f"] = [[name, code, [int(n) for n in shape]] for name, code, shape in specs]
    return msgpack.packb(header, use_bin_type=True)


def _wire_array(name: str, array: Any) -> tuple[str, np.ndarray]:
    """Frame ``name``'s dtype code and ``array`` as it travels: in that dtype, C order."""
    if name not in FRAME_DTYPES:
        raise ProtocolError(f"unknown frame name {name!r}; expected one of {list(FRAME_DTYPES)}")
    array = np.asarray(array)
    codes = FRAME_DTYPES[name]
    code = next((c for c in codes if frame_dtype(c) == array.dtype), codes[0])
    dtype = frame_dtype(code)
    if array.dtype != dtype:
        if array.dtype.names is not None or dtype.names is not None:
            if array.dtype.names != dtype.names:
                raise ProtocolError(
                    f"frame {name!r} has fields {array.dtype.names}; expected {dtype.names}"
                )
        array = array.astype(dtype)
    return code, np.ascontiguousarray(array)


def encode(
    kind: str, fields: Mapping[str, Any] | None = None, arrays: Mapping[str, Any] | None = None
) -> list[Any]:
    """Header plus array frames, ready for ``socket.send_multipart(..., copy=False)``.

    Arrays already in the protocol dtype and C order are sent without a copy.
    """
    specs = []
    frames: list[Any] = []
    for name, array in (arrays or {}).items():
        code, array = _wire_array(name, array)
        specs.append((name, code, array.shape))
        frames.append(array.data.cast("B") if array.size else b"")
    return [encode_header(kind, fields, specs), *frames]


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    if buffer is None:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not bytes-like")
    return buffer


def decode(frames: Sequence[Any], limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """Parse and check one message; any defect raises :class:`ProtocolError`."""
    buffers = _sized_buffers(frames, limits)
    header = _parse_header(buffers[0], limits)
    kind, fields = _header_fields(header)
    _, frame_names = KINDS[kind]
    specs = header["f"]
    if not isinstance(specs, list) or len(specs) != len(frame_names):
        raise ProtocolError(f"{kind!r} header lists frames {specs!r}; expected {frame_names}")
    if len(frames) - 1 != len(specs):
        raise ProtocolError(
            f"{kind!r} header announces {len(specs)} frame(s) but {len(frames) - 1} arrived"
        )
    arrays = {
        name: _frame_array(spec, name, buffer, limits)
        for spec, name, buffer in zip(specs, frame_names, buffers[1:])
    }
    return Message(kind=kind, fields=fields, arrays=arrays)


def _sized_buffers(frames: Sequence[Any], limits: WireLimits) -> list[memoryview]:
    """The frames' buffers, once their count and sizes are within ``limits`` — checked
    before anything is parsed."""
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    if len(frames) > 1 + _MAX_FRAMES:
        raise ProtocolError(
            f"message of {len(frames)} frames; no kind has more than {_MAX_FRAMES} array frames"
        )
    buffers = [_buffer(frame) for frame in frames]
    total = sum(buffer.nbytes for buffer in buffers)
    if total > limits.max_message_bytes:
        raise ProtocolError(
            f"message of {total} bytes in {len(frames)} frames exceeds "
            f"max_message_bytes={limits.max_message_bytes}"
        )
    if buffers[0].nbytes > limits.max_header_bytes:
        raise ProtocolError(
            f"header of {buffers[0].nbytes} bytes exceeds "
            f"max_header_bytes={limits.max_header_bytes}"
        )
    return buffers


def _parse_header(head: memoryview, limits: WireLimits) -> dict[str, Any]:
    """The header frame as a msgpack map of this protocol version, within ``limits``."""
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=limits.max_container_len,
            max_map_len=limits.max_container_len,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack within limits: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}; expected a msgpack map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported; expected {PROTOCOL_VERSION}"
        )
    return header


def _header_fields(header: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The message kind and its fields, each of its schema's type, no key missing or extra."""
    kind = header.get("k")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {sorted(KINDS)}")
    schema, _ = KINDS[kind]
    expected_keys = _HEADER_KEYS[kind]
    if header.keys() != expected_keys:
        raise ProtocolError(
            f"{kind!r} header keys {sorted(header)}; expected {sorted(expected_keys)}"
        )
    fields = {}
    for name, types in _FIELD_CHECKS[kind]:
        value = fields[name] = header[name]
        if type(value) not in types:
            _check_field(kind, name, dict(schema)[name], value)  # raises, naming the field
    return kind, fields


def _frame_array(spec: Any, expected_name: str, buffer: memoryview, limits: WireLimits) -> Any:
    """The read-only array of one frame, once its spec names the expected frame with an
    accepted dtype and a shape within ``limits`` that its bytes fill exactly."""
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ProtocolError(f"frame spec {spec!r} is not [name, dtype, shape]")
    name, code, shape = spec
    if name != expected_name or code not in FRAME_DTYPES[expected_name]:
        raise ProtocolError(
            f"frame {name!r} with dtype {code!r}; expected {expected_name!r} with dtype "
            f"{' or '.join(FRAME_DTYPES[expected_name])}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ProtocolError(
            f"frame {name!r} shape {shape!r} must be at most {limits.max_ndim} non-negative ints"
        )
    dtype = frame_dtype(code)
    expected = dtype.itemsize
    for n in shape:
        expected *= n
        if expected > limits.max_frame_bytes:
            raise ProtocolError(
                f"frame {name!r} shape {shape} exceeds max_frame_bytes={limits.max_frame_bytes}"
            )
    if buffer.nbytes != expected:
        raise ProtocolError(
            f"frame {name!r} has {buffer.nbytes} bytes; its header says shape {shape} "
            f"of {code} = {expected} bytes"
        )
    array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    array.flags.writeable = False  # the frame's memory, maybe shared: never edit it
    return array


# --- batches ------------------------------------------------------------------------


def binding_to_wire(binding: Binding) -> dict[str, Any]:
    return {
        "vocab_size": int(binding.vocab_size),
        "tokenizer": str(binding.tokenizer),
        "split_receipt": str(binding.split_receipt),
        "partition": str(binding.partition),
    }


def binding_from_wire(data: Mapping[str, Any]) -> Binding:
    try:
        return Binding(
            vocab_size=data["vocab_size"],
            tokenizer=data["tokenizer"],
            split_receipt=data["split_receipt"],
            partition=data["partition"],
        )
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"binding {dict(data)!r} is malformed: {exc}") from None
    except ValueError as exc:
        raise ProtocolError(f"binding {dict(data)!r} is invalid: {exc}") from None


def batch_arrays(batch: CompactBatch) -> dict[str, np.ndarray]:
    """The frames of a ``CompactBatch`` in protocol order."""
    return {
        "tokens": batch.tokens,
        "occurrences": batch.occurrences,
        "mask": NO_MASK if batch.mask is None else batch.mask,
    }


def route_digest(occurrences: np.ndarray, contents: np.ndarray) -> bytes:
    """A routed batch's digest (version 10): SHA-256 over its occurrence records as they
    travel, then the content digest (``digests.range_digests``) of each occurrence's
    range, in order.

    The records say where every token goes and which document range it must be; the
    content digests say what those tokens and their mask are. The producer computes the
    content digests from its window (no batch gathered), a consumer from the frames a
    worker served (``frames_digest``); the rest of what it yields (rows, capacity,
    policy, step targets, binding, filler) comes from the producer's route itself.
    SHA-256 throughout because a worker holds the data it serves: it could steer a keyed
    or polynomial hash whose key it must be given, not this one.
    """
    records = np.ascontiguousarray(occurrences, OCCURRENCE_DTYPE.newbyteorder("<"))
    digest = hashlib.sha256(records.data.cast("B") if records.size else b"")
    digest.update(np.ascontiguousarray(contents, np.uint8).data.cast("B"))
    return digest.digest()


def frames_digest(arrays: Mapping[str, np.ndarray]) -> bytes | None:
    """``route_digest`` of a compact batch's frames (``BATCH_FRAMES``) as a worker served
    them: its tokens must be exactly its occurrences' ranges laid end to end (else None:
    no digest can match), hashed in the dtype they came in, with the mask when one came."""
    occurrences, tokens, mask = arrays["occurrences"], arrays["tokens"], arrays["mask"]
    if occurrences.dtype != OCCURRENCE_DTYPE or occurrences.ndim != 1:
        return None
    lengths = occurrences["range_stop"] - occurrences["range_start"]
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] != tokens.size:
        return None
    try:
        contents = range_digests(tokens, offsets, mask if mask.size else None)
    except ValueError:  # a dtype, a shape or a range no producer sends
        return None
    return route_digest(occurrences, contents)


def mask_from_frames(arrays: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The supervision mask of a message's ``tokens``: None for an empty ``mask`` frame,
    else the frame, which must hold one 0/1 per token (``ProtocolError`` otherwise)."""
    mask, tokens = arrays["mask"], arrays["tokens"]
    if mask.size == 0:
        return None
    if mask.shape != tokens.shape:
        raise ProtocolError(
            f"mask frame of shape {list(mask.shape)} for tokens of shape {list(tokens.shape)}; "
            "expected one 0/1 per token, or an empty frame for no mask"
        )
    if int(mask.max()) > 1:
        at = int(np.flatnonzero(mask > 1)[0])
        raise ProtocolError(f"mask frame holds {int(mask[at])} at {at}; accepted: 0 or 1")
    return mask


def check_window_frames(arrays: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """Refuse (``ProtocolError``) a window whose ``piece_start`` or ``source`` frame is
    not one value per document (as ``start``), a negative one of them, or a malformed
    mask; returns the mask (``mask_from_frames``)."""
    documents = arrays["start"].shape
    for name in ("piece_start", "source"):
        frame = arrays[name]
        if frame.shape != documents:
            raise ProtocolError(
                f"{name} frame of shape {list(frame.shape)} for {documents[0]} documents; "
                "expected one value per document"
            )
        if frame.size and int(frame.min()) < 0:
            raise ProtocolError(f"{name} frame holds {int(frame.min())}; accepted: >= 0")
    return mask_from_frames(arrays)


def window_examples(arrays: Mapping[str, np.ndarray]) -> Examples:
    """The examples of one window's frames (validated by ``Examples``), with the
    window's supervision mask when it has one (an empty ``mask`` frame: none)."""
    mask = check_window_frames(arrays)
    return Examples(
        tokens=arrays["tokens"],
        offsets=arrays["offsets"],
        doc=arrays["doc"],
        start=arrays["start"],
        stop=arrays["stop"],
        source_id=arrays["source_id"],
        example_id=arrays["example_id"],
        mask=mask,
        source=arrays["source"],
        piece_start=arrays["piece_start"],
    )


class Shaped(Protocol):
    """What ``batch_shape`` reads: a ``CompactBatch``, or a batch the producer holds
    as its plan (``service/planned.py``)."""

    @property
    def rows(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def step_targets(self) -> int | None: ...


def batch_shape(batch: Shaped) -> dict[str, int | str]:
    """The header fields that say how to expand a ``CompactBatch``, which placement
    policy made it, and its step's targets (-1: unknown)."""
    step = -1 if batch.step_targets is None else batch.step_targets
    return {
        "step_targets": step,
        "rows": batch.rows,
        "capacity": batch.capacity,
        "policy": batch.policy,
    }


def batch_from_message(message: Message, limits: WireLimits = DEFAULT_LIMITS) -> CompactBatch:
    """The checked ``CompactBatch`` of a ``batch`` message (arrays share the frames).

    A batch whose expanded int32 arrays would not fit one frame is refused, so a hostile
    header cannot make the receiver allocate without bound.
    """
    if message.kind != "batch":
        raise ProtocolError(f"expected a 'batch' message, got {message.kind!r}")
    return compact_batch(message.fields, message.arrays, limits)


def compact_batch(
    f: Mapping[str, Any], arrays: Mapping[str, np.ndarray], limits: WireLimits = DEFAULT_LIMITS
) -> CompactBatch:
    """The checked ``CompactBatch`` of a batch's header fields (``batch`` or ``route``)
    and its frames (of the ``batch`` message, or of the ``part`` a worker served)."""
    try:
        return CompactBatch(
            tokens=arrays["tokens"],
            occurrences=arrays["occurrences"],
            rows=f["rows"],
            capacity=f["capacity"],
            binding=binding_from_wire(f["binding"]),
            filler=f["filler"],
            policy=f["policy"],
            mask=mask_from_frames(arrays),
            step_targets=None if f["step_targets"] == -1 else f["step_targets"],
        ).checked(max_cells=limits.max_frame_bytes // 4)
    except InvalidArray as exc:
        raise ProtocolError(str(exc)) from None


def curve_server(socket: zmq.Socket, secret_key: bytes) -> None:
    """Make ``socket`` (before bind) a CURVE server with this Z85 secret key."""
    import zmq

    socket.curve_secretkey = secret_key
    socket.curve_publickey = zmq.curve_public(secret_key)
    socket.curve_server = True


def curve_client(socket: zmq.Socket, server_key: str | bytes) -> None:
    """Make ``socket`` (before connect) a CURVE client of the server with this public key;
    the client's own key pair is fresh for each socket."""
    import zmq

    public, secret = zmq.curve_keypair()
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key


def configure_socket(socket: zmq.Socket, max_message_bytes: int) -> None:
    """Receive limit on every socket, and no lingering on close (shutdown stays fast)."""
    import zmq

    socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    socket.setsockopt(zmq.LINGER, 0)


def attach(socket: Any, endpoint: str, *, field: str, bind: bool) -> None:
    """Bind ``socket`` to, or connect it to, ``endpoint`` (the setting ``field``).

    ZeroMQ's refusal (a port in use, an address no interface has) becomes one
    :class:`InvalidConfig` line naming the setting; the socket is then closed, so that
    terminating its context cannot wait on it.
    """
    import zmq

    try:
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        hint = (
            "; choose a free port or stop the process using it"
            if exc.errno == zmq.EADDRINUSE
            else ""
        )
        verb = "bind" if bind else "connect to"
        raise InvalidConfig(
            f"{field} = {endpoint!r}: cannot {verb} it: {zmq.strerror(exc.errno or 0)}{hint}"
        ) from None
