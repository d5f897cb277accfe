"""The per-document table: what a producer needs to screen a document and vouch for its
tokens without reading them.

One row per document of a corpus, in source-id order (the ids the readers and the
windows use; a mixture's sources one after another, in manifest order)::

    digest      16 bytes: streampack.digests over the whole document as the reader
                yields it (tokens in wire.token_dtype(vocab_size), then, in a masked
                corpus, its mask as uint8: all ones for an unmasked source of a masked
                mixture, as in its windows)
    length      its tokens
    start/stop  its selected range (0 and length but for a JSON Lines line's own)
    min_token, max_token   int64, as stored (0, 0 for an empty document)
    supervised  the targets its range trains: mask[start + 1:stop] marked in a masked
                corpus (what ``supervised_targets_served`` counts, and 0 is the
                screen's ``unsupervised``), else stop - start - 1 (at least 0)
    problem     0, or 1 + the index in ``windows.REASONS`` of what reading it found:
                a reader's own reason (wrong_dtype, malformed, bad_range,
                labels_mismatch), else mask_length or mask_values

So the screen's reasons follow from a row: ``problem`` among the reader's own first,
then too_short / too_long from the range, out_of_vocabulary from min/max, the mask's
``problem``, then unsupervised. (A digest of a document with a problem is
deterministic but vouches for nothing: the screen drops it.)

On disk, beside the manifest, which names the header under ``"document_table"``::

    document-table.json   {"format": "streampack-document-table", "version": 1,
                           "rows": "document-table.npy", "documents": N, "masked": ...,
                           "vocab_size": ..., "manifest_sha256": ..., "files": {name: bytes}}
    document-table.npy    N rows of ROW (a NumPy structured array, 65 bytes a row),
                          memory-mapped to read

``manifest_sha256`` is over the manifest's content without the ``document_table`` key
(canonical JSON), so adding the key keeps the table valid; a table whose manifest,
file sizes, document count or row definition differ from the corpus's is refused with
one line. ``corpus build`` (and ``build --shard`` + ``merge``: the same rows file, byte
for byte) writes it; ``streampack corpus digest`` computes it for any corpus, in blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from streampack.corpus.files import inside
from streampack.corpus.manifest import open_corpus, read_manifest
from streampack.corpus.mixture import MixtureReader
from streampack.corpus.output import Output
from streampack.corpus.reader import Reader
from streampack.corpus.sources import FORMATS
from streampack.corpus.storage import (
    CorpusPath,
    StorageOptions,
    Url,
    as_location,
    exists,
    file_size,
    read_bytes,
)
from streampack.digests import DIGEST_BYTES, range_digests
from streampack.errors import InvalidConfig
from streampack.windows import REASONS, _document_extremes
from streampack.wire import token_dtype

#: The manifest key naming the table's header file (relative to the manifest).
TABLE_KEY = "document_table"
TABLE_FORMAT = "streampack-document-table"
#: The row definition's version: a table of another is refused (compute it again).
TABLE_VERSION = 1
HEADER_NAME = "document-table.json"
ROWS_NAME = "document-table.npy"
ROW = np.dtype(
    [
        ("digest", np.uint8, (DIGEST_BYTES,)),
        ("length", "<i8"),
        ("start", "<i8"),
        ("stop", "<i8"),
        ("min_token", "<i8"),
        ("max_token", "<i8"),
        ("supervised", "<i8"),
        ("problem", np.uint8),
    ]
)
# What one computed block holds at most (tokens of up to 8 bytes: at most 64 MiB of them).
BLOCK_TOKENS = 1 << 23
BLOCK_DOCUMENTS = 1 << 15


def block_rows(
    tokens: np.ndarray,
    lengths: np.ndarray,
    vocab_size: int,
    *,
    starts: np.ndarray | None = None,
    stops: np.ndarray | None = None,
    masked: bool = False,
    mask: np.ndarray | None = None,
    mask_lengths: np.ndarray | None = None,
    problems: Iterable[tuple[int, str]] = (),
) -> np.ndarray:
    """The rows of consecutive documents as a reader yields them: ``tokens`` (any
    integer dtype) concatenated, ``lengths`` per document, their ranges (default whole),
    in a ``masked`` corpus their masks as stored (``mask``, ``mask_lengths`` values
    each; None: an unmasked source, all ones), and ``problems`` found while reading
    ``(position, reason)``. One compiled digest call and a few whole-block reductions."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = np.zeros(n, ROW)
    rows["length"] = lengths
    rows["start"] = 0 if starts is None else starts
    rows["stop"] = lengths if stops is None else stops
    rows["min_token"], rows["max_token"] = _document_extremes(tokens, lengths)
    found: dict[int, str] = {}
    for position, reason in problems:
        found.setdefault(int(position), reason)
    marks = None
    if masked:
        marks, mask_reasons = _aligned_mask(lengths, offsets, mask, mask_lengths)
        for position, reason in mask_reasons:
            found.setdefault(position, reason)
    # Targets of each range, counted on the cumulative count of marked tokens.
    first = offsets[:-1]
    stop = np.clip(rows["stop"], 0, lengths)
    lo = np.minimum(np.clip(rows["start"], 0, lengths) + 1, stop)
    if marks is None:
        rows["supervised"] = stop - lo
    else:
        marked = np.zeros(len(marks) + 1, np.int64)
        np.cumsum(marks != 0, out=marked[1:])
        rows["supervised"] = marked[first + stop] - marked[first + lo]
    for position, reason in found.items():
        rows["problem"][position] = 1 + REASONS.index(reason)
    framed = np.asarray(tokens).astype(token_dtype(vocab_size), copy=False)
    rows["digest"] = range_digests(framed, offsets, marks)
    return rows


