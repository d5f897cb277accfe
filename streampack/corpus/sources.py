"""One source of a corpus: the reader for a manifest entry's format key.

A source entry holds exactly one key of :data:`FORMATS` (its list of file names) and
that format's options, plus ``long_documents``. :mod:`streampack.corpus.manifest` opens
a whole corpus (one source, or a mixture of several) from a manifest file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from streampack.corpus.files import inside
from streampack.corpus.long_documents import long_documents_policy
from streampack.corpus.masks import refuse_mask
from streampack.corpus.reader import BindingSpec
from streampack.corpus.storage import CorpusPath
from streampack.errors import InvalidConfig

if TYPE_CHECKING:  # the readers themselves load with their format (pyarrow, ...)
    from streampack.corpus.arrow import ArrowSource
    from streampack.corpus.jsonl import JsonlSource
    from streampack.corpus.megatron import MegatronSource
    from streampack.corpus.parquet import ParquetSource
    from streampack.corpus.shards import TokenShardSource

#: A reader of one source: each satisfies the reader protocol and holds its own
#: ``long_documents`` policy (``reader.SingleSource``).
Source = Union["TokenShardSource", "JsonlSource", "ParquetSource", "ArrowSource", "MegatronSource"]


def _open_shards(
    root: CorpusPath,
    names: list[str],
    entry: dict[str, Any],
    binding: BindingSpec,
    allow_outside: bool,
) -> Source:
    from streampack.corpus.shards import TokenShardSource

    mask = entry.get("mask")
    if mask is not None and not isinstance(mask, bool):
        raise InvalidConfig(
            f"token shards: mask {mask!r} must be true or false (the mask of shard NAME is "
            f"the file NAME.mask.npy)"
        )
    if entry.get("labels") is not None:
        raise InvalidConfig(
            f"token shards: labels {entry['labels']!r} is set; a shard's supervision is "
            f'its mask file NAME.mask.npy (bool or uint8 per token), with "mask": true'
        )
    for name in names:
        for suffix in (".tokens.npy", ".offsets.npy", ".mask.npy"):
            inside(root, name + suffix, "token shard", allow_outside=allow_outside)
    return TokenShardSource(root, names, binding, mask)


def _open_jsonl(
    root: CorpusPath,
    names: list[str],
    entry: dict[str, Any],
    binding: BindingSpec,
    allow_outside: bool,
) -> Source:
    from streampack.corpus.jsonl import JsonlSource

    return JsonlSource(
        [inside(root, n, "JSON Lines file", allow_outside=allow_outside) for n in names],
        binding,
        entry,
    )


def _column(entry: dict[str, Any]) -> str:
    from streampack.corpus.arrow import DEFAULT_COLUMN

    column = entry.get("column", DEFAULT_COLUMN)
    if not isinstance(column, str) or not column:
        raise InvalidConfig(f"column {column!r} must be the name of a token-list column")
    return column


def _open_parquet(
    root: CorpusPath,
    names: list[str],
    entry: dict[str, Any],
    binding: BindingSpec,
    allow_outside: bool,
) -> Source:
    from streampack.corpus.parquet import ParquetSource

    return ParquetSource(
        [inside(root, n, "Parquet file", allow_outside=allow_outside) for n in names],
        _column(entry),
        binding,
        entry,
    )


def _open_arrow(
    root: CorpusPath,
    names: list[str],
    entry: dict[str, Any],
    binding: BindingSpec,
    allow_outside: bool,
) -> Source:
    from streampack.corpus.arrow import ArrowSource

    return ArrowSource(
        [inside(root, n, "Arrow data", allow_outside=allow_outside) for n in names],
        names,
        _column(entry),
        binding,
        entry,
    )


def _open_megatron(
    root: CorpusPath,
    names: list[str],
    entry: dict[str, Any],
    binding: BindingSpec,
    allow_outside: bool,
) -> Source:
    from streampack.corpus.megatron import MegatronSource

    refuse_mask(entry, "Megatron datasets", "Megatron indexed datasets (.bin/.idx)")
    for name in names:
        for suffix in (".idx", ".bin"):
            inside(root, name + suffix, "Megatron file", allow_outside=allow_outside)
    return MegatronSource([root / n for n in names], names, binding)


# Format key in the manifest -> opener(root, names, entry, binding, allow_outside).
FORMATS: dict[str, Callable[..., Source]] = {
    "shards": _open_shards,  # NAME.tokens.npy + NAME.offsets.npy (+ NAME.mask.npy)
    "jsonl": _open_jsonl,  # JSON Lines of {"tokens": [...]}, options "mask"/"labels"
    "parquet": _open_parquet,  # Parquet files, options "column" (default "input_ids"),
    # "mask"/"labels" (corpus/masks.py)
    "arrow": _open_arrow,  # save_to_disk directories or .arrow files, as Parquet
    "megatron": _open_megatron,  # PREFIX.bin + PREFIX.idx
}


def open_source(
    root: CorpusPath,
    entry: dict[str, Any],
    binding: BindingSpec,
    where: str,
    *,
    allow_outside: bool = False,
) -> Source:
    """The reader for one source entry: a dict holding exactly one format key of
    :data:`FORMATS` (its list of file names, relative to ``root``) and that format's
    options. Other keys of ``entry`` are the caller's (a manifest's ``format``, ...)."""
    present = [key for key in FORMATS if key in entry]
    if len(present) != 1:
        raise InvalidConfig(
            f"{where}: a source must list its files under exactly one of "
            f"{', '.join(repr(k) for k in FORMATS)}; found {present or 'none'}"
        )
    kind = present[0]
    names = entry[kind]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidConfig(
            f"{where}: {kind!r} must be a non-empty list of file names, got {names!r}"
        )
    reader = FORMATS[kind](root, names, entry, binding, allow_outside)
    reader.long_documents = long_documents_policy(entry, where)
    return reader
