"""Parquet files, streamed one row group at a time.

Documents are the rows; their tokens are a list column of integers (``column``,
default ``input_ids``). Parquet pages are compressed and decoded a row group at a
time, so a document cannot be read alone cheaply: a Parquet corpus is a *sequential*
reader (a shuffled epoch goes through the seeded shuffle buffer, like JSON Lines), and
memory holds a few row groups (those decoded ahead of the cut, ``ParquetSource.blocks``)
plus the buffer.

A row group's token column (and mask or labels column) is read by
:mod:`streampack.corpus.parquet_pages` (pages decoded straight into offsets and values
by compiled kernels, 2-4x pyarrow's reading) wherever it has the plain shape tokenized
data is written in; a row group with a null or an empty list, and any codec, encoding
or type that module does not read, go through pyarrow as before. Both give the same
blocks.

Supervision: ``"mask"`` / ``"labels"`` name a list column as for Arrow
(:mod:`streampack.corpus.arrow`, :mod:`streampack.corpus.masks`), read with the tokens
a row group at a time.

A remote Parquet file (a URL: :mod:`streampack.corpus.storage`) is opened through a
file object whose reads are range requests through the node cache: its footer is read
once, then each row group's column chunks by range (``parquet_pages`` slices the
file's bytes as a ``storage.RemoteArray``). Its first whole pass leaves its documents'
lengths beside the node cache (``DIR/index/KEY.parquet-lengths.npy``, named by the
object's version): a resume in corpus order then cuts the windows before it from those
lengths and decodes from the row group holding its first document
(:meth:`ParquetSource.resume_lengths`), never the groups before. A shuffled resume still
reads from the start (as JSON Lines': ``streampack.corpus.jsonl``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streampack.corpus import parquet_pages
from streampack.corpus.arrow import import_pyarrow, supervision_type, token_list_type
from streampack.corpus.background import map_in_order, read_ahead
from streampack.corpus.files import regular_file, usable_cores
from streampack.corpus.masks import labels_to_mask, mask_spec
from streampack.corpus.reader import BindingSpec, Block, Record, SingleSource
from streampack.corpus.storage import (
    CorpusPath,
    Url,
    index_path,
    load_index,
    open_binary,
    save_index,
)
from streampack.errors import InvalidConfig

READ_AHEAD = 1  # decoded row groups queued for the cut, ahead of the one being cut
#: Row groups decoded at once, each on its own thread with its own file handle
#: (pyarrow and the compiled page kernels release the GIL). On the 2-core machine the
#: benchmarks ran on, reading the benchmark's file whole through the cut, two
#: parquet_pages decoders gave 1.02-1.35x one (alternating, one process). Row groups
#: left to pyarrow do worse there: two at once were 0.8-0.9x one with the cut on the
#: same two cores (pyarrow alone: 1.25x), a price paid for files with nulls only.
DECODERS = 2 if usable_cores() >= 2 else 1


def _open(pq: Any, pa: Any, path: CorpusPath) -> Any:
    try:
        if isinstance(path, Url):
            return pq.ParquetFile(open_binary(path, "Parquet file"))
        return pq.ParquetFile(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidConfig(
            f"Parquet file {str(path)!r} is corrupt or truncated, or not a Parquet file: "
            + " ".join(str(exc).split())
        ) from None


class ParquetSource(SingleSource):
    """Parquet files in manifest order; sequential."""

    random_access = False

    def __init__(
        self,
        paths: list[CorpusPath],
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
        self._groups: list[tuple[int, int]] = []  # (file, row group) in reading order
        self._group_rows: list[int] = []
        # Per file: how parquet_pages reads each column read (None: pyarrow reads them).
        self._plans: list[list[parquet_pages.ColumnPlan] | None] = []
        first: list[int] = []  # the source id of each one's first row
        for number, path in enumerate(self.paths):
            opened = _open(pq, pa, path)
            schema = opened.schema_arrow
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
            columns = [column] + ([] if self.spec is None else [self.spec.name])
            data = parquet_pages.file_bytes(path)
            plans = [parquet_pages.column_plan(pa, opened, name, data) for name in columns]
            leaf = [opened.schema.column(k).path.split(".")[0] for k in range(len(opened.schema))]
            for group, rows, values in parquet_pages.rows_past_values(data, leaf.index(column)):
                raise InvalidConfig(
                    f"Parquet file {str(path)!r}: row group {group} says it holds {rows} "
                    f"rows, but its column {column!r} holds {values} values and a list "
                    "holds one per row at least (a corrupt footer)"
                )
            del data  # (each decoding thread maps the file itself)
            self._plans.append(None if None in plans else plans)  # type: ignore[arg-type]
            metadata = opened.metadata
            for group in range(metadata.num_row_groups):
                self._groups.append((number, group))
                self._group_rows.append(metadata.row_group(group).num_rows)
                first.append(total)
                total += metadata.row_group(group).num_rows
        if total == 0:
            raise InvalidConfig(f"Parquet files {[str(p) for p in self.paths]} hold no rows")
        self.num_documents: int | None = total
        self._group_first = np.array(first, np.int64)

    def location(self, source_id: int) -> str:
        """``FILE:GROUP:ROW`` of document ``source_id``."""
        at = int(np.searchsorted(self._group_first, source_id, side="right")) - 1
        file, group = self._groups[at]
        return f"{self.paths[file].name}:{group}:{source_id - int(self._group_first[at])}"

    def records(self) -> Iterator[Record]:
        """Every document, one record each (a mixture reads them so)."""
        for block in self.blocks():
            yield from block.records(self.location)

    def blocks(self, first: int = 0) -> Iterator[Block]:
        """One block per row group, decoded columnar: the list column's offsets and
        values as NumPy (parquet_pages, or pyarrow zero-copy where it allows, nulls
        from the validity bitmaps), no Python object per document. ``DECODERS`` row
        groups are decoded at once on background threads (both release the GIL), in
        order, at most ``READ_AHEAD`` decoded ones waiting for the cut: memory holds
        ``DECODERS + READ_AHEAD + 2`` row groups at most (one handed over, one cut).

        ``first``: from that document on (a resume, see ``resume_lengths``), starting
        at its row group — the footer's row counts say which — and never reading those
        before. A whole pass of remote files leaves their documents' lengths."""
        decoded = read_ahead(self._decoded(first), READ_AHEAD)
        if first == 0 and all(isinstance(path, Url) for path in self.paths):
            return self._leaving_lengths(decoded)
        return decoded

    def _decoded(self, first: int) -> Iterator[Block]:
        """The row groups' blocks in order from document ``first``'s, decoded
        ``DECODERS`` at a time; the documents of its group before it left out."""
        if first >= int(self._group_first[-1]) + self._group_rows[-1]:
            return
        handles = threading.local()  # each decoding thread opens its own
        start = int(np.searchsorted(self._group_first, first, side="right")) - 1
        jobs: list[Callable[[], Block]] = [
            self._job(handles, self.paths[file], group, int(self._group_first[at]))
            for at, (file, group) in enumerate(self._groups)
            if at >= start
        ]
        skip = first - int(self._group_first[start])
        for block in map_in_order(lambda job: job(), jobs, DECODERS, DECODERS, "streampack-decode"):
            yield block.slice(skip, len(block)) if skip else block
            skip = 0

    def _file_rows(self) -> list[int]:
        """Each file's rows (its footer's row groups')."""
        rows = [0] * len(self.paths)
        for (file, _), count in zip(self._groups, self._group_rows, strict=True):
            rows[file] += count
        return rows

    def _leaving_lengths(self, blocks: Iterator[Block]) -> Iterator[Block]:
        """``blocks`` (a whole pass), each file's document lengths written once all of
        its row groups went by (``storage.index_path``: beside the node cache)."""
        rows = self._file_rows()
        file, lengths, held = 0, [np.zeros(0, np.int64)], 0
        for block in blocks:
            lengths.append(block.lengths.astype(np.int64))
            held += len(block)
            yield block
            while file < len(rows) and held >= rows[file]:
                joined = np.concatenate(lengths)
                where = index_path(self.paths[file], "Parquet file", "parquet-lengths")
                if where is not None:
                    save_index(where, joined[: rows[file]])
                lengths, held = [joined[rows[file] :]], held - rows[file]
                file += 1

    def resume_lengths(self) -> np.ndarray | None:
        """Every document's length as read (what the window cut sees), from what a
        whole pass of each remote file left — None unless every file has them: then
        ``blocks(first)`` starts at any document's row group without reading the
        groups before (and the windows before it are cut from these lengths)."""
        out = []
        for path, count in zip(self.paths, self._file_rows(), strict=True):
            lengths = load_index(index_path(path, "Parquet file", "parquet-lengths"))
            if lengths is None or lengths.shape != (count,) or lengths.dtype != np.int64:
                return None
            out.append(lengths)
        return np.concatenate(out)

    def _job(
        self, handles: threading.local, path: CorpusPath, group: int, first: int
    ) -> Callable[[], Block]:
        """Decoding row group ``group`` of ``path`` (source ids from ``first``) into a
        block, with the calling thread's handle of that file."""
        pa = import_pyarrow("Parquet files")
        import pyarrow.parquet as pq

        columns = [self.column] + ([] if self.spec is None else [self.spec.name])

        plans = self._plans[self.paths.index(path)]

        def decode() -> Block:
            if getattr(handles, "path", None) != path:  # this thread's handle of the file
                handles.path, handles.file = path, _open(pq, pa, path)
                handles.data = parquet_pages.file_bytes(path) if plans is not None else None
            read: list[Any] | str = "read by pyarrow"
            if plans is not None:
                read = parquet_pages.read_lists(pa, handles.data, plans, group)
            if isinstance(read, str):  # pyarrow's path: one column or two, on this thread
                try:  # (its own threads cost more than they give)
                    table = handles.file.read_row_group(group, columns=columns, use_threads=False)
                    read = [
                        chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
                        for chunked in table.columns
                    ]
                except (pa.ArrowException, OSError) as exc:
                    # One line: pyarrow's message (several lines at times), and what the
                    # page reader found wrong first where it tried (column, page).
                    said = " ".join(str(exc).split())
                    found = "" if plans is None else f" ({read})"
                    raise InvalidConfig(
                        f"Parquet file {str(path)!r}: row group {group} cannot "
                        f"be read (corrupt or truncated): {said}{found}"
                    ) from None
            lists, *mask_lists = read
            return self._block(lists, mask_lists[0] if mask_lists else None, first)

        return decode

    def _block(self, lists: Any, mask_lists: Any, first: int) -> Block:
        """One row group's documents (source ids from ``first``) as a block."""
        n = len(lists)
        offsets = lists.offsets.to_numpy().astype(np.int64, copy=False)
        raw_lengths = np.diff(offsets)
        values = lists.values
        if values.null_count:
            tokens = values.fill_null(0).to_numpy()
        else:
            tokens = values.to_numpy(zero_copy_only=False)
        if tokens.dtype == np.uint64:  # as before blocks: wrapped into int64 (the screen
            tokens = tokens.astype(np.int64)  # then finds them out of vocabulary)
        problems: dict[int, tuple[str, str]] = {}
        mask = mask_lengths = None
        if mask_lists is not None:
            full = tokens.astype(np.int64, copy=False)
            stored, problems, mask_offsets = self._masks(mask_lists, full, raw_lengths)
            mask = stored[mask_offsets[0] : mask_offsets[-1]]
            mask_lengths = np.diff(mask_offsets)
        tokens = tokens[offsets[0] : offsets[-1]]
        lengths = raw_lengths
        # A null row or a null token: the document is malformed and holds no tokens
        # (this wins over a mask problem, as it always has).
        null_row = ~lists.is_valid().to_numpy(zero_copy_only=False) if lists.null_count else None
        null_token = None
        if values.null_count:
            is_null = values.is_null().to_numpy(zero_copy_only=False)
            before = np.concatenate([[0], np.cumsum(is_null)])  # nulls before each value
            null_token = before[offsets[1:]] > before[offsets[:-1]]
        if null_row is not None or null_token is not None:
            bad = np.zeros(n, bool)
            for flags, what in ((null_row, "the row is null"), (null_token, "a token is null")):
                if flags is None:
                    continue
                for row in np.flatnonzero(flags & ~bad).tolist():
                    problems[row] = ("malformed", f"{what}; expected a list of integer tokens")
                bad |= flags
            tokens = tokens[np.repeat(~bad, raw_lengths)]
            lengths = np.where(bad, 0, raw_lengths)
        ids = np.arange(first, first + n, dtype=np.int64)
        return Block(
            tokens=tokens,
            lengths=lengths,
            starts=np.zeros(n, np.int64),
            stops=lengths.copy(),
            source_ids=ids,
            example_ids=ids,
            problems=problems,
            mask=mask,
            mask_lengths=mask_lengths,
        )

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
