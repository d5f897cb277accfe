"""Arrow IPC files, memory-mapped: the ``data-*.arrow`` files that Hugging Face
``datasets.Dataset.save_to_disk`` writes, or any Arrow IPC file or stream.

A manifest entry names a ``save_to_disk`` directory (``dataset_info.json``,
``state.json`` and the ``data-*.arrow`` files its ``state.json`` lists) or one
``.arrow`` file. Documents are the rows; their tokens are a list column of integers
(``column``, default ``input_ids``). Each record batch's flattened tokens and list
offsets are zero-copy views of the memory map, so documents are read at random.

Supervision (:mod:`streampack.corpus.masks`): ``"mask": "COLUMN"`` names a list column
of 0/1 (or bool) per token, such as TRL's ``completion_mask`` or ``assistant_masks``;
``"labels": "COLUMN"`` a list column of Hugging Face labels (-100 where not trained,
else the token). Either is memory-mapped like the tokens, with its own list offsets:
a row whose mask is not its tokens' length is quarantined (``mask_length``).

A remote Arrow IPC *file* (a URL: :mod:`streampack.corpus.storage`) is read by range,
as a memory map is::

    ARROW1 | schema | batch 0: metadata, body (validity, offsets, values, ...) | ...
           | footer (the batches' places) | footer length | ARROW1

the footer first (the file's last bytes), then each batch's metadata (where its buffers
lie in its body) and the list offsets of the token (and mask) column — exact ranges, a
few hundred bytes each, fetched in parallel and kept beside the node cache as a small index
(:func:`_remote_index`) — and then only the token ranges the windows hold, through the
cache's blocks. A file this does not lay out (compressed buffers, dictionaries, column
types before the tokens it does not count, a bool mask) and an IPC stream (what
``save_to_disk`` writes: no footer to find its batches by) are read whole when the
corpus opens, through the node cache, into memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.masks import MaskSpec, mask_spec
from streampack.corpus.offsets import OffsetsReader, Part, check_offsets
from streampack.corpus.reader import BindingSpec
from streampack.corpus.storage import (
    CorpusPath,
    RemoteArray,
    RemoteFile,
    Url,
    exists,
    index_path,
    load_index,
    read_bytes,
    save_index,
)
from streampack.errors import InvalidConfig

DEFAULT_COLUMN = "input_ids"


def import_pyarrow(what: str) -> Any:
    """``pyarrow``, or a clear error naming the extra that installs it."""
    try:
        import pyarrow
    except ImportError:
        raise InvalidConfig(
            f"reading {what} needs pyarrow; install it with: pip install 'streampack[data]'"
        ) from None
    return pyarrow


def token_list_type(
    pa: Any, field_type: Any, column: str, where: str, what: str = "token ids"
) -> None:
    """Refuse a column that is not a list of integers, naming its type (a mask
    column may also be a list of bool)."""
    is_list = pa.types.is_list(field_type) or pa.types.is_large_list(field_type)
    bools = what == "mask values" and is_list and pa.types.is_boolean(field_type.value_type)
    if not bools and (not is_list or not pa.types.is_integer(field_type.value_type)):
        expected = "list<int32>, list<int64>, list<uint16>, ..."
        if what == "mask values":
            expected = "list<int8>, list<int64>, list<bool>, ... of 0/1"
        raise InvalidConfig(
            f"{where}: column {column!r} has type {field_type}; expected a list of integer "
            f"{what} ({expected})"
        )


def supervision_type(pa: Any, schema: Any, spec: MaskSpec | None, where: str) -> None:
    """Refuse a missing or mistyped mask / labels column, naming it."""
    if spec is None:
        return
    if spec.name not in schema.names:
        raise InvalidConfig(
            f"{where} has no {spec.kind} column {spec.name!r}; its columns are "
            f'{schema.names} (set "{spec.kind}" in the manifest)'
        )
    what = "mask values" if spec.kind == "mask" else "labels"
    token_list_type(pa, schema.field(spec.name).type, spec.name, where, what)


class _Bools:
    """An Arrow boolean array (bit-packed, so not viewable as NumPy) indexed like one:
    each read gives uint8 0/1, and the rest stays in the memory map."""

    def __init__(self, values: Any) -> None:
        self._values = values
        self.dtype = np.dtype(np.uint8)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            chosen = self._values[key]
        else:
            chosen = self._values.take(np.asarray(key, np.int64))
        return chosen.to_numpy(zero_copy_only=False).astype(np.uint8)


def _is_dir(path: CorpusPath) -> bool:
    """A folder: locally, a directory; in a store, a prefix holding ``state.json`` (or
    a ``dataset_dict.json``) and not itself an ``.arrow`` object."""
    if isinstance(path, Url):
        return not path.name.endswith(".arrow") and (
            exists(path / "state.json") or exists(path / "dataset_dict.json")
        )
    return path.is_dir()


def arrow_files(path: CorpusPath) -> list[CorpusPath]:
    """The Arrow files of a manifest entry: a ``save_to_disk`` directory (its
    ``state.json`` order) or one file."""
    if not _is_dir(path):
        return [regular_file(path, "Arrow file")]
    if isinstance(path, Url) and exists(path / "dataset_dict.json"):
        raise InvalidConfig(
            f"{str(path)!r} holds a DatasetDict; name one split's folder, "
            f"e.g. {str(path / 'train')!r}"
        )
    if isinstance(path, Path) and (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise InvalidConfig(
            f"{str(path)!r} holds a DatasetDict (splits {splits}); name one split's "
            f"directory, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    state_path = regular_file(path / "state.json", "datasets state file")
    try:
        state = json.loads(read_bytes(state_path, "datasets state file").decode("utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidConfig(
            f"datasets state file {str(state_path)!r} does not list its data files "
            f'(expected {{"_data_files": [{{"filename": ...}}]}}): {exc!r}'
        ) from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:
            raise InvalidConfig(
                f"{str(state_path)!r} lists data file {name!r}; expected a "
                f"file name inside {str(path)!r}"
            )
        files.append(regular_file(path / name, "Arrow file"))
    if not files:
        raise InvalidConfig(f"{str(state_path)!r} lists no data files: the dataset is empty")
    return files


def _batches(pa: Any, path: CorpusPath) -> tuple[list[Any], np.ndarray]:
    """The record batches of an Arrow IPC file or stream, memory-mapped (a remote one:
    read into memory), and the whole map as bytes (where their buffers lie)."""
    if isinstance(path, Url):
        source = pa.BufferReader(pa.py_buffer(read_bytes(path, "Arrow file")))
    else:
        source = pa.memory_map(str(path), "r")
    whole = np.frombuffer(source.read_buffer(), np.uint8)  # zero-copy: the map itself
    source.seek(0)
    try:
        try:
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)], whole
        except pa.ArrowInvalid:
            source.seek(0)
            return list(pa.ipc.open_stream(source)), whole  # what save_to_disk writes
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidConfig(
            f"Arrow file {str(path)!r} is corrupt or truncated, or not an Arrow IPC file: {exc}"
        ) from None


# --- A remote IPC file by range ---------------------------------------------------------

_MAGIC = b"ARROW1"
_BLOCK = "<qi4xq"  # File.fbs Block: offset, metaDataLength, (padding), bodyLength
_PAIR = "<qq"  # Message.fbs FieldNode (length, null_count) and Buffer (offset, length)


class _Flat:
    """One table of a FlatBuffer (what Arrow's footer and messages are): fields read by
    their index in the schema, every offset checked against the bytes (a hostile file's
    raise ValueError, never read outside them)."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data = data
        self.at = at
        self.vtable = at - self._read("<i", at)
        self.vtable_size = self._read("<H", self.vtable)

    def _read(self, fmt: str, at: int) -> Any:
        if not 0 <= at <= len(self.data) - struct.calcsize(fmt):
            raise ValueError(f"offset {at} lies outside the {len(self.data)}-byte metadata")
        return struct.unpack_from(fmt, self.data, at)[0]

    def _field(self, index: int) -> int:
        slot = 4 + 2 * index
        return 0 if slot >= self.vtable_size else int(self._read("<H", self.vtable + slot))

    def scalar(self, index: int, fmt: str) -> Any:
        found = self._field(index)
        return self._read(fmt, self.at + found) if found else 0

    def table(self, index: int) -> _Flat | None:
        found = self._field(index)
        if not found:
            return None
        return _Flat(self.data, self.at + found + self._read("<I", self.at + found))

    def structs(self, index: int, fmt: str) -> list[tuple[Any, ...]]:
        found = self._field(index)
        if not found:
            return []
        at = self.at + found + self._read("<I", self.at + found)
        count, size = self._read("<I", at), struct.calcsize(fmt)
        if count * size > len(self.data) - at - 4:
            raise ValueError(f"a vector of {count} entries overruns the metadata")
        return [struct.unpack_from(fmt, self.data, at + 4 + k * size) for k in range(count)]


def _root(data: bytes) -> _Flat:
    """The root table of a FlatBuffer."""
    if len(data) < 4:
        raise ValueError(f"{len(data)} bytes of metadata hold no FlatBuffer")
    return _Flat(data, struct.unpack_from("<I", data, 0)[0])


def _layout(pa: Any, kind: Any) -> tuple[int, int] | None:
    """``(field nodes, buffers)`` an IPC record batch holds for a column of type
    ``kind`` (its children included), or None for a type not counted here."""
    t = pa.types
    if t.is_boolean(kind) or t.is_integer(kind) or t.is_floating(kind):
        return 1, 2
    if t.is_temporal(kind) or t.is_fixed_size_binary(kind) or t.is_decimal(kind):
        return 1, 2
    if t.is_string(kind) or t.is_binary(kind) or t.is_large_string(kind):
        return 1, 3
    if t.is_large_binary(kind):
        return 1, 3
    if t.is_list(kind) or t.is_large_list(kind):
        child = _layout(pa, kind.value_type)
        return None if child is None else (1 + child[0], 2 + child[1])
    if t.is_struct(kind):
        total = [1, 1]
        for k in range(kind.num_fields):
            child = _layout(pa, kind.field(k).type)
            if child is None:
                return None
            total = [total[0] + child[0], total[1] + child[1]]
        return total[0], total[1]
    return None


def _column_places(pa: Any, schema: Any, name: str) -> tuple[int, int] | None:
    """Index of ``name``'s list node and of its first buffer in each batch, or None
    when a column before it has a type :func:`_layout` does not count."""
    nodes = buffers = 0
    for field in schema:
        if field.name == name:
            return nodes, buffers
        counted = _layout(pa, field.type)
        if counted is None:
            return None
        nodes, buffers = nodes + counted[0], buffers + counted[1]
    return None


def _remote_index(
    pa: Any, file: RemoteFile, schema: Any, columns: list[str]
) -> dict[str, np.ndarray] | None:
    """For each of ``columns`` (lists of a fixed-width type) in every record batch: the
    list offsets, where its values start in the file and how many there are, and its
    null values — from the footer, each batch's metadata and the offsets buffers, read
    as exact ranges (once per object version: kept in ``DIR/index/``, see
    ``storage.index_path``). None when the file is not laid out so (see module): it
    is read whole then."""
    which = hashlib.sha256("\0".join(columns).encode()).hexdigest()[:16]
    cached = index_path(file.url, "Arrow file", f"arrow-{which}")
    kept = load_index(cached)
    found = None if kept is None else _unpacked(kept, columns)
    if found is not None:
        return found
    tail = file.read(file.size - 10, file.size)
    if file.size < 22 or tail[4:] != _MAGIC:
        return None
    footer_size = struct.unpack("<i", tail[:4])[0]
    if not 0 < footer_size <= file.size - 18:
        return None
    footer = _root(file.read(file.size - 10 - footer_size, file.size - 10))
    if footer.structs(2, _BLOCK):  # dictionary batches: not laid out here
        return None
    batches = footer.structs(3, _BLOCK)
    places = [_column_places(pa, schema, name) for name in columns]
    if not batches or any(p is None for p in places):
        return None
    store = file.store
    metas = store.map([functools.partial(store.fetch, file, b[0], b[0] + b[1]) for b in batches])
    out: dict[str, list[Any]] = {}
    wanted = []
    for (offset, meta_size, _), meta in zip(batches, metas, strict=True):
        body = offset + meta_size
        start = 8 if meta[:4] == b"\xff\xff\xff\xff" else 4
        message = _root(meta[start:])
        header = message.table(2)
        if message.scalar(1, "<B") != 3 or header is None or header.table(3) is not None:
            return None  # not a record batch, or compressed
        nodes, buffers = header.structs(1, _PAIR), header.structs(2, _PAIR)
        for name, (node, first) in zip(columns, places, strict=True):  # type: ignore[misc]
            if node + 1 >= len(nodes) or first + 3 >= len(buffers):
                raise ValueError(f"record batch at {offset} has too few buffers for {name!r}")
            rows, values = nodes[node][0], nodes[node + 1]
            width = 8 if pa.types.is_large_list(schema.field(name).type) else 4
            at, length = buffers[first + 1]
            if length < (rows + 1) * width or body + at + length > file.size:
                raise ValueError(f"record batch at {offset}: {name!r} offsets overrun")
            wanted.append((body + at, body + at + (rows + 1) * width, width))
            out.setdefault(f"{name}.start", []).append(body + buffers[first + 3][0])
            out.setdefault(f"{name}.count", []).append(values[0])
            out.setdefault(f"{name}.nulls", []).append(values[1])
    read = store.map([functools.partial(store.fetch, file, w[0], w[1]) for w in wanted])
    for k, (data, (_, _, width)) in enumerate(zip(read, wanted, strict=True)):
        name = columns[k % len(columns)]
        out.setdefault(f"{name}.offsets", []).append(
            np.frombuffer(data, np.int64 if width == 8 else np.int32).astype(np.int64)
        )
    index: dict[str, np.ndarray] = {}
    for name in columns:
        lists = out.pop(f"{name}.offsets")
        index[f"{name}.bounds"] = np.cumsum([0] + [len(o) for o in lists])
        index[f"{name}.offsets"] = np.concatenate(lists)
    index.update({key: np.asarray(value, np.int64) for key, value in out.items()})
    if cached is not None:
        save_index(cached, _packed(index, columns))
    return index


_KEPT = ("start", "count", "nulls", "bounds", "offsets")  # per column, in this order


def _packed(index: dict[str, np.ndarray], columns: list[str]) -> np.ndarray:
    """``_remote_index``'s arrays as one int64 array (``storage.save_index`` keeps one):
    the batch count, then each column's arrays in ``_KEPT`` order."""
    batches = len(index[f"{columns[0]}.start"])
    return np.concatenate(
        [[batches], *(index[f"{name}.{key}"] for name in columns for key in _KEPT)]
    ).astype(np.int64)


def _unpacked(kept: np.ndarray, columns: list[str]) -> dict[str, np.ndarray] | None:
    """What ``_packed`` wrote; None for an array not of that shape (written otherwise)."""
    batches, at = (int(kept[0]) if len(kept) else -1), 1
    out: dict[str, np.ndarray] = {}
    for name in columns:
        for key in _KEPT:
            size = (
                batches + (key == "bounds") if key != "offsets" else int(out[f"{name}.bounds"][-1])
            )
            if batches < 0 or size < 0 or at + size > len(kept):
                return None
            out[f"{name}.{key}"], at = kept[at : at + size], at + size
    return out if at == len(kept) else None


def _remote_parts(
    pa: Any, path: Url, column: str, label: str, entry: dict[str, Any] | None
) -> list[Part] | None:
    """The parts of a remote Arrow IPC file read by range (module), or None where it is
    read whole."""
    file = RemoteFile(path, "Arrow file")
    if file.size < 16 or file.read(0, 6) != _MAGIC:
        return None  # a stream (save_to_disk), or not Arrow: read whole
    where = f"Arrow file {str(path)!r}"
    try:
        # The schema message after the magic: its length, then it (not a block more).
        prefix = file.read(8, 16)
        size = struct.unpack("<i", prefix[4:] if prefix[:4] == b"\xff" * 4 else prefix[:4])[0]
        schema = pa.ipc.read_schema(pa.py_buffer(file.read(8, 16 + max(0, size))))
    except (pa.ArrowInvalid, OSError, struct.error):
        return None
    spec = mask_spec(entry or {}, where, schema.names)
    if column not in schema.names:
        raise InvalidConfig(
            f"{where} has no column {column!r}; its columns are "
            f'{schema.names} (set "column" in the manifest)'
        )
    token_list_type(pa, schema.field(column).type, column, where)
    columns = [column]
    if spec is not None:
        supervision_type(pa, schema, spec, where)
        if pa.types.is_boolean(schema.field(spec.name).type.value_type):
            return None  # bit-packed: read whole (``_Bools``)
        columns.append(spec.name)
    try:
        index = _remote_index(pa, file, schema, columns)
    except (ValueError, struct.error) as exc:
        raise InvalidConfig(f"{where} is corrupt or truncated: {exc}") from None
    if index is None:
        return None
    parts = []
    dtypes = {
        name: np.dtype(schema.field(name).type.value_type.to_pandas_dtype()) for name in columns
    }
    for number in range(len(index[f"{column}.start"])):
        arrays = {}
        for name in columns:
            lo, hi = index[f"{name}.bounds"][number : number + 2]
            offsets = index[f"{name}.offsets"][lo:hi]
            count = int(index[f"{name}.count"][number])
            start = int(index[f"{name}.start"][number])
            if start + count * dtypes[name].itemsize > file.size:
                raise InvalidConfig(f"{where} is corrupt or truncated: {name!r} values overrun")
            nulls = int(index[f"{name}.nulls"][number])
            if nulls:
                what = "token(s); every token must be an integer"
                if name != column:
                    what = "value(s); every token needs one"
                raise InvalidConfig(f"{where}: column {name!r} holds {nulls} null {what}")
            check_offsets(offsets, count, f"{where} record batch {number}", from_zero=False)
            arrays[name] = (RemoteArray(file, start, dtypes[name], count), offsets)
        part = Part(f"{label}@{number}", *arrays[column])
        if spec is not None:
            part.mask, part.mask_offsets = arrays[spec.name]
            part.mask_kind = spec.kind
        parts.append(part)
    return parts


def open_arrow_file(
    path: CorpusPath, column: str, label: str, entry: dict[str, Any] | None = None
) -> tuple[list[Part], np.ndarray | None]:
    """One part per record batch of the Arrow file at ``path`` (with the supervision
    ``entry``'s ``mask`` / ``labels`` names), and the file's bytes they are views of
    (None: a remote file read by range, its parts' arrays remote)."""
    pa = import_pyarrow("Arrow files")
    where = f"Arrow file {str(path)!r}"
    if isinstance(path, Url):
        ranged = _remote_parts(pa, path, column, label, entry)
        if ranged is not None:
            return ranged, None
    parts = []
    batches, whole = _batches(pa, path)
    spec = mask_spec(entry or {}, where, batches[0].schema.names if batches else [])
    for number, batch in enumerate(batches):
        if column not in batch.schema.names:
            raise InvalidConfig(
                f"{where} has no column {column!r}; its columns are "
                f'{batch.schema.names} (set "column" in the manifest)'
            )
        lists = batch.column(column)
        token_list_type(pa, lists.type, column, where)
        if lists.values.null_count:
            raise InvalidConfig(
                f"{where}: column {column!r} holds {lists.values.null_count} "
                f"null token(s); every token must be an integer"
            )
        offsets = lists.offsets.to_numpy(zero_copy_only=True)
        tokens = lists.values.to_numpy(zero_copy_only=True)
        check_offsets(offsets, len(tokens), f"{where} record batch {number}", from_zero=False)
        part = Part(f"{label}@{number}", tokens, offsets)
        if spec is not None:
            supervision_type(pa, batch.schema, spec, where)
            _add_mask(pa, part, batch.column(spec.name), spec, f"{where} record batch {number}")
        parts.append(part)
    return parts, whole


def _add_mask(pa: Any, part: Part, lists: Any, spec: MaskSpec, where: str) -> None:
    """Give ``part`` the supervision column ``lists`` (zero-copy where NumPy can view it)."""
    if lists.values.null_count:
        raise InvalidConfig(
            f"{where}: {spec.kind} column {spec.name!r} holds {lists.values.null_count} "
            f"null value(s); every token needs one"
        )
    offsets = lists.offsets.to_numpy(zero_copy_only=True)
    check_offsets(offsets, len(lists.values), f"{where} {spec.kind} column", from_zero=False)
    values = lists.values
    part.mask = (
        _Bools(values) if pa.types.is_boolean(values.type) else values.to_numpy(zero_copy_only=True)
    )
    part.mask_offsets = offsets
    part.mask_kind = spec.kind


class ArrowSource(OffsetsReader):
    """Arrow IPC files (``save_to_disk`` directories or single files) in manifest order;
    ``location`` reads ``NAME@BATCH#ROW``."""

    def __init__(
        self,
        paths: list[CorpusPath],
        names: list[str],
        column: str,
        binding: BindingSpec,
        entry: dict[str, Any] | None = None,
    ) -> None:
        parts: list[Part] = []
        files: list[np.ndarray | None] = []
        for path, name in zip(paths, names, strict=True):
            for file in arrow_files(path):
                label = name if file == path else f"{name}/{file.name}"
                file_parts, whole = open_arrow_file(file, column, label, entry)
                parts += file_parts
                files.append(whole)
        # One file: its record batches are read as one (offsets.Flat).
        super().__init__(
            parts, binding, f"Arrow data {names}", whole=files[0] if len(files) == 1 else None
        )
