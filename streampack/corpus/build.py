"""``streampack corpus build``: tokenize raw text offline into token shards + manifest.

Text comes from a JSON Lines file (one object per line, the text under
``text_column``) or a Parquet file (a string column), read in batches: memory holds
one batch of texts and one shard of tokens. Tokenization is the Hugging Face
``tokenizers`` library with a local ``tokenizer.json``; special tokens (BOS/EOS) are
added as the tokenizer's post-processor defines them, and ``eos`` appends one more
token by name for tokenizers without one (GPT-2's ``<|endoftext|>``).

The binding records the tokenizer by the SHA-256 of its file's bytes, so a trainer
bound to another tokenizer file gets ``BindingMismatch`` rather than wrong ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.manifest import MANIFEST_FORMAT, MANIFEST_VERSION
from streampack.errors import InvalidConfig

logger = logging.getLogger(__name__)
_BATCH = 1024  # texts tokenized per call (encode_batch runs them in parallel)
_WARNINGS = 3  # skipped input lines logged one by one; the rest only counted


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(path: Path) -> str:
    """The binding's ``tokenizer`` field: the content hash of the tokenizer file."""
    return f"tokenizer.json sha256:{file_sha256(path)}"


@dataclasses.dataclass
class BuildReport:
    """What a build wrote."""

    documents: int = 0
    tokens: int = 0
    shards: int = 0
    skipped: int = 0  # input records without a usable text (logged with their line)
    binding: dict[str, Any] = dataclasses.field(default_factory=dict)


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InvalidConfig(
            "corpus build needs the tokenizers library; install it with: "
            "pip install 'streampack[data]'"
        ) from None
    regular_file(path, "tokenizer file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise InvalidConfig(
            f"tokenizer file {str(path)!r} is not a Hugging Face tokenizer.json: {exc}"
        ) from None


def _jsonl_texts(path: Path, column: str, report: BuildReport) -> Iterator[str]:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                text = json.loads(line)[column]
            except (ValueError, RecursionError, KeyError, TypeError, IndexError):
                text = None
            if not isinstance(text, str):
                report.skipped += 1
                if report.skipped <= _WARNINGS:
                    logger.warning(
                        "%s:%d: no string %r field; line skipped%s",
                        path.name,
                        number,
                        column,
                        " (further skips are only counted)" if report.skipped == _WARNINGS else "",
                    )
                continue
            yield text


def _parquet_texts(path: Path, column: str, report: BuildReport) -> Iterator[str]:
    from streampack.corpus.arrow import import_pyarrow

    pa = import_pyarrow("Parquet files")
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as exc:
        raise InvalidConfig(
            f"Parquet file {str(path)!r} is corrupt or not Parquet: {exc}"
        ) from None
    names = handle.schema_arrow.names
    if column not in names:
        raise InvalidConfig(
            f"Parquet file {str(path)!r} has no column {column!r}; its columns "
            f"are {names} (give --text-column)"
        )
    kind = handle.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InvalidConfig(
            f"Parquet file {str(path)!r}: column {column!r} has type {kind}; expected text (string)"
        )
    for batch in handle.iter_batches(batch_size=_BATCH, columns=[column]):
        for text in batch.column(0).to_pylist():
            if text is None:
                report.skipped += 1
                continue
            yield text


def _batched(texts: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def build_corpus(
    source: Path,
    tokenizer_path: Path,
    out: Path,
    *,
    text_column: str = "text",
    eos: str | None = None,
    shard_tokens: int = 1 << 26,
    partition: str = "train",
    split_receipt: str | None = None,
    progress: Any = None,
) -> BuildReport:
    """Tokenize ``source`` (``.jsonl`` or ``.parquet``) into token shards and a manifest
    in ``out`` (created; refused when it already holds a manifest). ``progress``, when
    given, is a :class:`streampack.progress.Progress` updated per batch."""
    regular_file(source, "input file")
    if source.suffix not in (".jsonl", ".parquet"):
        raise InvalidConfig(f"--from {str(source)!r}: expected a .jsonl or .parquet file")
    if partition not in ("train", "validation", "test"):
        raise InvalidConfig(f"--partition {partition!r}; expected train, validation or test")
    if shard_tokens < 1:
        raise InvalidConfig(f"--shard-tokens {shard_tokens}; expected a positive count")
    tokenizer = _load_tokenizer(tokenizer_path)
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise InvalidConfig(f"--eos {eos!r} is not a token of {str(tokenizer_path)!r}")
    if (out / "manifest.json").exists():
        raise InvalidConfig(
            f"--out {str(out)!r} already holds a corpus (manifest.json); choose a new directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidConfig(f"cannot create --out {str(out)!r}: {exc}") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    report = BuildReport()
    report.binding = {
        "vocab_size": vocab_size,
        "tokenizer": tokenizer_identity(tokenizer_path),
        "split_receipt": split_receipt or f"{source.name} sha256:{file_sha256(source)}",
        "partition": partition,
    }
    reader = _jsonl_texts if source.suffix == ".jsonl" else _parquet_texts
    names: list[str] = []
    pending: list[np.ndarray] = []
    pending_tokens = 0

    def flush() -> None:
        nonlocal pending, pending_tokens
        name = f"shard-{len(names):05d}"
        lengths = [len(ids) for ids in pending]
        np.save(out / f"{name}.tokens.npy", np.concatenate(pending).astype(dtype))
        np.save(
            out / f"{name}.offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        )
        names.append(name)
        pending, pending_tokens = [], 0

    for batch in _batched(reader(source, text_column, report)):
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=True):
            ids = encoding.ids if eos_id is None else [*encoding.ids, eos_id]
            pending.append(np.asarray(ids, dtype=np.int64))
            pending_tokens += len(ids)
            report.documents += 1
            report.tokens += len(ids)
            if pending_tokens >= shard_tokens:
                flush()
        if progress is not None:
            progress.update(done=report.documents, tokens=report.tokens)
    if pending:
        flush()
    if not names:
        raise InvalidConfig(
            f"{str(source)!r} holds no text under {text_column!r}: nothing to build"
        )
    report.shards = len(names)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "binding": report.binding,
        "shards": names,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return report