def _aligned_mask(
    lengths: np.ndarray,
    offsets: np.ndarray,
    mask: np.ndarray | None,
    mask_lengths: np.ndarray | None,
) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """One uint8 per token (the stored values; zeros for a document whose mask is not
    its tokens' length) and the mask's problems, as the screen names them."""
    total = int(offsets[-1])
    if mask is None:
        return np.ones(total, np.uint8), []
    mask = np.asarray(mask)
    mask_lengths = lengths if mask_lengths is None else np.asarray(mask_lengths, np.int64)
    values = mask.view(np.uint8) if mask.dtype == np.bool_ else mask
    found: list[tuple[int, str]] = []
    wrong = mask_lengths != lengths
    found += [(i, "mask_length") for i in np.flatnonzero(wrong).tolist()]
    if mask.dtype != np.bool_ and len(values):
        low, high = _document_extremes(values, mask_lengths)
        found += [(i, "mask_values") for i in np.flatnonzero((low < 0) | (high > 1)).tolist()]
    if not wrong.any():
        return values.astype(np.uint8), found
    marks = np.zeros(total, np.uint8)
    keep = np.repeat(~wrong, lengths)
    marks[keep] = values[np.repeat(~wrong, mask_lengths)].astype(np.uint8)
    return marks, found


def _sources(reader: Reader) -> list[Any]:
    return list(reader.readers) if isinstance(reader, MixtureReader) else [reader]


def iter_rows(reader: Reader) -> Iterator[np.ndarray]:
    """The corpus's rows in source-id order, a block at a time (at most about
    ``BLOCK_TOKENS`` tokens or ``BLOCK_DOCUMENTS`` documents of a random-access source;
    a sequential source's own blocks): memory holds one block."""
    vocab_size = reader.binding.vocab_size
    for source in _sources(reader):
        if source.random_access:
            yield from _random_access_rows(source, vocab_size, reader.masked)
        else:
            for block in source.blocks():
                yield block_rows(
                    block.tokens,
                    block.lengths,
                    vocab_size,
                    starts=block.starts,
                    stops=block.stops,
                    masked=reader.masked,
                    mask=block.mask if source.masked else None,
                    mask_lengths=block.mask_lengths if source.masked else None,
                    problems=((i, p[0]) for i, p in block.problems.items()),
                )


def _random_access_rows(source: Any, vocab_size: int, masked: bool) -> Iterator[np.ndarray]:
    parts = _random_access_parts(source)
    ahead = next(parts, None)
    prefetch = int(getattr(source, "prefetch_bytes", 0)) > 0  # a remote source
    while ahead is not None:
        ids, lengths = ahead
        ahead = next(parts, None)
        if prefetch and ahead is not None:  # the next block fetched while this one is hashed
            source.prefetch(*ahead)
        yield _gathered_rows(source, ids, lengths, vocab_size, masked)


