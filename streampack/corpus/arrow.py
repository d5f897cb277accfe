"""Arrow IPC files, memory-mapped: the ``data-*.arrow`` files that Hugging Face
``datasets.Dataset.save_to_disk`` writes, or any Arrow IPC file or stream.

A manifest entry names a ``save_to_disk`` directory (``dataset_info.json``,
``state.json`` and the ``data-*.arrow`` files its ``state.json`` lists) or one
``.arrow`` file. Documents are the rows; their tokens are a list column of integers
(``column``, default ``input_ids``). Each record batch's flattened tokens and list
offsets are zero-copy views of the memory map, so documents are read at random.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streampack.corpus.files import regular_file
from streampack.corpus.offsets import OffsetsReader, Part, check_offsets
from streampack.corpus.reader import BindingSpec
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


def token_list_type(pa: Any, field_type: Any, column: str, where: str) -> None:
    """Refuse a column that is not a list of integers, naming its type."""
    is_list = pa.types.is_list(field_type) or pa.types.is_large_list(field_type)
    if not is_list or not pa.types.is_integer(field_type.value_type):
        raise InvalidConfig(
            f"{where}: column {column!r} has type {field_type}; expected a list of integer "
            f"token ids (list<int32>, list<int64>, list<uint16>, ...)"
        )


def arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a manifest entry: a ``save_to_disk`` directory (its
    ``state.json`` order) or one file."""
    if not path.is_dir():
        return [regular_file(path, "Arrow file")]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise InvalidConfig(
            f"{str(path)!r} holds a DatasetDict (splits {splits}); name one split's "
            f"directory, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    state_path = regular_file(path / "state.json", "datasets state file")
    try:
        state = json.loads(state_path.read_bytes().decode("utf-8"))
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


def _batches(pa: Any, path: Path) -> list[Any]:
    """The record batches of an Arrow IPC file or stream, memory-mapped."""
    source = pa.memory_map(str(path), "r")
    try:
        try:
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except pa.ArrowInvalid:
            source.seek(0)
            return list(pa.ipc.open_stream(source))  # what save_to_disk writes
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidConfig(
            f"Arrow file {str(path)!r} is corrupt or truncated, or not an Arrow IPC file: {exc}"
        ) from None


def open_arrow_file(path: Path, column: str, label: str) -> list[Part]:
    """One part per record batch of the Arrow file at ``path``."""
    pa = import_pyarrow("Arrow files")
    where = f"Arrow file {str(path)!r}"
    parts = []
    for number, batch in enumerate(_batches(pa, path)):
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
        parts.append(Part(f"{label}@{number}", tokens, offsets))
    return parts


class ArrowSource(OffsetsReader):
    """Arrow IPC files (``save_to_disk`` directories or single files) in manifest order;
    ``location`` reads ``NAME@BATCH#ROW``."""

    def __init__(
        self, paths: list[Path], names: list[str], column: str, binding: BindingSpec
    ) -> None:
        parts: list[Part] = []
        for path, name in zip(paths, names, strict=True):
            for file in arrow_files(path):
                label = name if file == path else f"{name}/{file.name}"
                parts += open_arrow_file(file, column, label)
        super().__init__(parts, binding, f"Arrow data {names}")
