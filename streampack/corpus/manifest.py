"""Corpus manifests: the JSON file that names a corpus's files, format and binding.

A manifest (``manifest.json`` in a directory, or any ``*.json`` path)::

    {"format": "streampack-corpus", "version": 1,
     "binding": {"vocab_size": 512, "tokenizer": "...", "split_receipt": "...",
                 "partition": "train"},
     "shards": ["shard-000", "shard-001"]}

names its files under exactly one format key (see ``corpus.sources.FORMATS``), in order, relative
to the manifest's directory. A name that is absolute or leads outside that directory
is refused unless the caller allows it (``corpus_allow_outside``).

The manifest may be a URL (``s3://bucket/corpus/manifest.json``, ``hf://datasets/...``,
``https://...``; a URL not ending in ``.json`` is a folder holding ``manifest.json``):
its names then resolve against the manifest's URL by the same rules
(:mod:`streampack.corpus.storage`), and an optional ``"storage"`` object gives the
store's ``endpoint_url``, ``region`` and ``anonymous`` (never credentials).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streampack.corpus.files import regular_file
from streampack.corpus.reader import BindingSpec, Reader
from streampack.corpus.sources import open_source
from streampack.corpus.storage import CorpusPath, StorageOptions, Url, as_location, read_bytes
from streampack.errors import CorpusUnavailable, InvalidConfig

MANIFEST_FORMAT = "streampack-corpus"
MANIFEST_VERSION = 1


def read_manifest(path: CorpusPath) -> tuple[CorpusPath, dict[str, Any]]:
    """``(directory, fields)`` of the manifest at ``path`` (a file or a directory
    holding ``manifest.json``; a URL not ending in ``.json`` is such a folder), with
    its format and version checked."""
    if isinstance(path, Url) and not path.path.endswith(".json"):
        path = path / "manifest.json"
    elif isinstance(path, Path) and path.is_dir():
        path = path / "manifest.json"
    try:
        text = read_bytes(regular_file(path, "corpus manifest"), "corpus manifest").decode("utf-8")
    except CorpusUnavailable as exc:
        if not exc.missing:  # denied, unreachable: the store's problem, said as it is
            raise
        raise CorpusUnavailable(
            f"{exc}; give a manifest JSON file or a folder holding manifest.json", missing=True
        ) from None
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


def open_corpus(
    path: str | Path | Url,
    *,
    allow_outside: bool = False,
    storage: StorageOptions | None = None,
) -> Reader:
    """Open the corpus described by a manifest file or a directory holding one, a
    local path or a URL.

    ``allow_outside`` lets file names in the manifest be absolute or lead outside the
    manifest's directory (the ``corpus_allow_outside`` setting); ``storage`` says how
    a remote corpus is reached and cached (the ``corpus_*`` settings)."""
    from streampack.corpus.mixture import open_mixture

    location = as_location(path, storage)
    where = f"corpus {str(location)!r}"
    root, data = read_manifest(location)
    if isinstance(root, Url):
        root = root.with_options(root.options.with_manifest(data.get("storage"), where))
    elif data.get("storage") is not None:
        StorageOptions().with_manifest(data["storage"], where)  # checked all the same
    binding = binding_spec(data, where)
    if "sources" in data:  # a weighted mixture of several sources (corpus/mixture.py)
        return open_mixture(root, data, binding, where, allow_outside=allow_outside)
    return open_source(root, data, binding, where, allow_outside=allow_outside)
