"""Corpus manifests: the JSON file that names a corpus's files, format and binding.

A manifest (``manifest.json`` in a directory, or any ``*.json`` path)::

    {"format": "streampack-corpus", "version": 1,
     "binding": {"vocab_size": 512, "tokenizer": "...", "split_receipt": "...",
                 "partition": "train"},
     "shards": ["shard-000", "shard-001"]}

names its files under exactly one format key (see :data:`FORMATS`), in order, relative
to the manifest's directory. A name that is absolute or leads outside that directory
is refused unless the caller allows it (``corpus_allow_outside``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streampack.corpus.files import inside, regular_file
from streampack.corpus.reader import BindingSpec, Reader
from streampack.errors import InvalidConfig

MANIFEST_FORMAT = "streampack-corpus"
MANIFEST_VERSION = 1


def read_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    """``(directory, fields)`` of the manifest at ``path`` (a file or a directory
    holding ``manifest.json``), with its format and version checked."""
    if path.is_dir():
        path = path / "manifest.json"
    try:
        text = regular_file(path, "corpus manifest").read_bytes().decode("utf-8")
    except InvalidConfig as exc:
        raise InvalidConfig(
            f"{exc}; give a manifest JSON file or a directory holding manifest.json"
        ) from None
    except OSError as exc:
        raise InvalidConfig(f"cannot read corpus manifest {str(path)!r}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidConfig(
            f"corpus manifest {str(path)!r} is not UTF-8 text "
            f"(byte {exc.start}); expected a UTF-8 JSON file"
        ) from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidConfig(f"corpus manifest {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InvalidConfig(
            f"corpus manifest {str(path)!r} has format "
            f"{data.get('format') if isinstance(data, dict) else data!r}; "
            f"expected {MANIFEST_FORMAT!r}"
        )
    if data.get("version") != MANIFEST_VERSION:
        raise InvalidConfig(
            f"corpus manifest {str(path)!r} has version {data.get('version')!r}; "
            f"expected {MANIFEST_VERSION}"
        )
    return path.parent, data


def binding_spec(data: dict[str, Any], where: str) -> BindingSpec:
    """The manifest's ``binding`` object, checked."""
    binding = data.get("binding")
    fields = ("vocab_size", "tokenizer", "split_receipt", "partition")
    if not isinstance(binding, dict) or set(binding) != set(fields):
        raise InvalidConfig(f"{where}: binding {binding!r} must have exactly the keys {fields}")
    vocab = binding["vocab_size"]
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise InvalidConfig(f"{where}: binding vocab_size {vocab!r} must be a positive int")
    if binding["partition"] not in ("train", "validation", "test"):
        raise InvalidConfig(
            f"{where}: binding partition {binding['partition']!r}; "
            f"expected train, validation or test"
        )
    return BindingSpec(
        vocab_size=vocab,
        tokenizer=str(binding["tokenizer"]),
        split_receipt=str(binding["split_receipt"]),
        partition=str(binding["partition"]),
    )


def _open_shards(
    root: Path, names: list[str], entry: dict[str, Any], binding: BindingSpec, allow_outside: bool
) -> Reader:
    from streampack.corpus.shards import TokenShardSource

    for name in names:
        for suffix in (".tokens.npy", ".offsets.npy"):
            inside(root, name + suffix, "token shard", allow_outside=allow_outside)
    return TokenShardSource(root, names, binding)


def _open_jsonl(
    root: Path, names: list[str], entry: dict[str, Any], binding: BindingSpec, allow_outside: bool
) -> Reader:
    from streampack.corpus.jsonl import JsonlSource

    return JsonlSource(
        [inside(root, n, "JSON Lines file", allow_outside=allow_outside) for n in names], binding
    )


def _column(entry: dict[str, Any]) -> str:
    from streampack.corpus.arrow import DEFAULT_COLUMN

    column = entry.get("column", DEFAULT_COLUMN)
    if not isinstance(column, str) or not column:
        raise InvalidConfig(f"column {column!r} must be the name of a token-list column")
    return column


def _open_parquet(
    root: Path, names: list[str], entry: dict[str, Any], binding: BindingSpec, allow_outside: bool
) -> Reader:
    from streampack.corpus.parquet import ParquetSource

    return ParquetSource(
        [inside(root, n, "Parquet file", allow_outside=allow_outside) for n in names],
        _column(entry),
        binding,
    )


def _open_arrow(
    root: Path, names: list[str], entry: dict[str, Any], binding: BindingSpec, allow_outside: bool
) -> Reader:
    from streampack.corpus.arrow import ArrowSource

    return ArrowSource(
        [inside(root, n, "Arrow data", allow_outside=allow_outside) for n in names],
        names,
        _column(entry),
        binding,
    )


def _open_megatron(
    root: Path, names: list[str], entry: dict[str, Any], binding: BindingSpec, allow_outside: bool
) -> Reader:
    from streampack.corpus.megatron import MegatronSource

    for name in names:
        for suffix in (".idx", ".bin"):
            inside(root, name + suffix, "Megatron file", allow_outside=allow_outside)
    return MegatronSource([root / n for n in names], names, binding)


# Format key in the manifest -> opener(root, names, entry, binding, allow_outside).
FORMATS: dict[str, Callable[..., Reader]] = {
    "shards": _open_shards,  # NAME.tokens.npy + NAME.offsets.npy
    "jsonl": _open_jsonl,  # JSON Lines of {"tokens": [...]}
    "parquet": _open_parquet,  # Parquet files, option "column" (default "input_ids")
    "arrow": _open_arrow,  # save_to_disk directories or .arrow files, option "column"
    "megatron": _open_megatron,  # PREFIX.bin + PREFIX.idx
}


def open_source(
    root: Path,
    entry: dict[str, Any],
    binding: BindingSpec,
    where: str,
    *,
    allow_outside: bool = False,
) -> Reader:
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
    return FORMATS[kind](root, names, entry, binding, allow_outside)


def open_corpus(path: str | Path, *, allow_outside: bool = False) -> Reader:
    """Open the corpus described by a manifest file or a directory holding one.

    ``allow_outside`` lets file names in the manifest be absolute or lead outside the
    manifest's directory (the ``corpus_allow_outside`` setting)."""
    from streampack.mixture import long_documents_policy, open_mixture

    root, data = read_manifest(Path(path))
    where = f"corpus {str(path)!r}"
    binding = binding_spec(data, where)
    if "sources" in data:  # a weighted mixture of several sources (streampack.mixture)
        return open_mixture(root, data, binding, where, allow_outside=allow_outside)
    reader = open_source(root, data, binding, where, allow_outside=allow_outside)
    reader.long_documents = long_documents_policy(data, where)  # type: ignore[union-attr]
    return reader