def _random_access_parts(source: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, lengths)`` of the source's blocks, in order."""
    for lo in range(0, source.num_documents, BLOCK_DOCUMENTS):
        ids = np.arange(lo, min(source.num_documents, lo + BLOCK_DOCUMENTS), dtype=np.int64)
        lengths = source.lengths(ids)
        # A block of long documents is cut where its tokens pass BLOCK_TOKENS.
        ends = np.cumsum(lengths)
        cuts = np.searchsorted(ends, np.arange(BLOCK_TOKENS, int(ends[-1]), BLOCK_TOKENS))
        for part_ids, part_lengths in zip(np.split(ids, cuts), np.split(lengths, cuts)):
            if len(part_ids):
                yield part_ids, part_lengths


def _gathered_rows(
    source: Any, ids: np.ndarray, lengths: np.ndarray, vocab_size: int, masked: bool
) -> np.ndarray:
    """The rows of documents ``ids`` of a random-access source, read by ``gather``."""
    tokens, dtype_ok = source.gather(ids, lengths)
    problems = [(i, "wrong_dtype") for i in np.flatnonzero(~dtype_ok).tolist()]
    mask = mask_lengths = None
    if source.masked:
        mask, mask_lengths, found = source.gather_mask(ids, lengths, tokens)
        problems += [(i, reason) for i, reason, _ in found]
    return block_rows(
        tokens,
        lengths,
        vocab_size,
        masked=masked,
        mask=mask,
        mask_lengths=mask_lengths,
        problems=problems,
    )


def document_rows(reader: Reader, ids: np.ndarray) -> np.ndarray:
    """The rows of documents ``ids`` (source ids, int64, any order), computed from
    their tokens: the "computed at open" fallback where a corpus has no table. A
    random-access corpus reads only those documents (a block of them at a time); a
    sequential one is read from its start up to the last of them."""
    ids = np.asarray(ids, np.int64)
    total = reader.num_documents
    if len(ids) and (int(ids.min()) < 0 or (total is not None and int(ids.max()) >= total)):
        raise _outside(ids, "the corpus", total)
    out = np.zeros(len(ids), ROW)
    if not len(ids):
        return out
    if reader.random_access:
        source: Any = reader
        order = np.argsort(ids, kind="stable")  # each block read in corpus order
        for lo in range(0, len(ids), BLOCK_DOCUMENTS):
            chosen = order[lo : lo + BLOCK_DOCUMENTS]
            wanted = ids[chosen]
            out[chosen] = _gathered_rows(
                source, wanted, source.lengths(wanted), source.binding.vocab_size, source.masked
            )
        return out
    need = int(ids.max()) + 1
    first = 0
    for rows in iter_rows(reader):
        here = (ids >= first) & (ids < first + len(rows))
        out[here] = rows[ids[here] - first]
        first += len(rows)
        if first >= need:
            return out
    raise _outside(ids, "the corpus", first)


def _outside(ids: np.ndarray, holder: str, count: int | None) -> InvalidConfig:
    """The one line for ids that are not documents of ``holder`` (``count`` of them)."""
    return InvalidConfig(
        f"document ids span [{int(ids.min())}, {int(ids.max())}]; {holder} holds ids "
        f"0..{count - 1 if count is not None else '?'}"
    )


class RowSpool:
    """Rows appended a block at a time to a temporary file, then written as one
    ``.npy`` (memory holds a block, whatever the corpus)."""

    def __init__(self) -> None:
        self.file: IO[bytes] = tempfile.TemporaryFile()
        self.count = 0

    def add(self, rows: np.ndarray) -> None:
        if rows.dtype != ROW:
            raise InvalidConfig(f"document table rows of dtype {rows.dtype}; expected {ROW}")
        self.file.write(rows.tobytes())
        self.count += len(rows)

    def write(self, handle: IO[bytes]) -> None:
        """The ``.npy`` file: its header, then every row as added."""
        np.lib.format.write_array_header_1_0(
            handle,
            {
                "descr": np.lib.format.dtype_to_descr(ROW),
                "fortran_order": False,
                "shape": (self.count,),
            },
        )
        self.file.seek(0)
        shutil.copyfileobj(self.file, handle, 1 << 22)

    def close(self) -> None:
        self.file.close()


