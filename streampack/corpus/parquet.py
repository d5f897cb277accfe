"""Parquet files, streamed one row group at a time.

Documents are the rows; their tokens are a list column of integers (``column``,
default ``input_ids``). Parquet pages are compressed and decoded a row group at a
time, so a document cannot be read alone cheaply: a Parquet corpus is a *sequential*
reader (a shuffled epoch goes through the seeded shuffle buffer, like JSON Lines), and
memory holds one row group plus the buffer.

Supervision: ``"mask"`` / ``"labels"`` name a list column as for Arrow
(:mod:`streampack.corpus.arrow`, :mod:`streampack.corpus.masks`), read with the tokens
a row group at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.arrow import import_pyarrow, supervision_type, token_list_type
from streampack.corpus.files import regular_file
from streampack.corpus.masks import labels_to_mask, mask_spec
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

    def __init__(
        self,
        paths: list[Path],
        column: str,
        binding: BindingSpec,
        entry: dict[str, Any] | None = None,
    ) -> None:
        pa = import_pyarrow("Parquet files")
        import pyarrow.parquet as pq

        self.binding = binding
        self.column = column
        self.paths = [regular_file(path, "Parquet file") for path in paths]
        total = 0
        self.spec = None
        for number, path in enumerate(self.paths):
            schema = _open(pq, pa, path).schema_arrow
            if number == 0:
                self.spec = mask_spec(entry or {}, f"Parquet file {str(path)!r}", schema.names)
                self.masked = self.spec is not None
            supervision_type(pa, schema, self.spec, f"Parquet file {str(path)!r}")
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
        columns = [self.column] + ([] if self.spec is None else [self.spec.name])
        for path in self.paths:
            handle = _open(pq, pa, path)
            for group in range(handle.num_row_groups):
                try:
                    table = handle.read_row_group(group, columns=columns)
                    lists, *mask_lists = (
                        chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
                        for chunked in table.columns
                    )
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
                masks = self._masks(mask_lists[0], tokens, np.diff(offsets)) if mask_lists else None
                for row in range(len(lists)):
                    location = f"{path.name}:{group}:{row}"
                    lo, hi = int(offsets[row]), int(offsets[row + 1])
                    problem = None if masks is None else masks[1].get(row)
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
                    elif problem is not None:
                        yield Record(
                            source_id, tokens[lo:hi], 0, hi - lo, source_id, *problem, location
                        )
                    else:
                        mask = None
                        if masks is not None:
                            mask = masks[0][masks[2][row] : masks[2][row + 1]]
                        yield Record(
                            source_id,
                            tokens[lo:hi],
                            0,
                            hi - lo,
                            source_id,
                            None,
                            "",
                            location,
                            mask,
                        )
                    source_id += 1

    def _masks(
        self, lists: Any, tokens: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, dict[int, tuple[str, str]], np.ndarray]:
        """One row group's supervision: ``(values, problems by row, offsets)``, values
        as stored (labels already turned into a bool mask)."""
        assert self.spec is not None
        offsets = lists.offsets.to_numpy().astype(np.int64)
        values = lists.values
        problems: dict[int, tuple[str, str]] = {}
        valid = lists.is_valid().to_numpy(zero_copy_only=False)
        null_value = values.is_null().to_numpy(zero_copy_only=False)
        for row in np.flatnonzero(~valid).tolist():
            problems[row] = ("mask_values", f"the {self.spec.kind} is null; expected a list")
        if null_value.any():
            rows = np.repeat(np.arange(len(lists)), np.diff(offsets))[null_value]
            for row in np.unique(rows).tolist():
                problems.setdefault(
                    row, ("mask_values", f"a {self.spec.kind} value is null; expected 0 or 1")
                )
        stored = values.fill_null(0).to_numpy(zero_copy_only=False)
        if self.spec.kind == "labels":
            stored, mismatched = labels_to_mask(tokens, lengths, stored, np.diff(offsets))
            for row, reason, detail in mismatched:
                problems.setdefault(row, (reason, detail))
        return stored, problems, offsets
