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

A remote Arrow file (a URL: :mod:`streampack.corpus.storage`) is read whole when the
corpus opens, through the node cache, into memory: an IPC stream (what ``save_to_disk``
writes) has no index of its record batches to read ranges by. Token shards, Megatron
and Parquet read by range.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.masks import MaskSpec, mask_spec
from streampack.corpus.offsets import OffsetsReader, Part, check_offsets
from streampack.corpus.reader import BindingSpec
from streampack.corpus.storage import CorpusPath, Url, exists, read_bytes
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


def open_arrow_file(
    path: CorpusPath, column: str, label: str, entry: dict[str, Any] | None = None
) -> tuple[list[Part], np.ndarray]:
    """One part per record batch of the Arrow file at ``path`` (with the supervision
    ``entry``'s ``mask`` / ``labels`` names), and the file's bytes they are views of."""
    pa = import_pyarrow("Arrow files")
    where = f"Arrow file {str(path)!r}"
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
        files: list[np.ndarray] = []
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