def manifest_sha256(data: dict[str, Any]) -> str:
    """The SHA-256 of a manifest's content without its ``document_table`` key:
    canonical JSON (sorted keys, no spaces), so formatting and the key itself do not
    change it."""
    content = {k: v for k, v in data.items() if k != TABLE_KEY}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def corpus_files(
    root: CorpusPath, data: dict[str, Any], *, allow_outside: bool = False
) -> dict[str, int]:
    """Every file the manifest's sources read, by its name relative to ``root``, with
    its size in bytes (what a stale table is recognised by)."""
    from streampack.corpus.arrow import arrow_files

    sizes: dict[str, int] = {}
    for entry in data.get("sources", [data]):
        kind = next(key for key in FORMATS if key in entry)
        for name in entry[kind]:
            if kind == "shards":
                names = [f"{name}.tokens.npy", f"{name}.offsets.npy"]
                mask = inside(root, f"{name}.mask.npy", "token shard", allow_outside=allow_outside)
                if entry.get("mask") or (entry.get("mask") is None and exists(mask)):
                    names.append(f"{name}.mask.npy")
            elif kind == "megatron":
                names = [f"{name}.idx", f"{name}.bin"]
            elif kind == "arrow":
                path = inside(root, name, "Arrow data", allow_outside=allow_outside)
                names = [
                    name if file == path else f"{name}/{file.name}" for file in arrow_files(path)
                ]
            else:
                names = [name]
            for file in names:
                path = inside(root, file, "corpus file", allow_outside=allow_outside)
                sizes[file] = file_size(path)
    return sizes


def write_table(
    out: Output, spool: RowSpool, data: dict[str, Any], files: dict[str, int], masked: bool
) -> dict[str, Any]:
    """The rows, then the header (so a header names complete rows); returns the header."""
    header = {
        "format": TABLE_FORMAT,
        "version": TABLE_VERSION,
        "rows": ROWS_NAME,
        "documents": spool.count,
        "masked": masked,
        "vocab_size": data["binding"]["vocab_size"],
        "row_bytes": ROW.itemsize,
        "manifest_sha256": manifest_sha256(data),
        "files": files,
    }
    out.put(ROWS_NAME, spool.write)
    out.put_bytes(HEADER_NAME, (json.dumps(header, indent=1) + "\n").encode())
    return header


