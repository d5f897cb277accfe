"""Parquet files, streamed one row group at a time.

Documents are the rows; their tokens are a list column of integers (``column``,
default ``input_ids``). Parquet pages are compressed and decoded a row group at a
time, so a document cannot be read alone cheaply: a Parquet corpus is a *sequential*
reader (a shuffled epoch goes through the seeded shuffle buffer, like JSON Lines), and
memory holds one row group plus the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.arrow import import_pyarrow, token_list_type
from streampack.corpus.files import regular_file
from streampack.corpus.reader import BindingSpec, Record, SingleSource
from streampack.errors import InvalidConfig


def _open(pq: Any, pa: Any, path: Path) -> Any:
    try:
        return pq.ParquetFile(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidConfig(
            f"Parquet file {str(path)!r} is corrupt or truncated, or not a Parquet file: {exc}"
        ) from None


class ParquetSource(SingleSource):
    """Parquet files in manifest order; sequential."""

    random_access = False

    def __init__(self, paths: list[Path], column: str, binding: BindingSpec) -> None:
        pa = import_pyarrow("Parquet files")
        import pyarrow.parquet as pq

        self.binding = binding
        self.column = column
        self.paths = [regular_file(path, "Parquet file") for path in paths]
        total = 0
        for path in self.paths:
            schema = _open(pq, pa, path).schema_arrow
            if column not in schema.names:
                raise InvalidConfig(
                    f"Parquet file {str(path)!r} has no column {column!r}; its "
                    f'columns are {schema.names} (set "column" in the manifest)'
                )
            token_list_type(pa, schema.field(column).type, column, f"Parquet file {str(path)!r}")
            total += _open(pq, pa, path).metadata.num_rows
        if total == 0:
            raise InvalidConfig(f"Parquet files {[str(p) for p in self.paths]} hold no rows")
        self.num_documents: int | None = total

    def records(self) -> Iterator[Record]:
        pa = import_pyarrow("Parquet files")
        import pyarrow.parquet as pq

        source_id = 0
        for path in self.paths:
            handle = _open(pq, pa, path)
            for group in range(handle.num_row_groups):
                try:
                    lists = handle.read_row_group(group, columns=[self.column]).column(0)
                    lists = lists.combine_chunks() if lists.num_chunks != 1 else lists.chunk(0)
                except (pa.ArrowException, OSError) as exc:
                    raise InvalidConfig(
                        f"Parquet file {str(path)!r}: row group {group} cannot "
                        f"be read (corrupt or truncated): {exc}"
                    ) from None
                offsets = lists.offsets.to_numpy()
                values = lists.values
                valid_token = values.is_valid().to_numpy(zero_copy_only=False)
                tokens = values.fill_null(0).to_numpy().astype(np.int64, copy=False)
                row_valid = lists.is_valid().to_numpy(zero_copy_only=False)
                for row in range(len(lists)):
                    location = f"{path.name}:{group}:{row}"
                    lo, hi = int(offsets[row]), int(offsets[row + 1])
                    if not row_valid[row] or not valid_token[lo:hi].all():
                        what = "the row is null" if not row_valid[row] else "a token is null"
                        yield Record(
                            source_id,
                            None,
                            0,
                            0,
                            source_id,
                            "malformed",
                            f"{what}; expected a list of integer tokens",
                            location,
                        )
                    else:
                        yield Record(
                            source_id, tokens[lo:hi], 0, hi - lo, source_id, None, "", location
                        )
                    source_id += 1