def write_manifest(out: Output, manifest: dict[str, Any], spool: RowSpool) -> None:
    """A new corpus's table and then its manifest, which names it (``corpus build``,
    ``corpus merge``)."""
    manifest = {**manifest, TABLE_KEY: HEADER_NAME}
    files = corpus_files(out.root, manifest)
    write_table(out, spool, manifest, files, bool(manifest.get("mask")))
    out.put_bytes("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())


@dataclasses.dataclass(frozen=True)
class DocumentTable:
    """A corpus's table, checked against the corpus: ``rows`` (``ROW``, memory-mapped
    from a local file) indexed by source id."""

    rows: np.ndarray
    masked: bool
    where: str

    def __len__(self) -> int:
        return len(self.rows)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The rows of documents ``ids`` (source ids, int64, any order): one fancy index."""
        ids = np.asarray(ids, np.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self.rows)):
            raise _outside(ids, f"the table {self.where!r}", len(self.rows))
        return self.rows[ids]


def open_table(
    corpus: str | Path | Url,
    *,
    table: str | Path | Url | None = None,
    storage: StorageOptions | None = None,
    allow_outside: bool = False,
) -> DocumentTable | None:
    """The table of the corpus at ``corpus`` (a manifest, its folder or a URL): the one
    its manifest names under ``document_table``, or the folder ``table`` (where
    ``corpus digest --out`` wrote one); None when neither is given. A table that does
    not match the corpus is refused with one line (``InvalidConfig``)."""
    root, data = read_manifest(as_location(corpus, storage))
    if table is not None:
        header_path = as_location(table, storage) / HEADER_NAME
    elif isinstance(data.get(TABLE_KEY), str):
        header_path = inside(root, data[TABLE_KEY], "document table", allow_outside=allow_outside)
    elif TABLE_KEY in data:
        raise InvalidConfig(
            f"corpus {str(corpus)!r}: {TABLE_KEY} {data[TABLE_KEY]!r} must be the name of "
            f"the table's header file ({HEADER_NAME})"
        )
    else:
        return None
    where = str(header_path)
    try:
        header = json.loads(read_bytes(header_path, "document table"))
    except FileNotFoundError:
        raise InvalidConfig(f"document table {where!r} does not exist") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidConfig(f"document table {where!r} is not JSON: {exc}") from None
    again = f"run: streampack corpus digest {corpus}"
    if not isinstance(header, dict) or header.get("format") != TABLE_FORMAT:
        raise InvalidConfig(f"{where!r} is not a document table (format {TABLE_FORMAT!r})")
    if header.get("version") != TABLE_VERSION or header.get("row_bytes") != ROW.itemsize:
        raise InvalidConfig(
            f"document table {where!r} has version {header.get('version')!r}; this "
            f"streampack reads version {TABLE_VERSION} ({again})"
        )
    if header.get("manifest_sha256") != manifest_sha256(data):
        raise InvalidConfig(
            f"document table {where!r} is stale: it was computed for another manifest "
            f"(sha256 {str(header.get('manifest_sha256'))[:12]}..., this one "
            f"{manifest_sha256(data)[:12]}...); {again}"
        )
    files = corpus_files(root, data, allow_outside=allow_outside)
    for name, size in files.items():
        if header.get("files", {}).get(name) != size:
            raise InvalidConfig(
                f"document table {where!r} is stale: corpus file {name!r} has "
                f"{size} bytes, the table was computed over "
                f"{header.get('files', {}).get(name)!r}; {again}"
            )
    rows_path = header_path.parent / str(header.get("rows", ROWS_NAME))
    rows = _load_rows(rows_path)
    if rows.dtype != ROW or rows.ndim != 1 or len(rows) != header.get("documents"):
        raise InvalidConfig(
            f"document table {str(rows_path)!r} holds {rows.shape} rows of {rows.dtype}; its "
            f"header says {header.get('documents')!r} of {ROW} ({again})"
        )
    return DocumentTable(rows=rows, masked=bool(header.get("masked")), where=where)


def _load_rows(path: CorpusPath) -> np.ndarray:
    """The rows file: memory-mapped when local, read whole from a store."""
    try:
        if isinstance(path, Url):
            return np.load(io.BytesIO(read_bytes(path, "document table rows")))
        return np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise InvalidConfig(f"document table rows {str(path)!r} do not exist") from None
    except ValueError as exc:
        raise InvalidConfig(
            f"document table rows {str(path)!r} are not a .npy file: {exc}"
        ) from None


def digest_corpus(
    corpus: str | Path | Url,
    out: str | Path | Url | None = None,
    *,
    storage: StorageOptions | None = None,
    allow_outside: bool = False,
) -> dict[str, Any]:
    """``streampack corpus digest``: compute the corpus's table and write it into
    ``out`` (default: beside the manifest, which then names it under
    ``document_table``, added if missing). Returns what was written and how fast."""
    started = time.perf_counter()
    location = as_location(corpus, storage)
    reader = open_corpus(location, allow_outside=allow_outside, storage=storage)
    root, data = read_manifest(location)
    files = corpus_files(root, data, allow_outside=allow_outside)
    spool = RowSpool()
    tokens = 0
    try:
        for rows in iter_rows(reader):
            spool.add(rows)
            tokens += int(rows["length"].sum())
        target = Output(root if out is None else as_location(out, storage))
        target.make()
        write_table(target, spool, data, files, reader.masked)
    finally:
        spool.close()
    if out is None and data.get(TABLE_KEY) != HEADER_NAME:
        # The key added, the rest as it was: the table's manifest hash leaves it out.
        named = {**data, TABLE_KEY: HEADER_NAME}
        Output(root).put_bytes(
            _manifest_name(location), (json.dumps(named, indent=1) + "\n").encode()
        )
    seconds = max(time.perf_counter() - started, 1e-9)
    return {
        "table": str(target.root / HEADER_NAME),
        "documents": spool.count,
        "tokens": tokens,
        "masked": reader.masked,
        "bytes_per_document": ROW.itemsize,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1),
    }


def _manifest_name(location: CorpusPath) -> str:
    """The manifest's file name for a location given as a file or its folder."""
    if location.name.endswith(".json"):
        return location.name
    return "manifest.json"
