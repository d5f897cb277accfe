"""``streampack corpus build``: tokenize raw text offline into token shards + manifest.

Text comes from a JSON Lines file (one object per line, the text under
``text_column``) or a Parquet file (a string column), read in batches: memory holds
one batch of texts and one shard of tokens. Tokenization is the Hugging Face
``tokenizers`` library with a local ``tokenizer.json``; special tokens (BOS/EOS) are
added as the tokenizer's post-processor defines them, and ``eos`` appends one more
token by name for tokenizers without one (GPT-2's ``<|endoftext|>``).

The binding records the tokenizer by the SHA-256 of its file's bytes, so a trainer
bound to another tokenizer file gets ``BindingMismatch`` rather than wrong ids.

Fine-tuning data (``fmt``) is written with a supervision mask per token
(``NAME.mask.npy``, :mod:`streampack.corpus.masks`), the way TRL's own SFT dataset
preparation marks it, with a ``transformers`` tokenizer (a directory, as
``AutoTokenizer.from_pretrained`` loads it, or a ``tokenizer.json``):

* ``prompt-completion``: string ``prompt`` and ``completion`` fields. The completion
  gets the tokenizer's EOS appended (as text, unless it ends with it); ``prompt`` and
  ``prompt + completion`` are tokenized, and supervision starts where the two token
  lists first differ — so a BPE merge across the boundary counts as completion::

      prompt "... is Par"   ->  ... 262 85           (Par)
      prompt + completion   ->  ... 298 17 1         (Paris . </s>)
      mask                       0 ... 0 1  1  1

* ``messages``: a list of ``{"role", "content"}``, rendered by the chat template with
  ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``:
  the template's ``{% generation %}`` blocks mark the assistant's tokens.
  ``train_on`` keeps every assistant turn (``assistant``), only the last run of them
  (``last``) or every token (``all``). A template without ``{% generation %}`` is
  refused for ``assistant``/``last``: it would give an all-zero mask.

The binding's tokenizer identity then covers the tokenizer's files and, for
``messages``, the chat template used, so a corpus built with another template gives
``BindingMismatch``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
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
FORMATS = ("text", "prompt-completion", "messages")
TRAIN_ON = ("assistant", "last", "all")
# The files AutoTokenizer reads from a directory: what the binding's identity hashes
# (never the model's weights next to them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
    supervised: int | None = None  # tokens the masks mark (fine-tuning formats only)


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


def _skip(report: BuildReport, where: str, why: str) -> None:
    """Count a skipped input record; log the first few with where they are."""
    report.skipped += 1
    if report.skipped <= _WARNINGS:
        logger.warning(
            "%s: %s; skipped%s",
            where,
            why,
            " (further skips are only counted)" if report.skipped == _WARNINGS else "",
        )


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` of every record of a JSON Lines or Parquet file (a row that
    is not a JSON object comes as ``None``)."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    row = None
                yield f"{path.name}:{number}", row if isinstance(row, dict) else None
        return
    from streampack.corpus.arrow import import_pyarrow

    pa = import_pyarrow("Parquet files")
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as exc:
        raise InvalidConfig(
            f"Parquet file {str(path)!r} is corrupt or not Parquet: {exc}"
        ) from None
    number = 0
    for batch in handle.iter_batches(batch_size=_BATCH):
        for row in batch.to_pylist():
            yield f"{path.name}:{number}", row
            number += 1


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


def _load_hf_tokenizer(path: Path, eos: str | None, chat_template: Path | None) -> Any:
    """A ``transformers`` tokenizer: a directory loaded as ``AutoTokenizer`` loads it,
    or a ``tokenizer.json`` (its EOS named by ``eos``); ``chat_template`` (a file)
    replaces its template."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise InvalidConfig(
            "corpus build --format prompt-completion|messages needs transformers; install "
            "it with: pip install 'streampack[hf]'"
        ) from None
    try:
        if path.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            regular_file(path, "tokenizer file")
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(
            f"--tokenizer {str(path)!r} is neither a tokenizer directory (as "
            f"AutoTokenizer.from_pretrained reads) nor a tokenizer.json: {exc}"
        ) from None
    if eos is not None:
        if tokenizer.convert_tokens_to_ids(eos) in (None, tokenizer.unk_token_id):
            raise InvalidConfig(f"--eos {eos!r} is not a token of {str(path)!r}")
        tokenizer.eos_token = eos
    if chat_template is not None:
        try:
            tokenizer.chat_template = regular_file(chat_template, "chat template").read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidConfig(
                f"cannot read --chat-template {str(chat_template)!r}: {exc}"
            ) from None
    return tokenizer


def _hf_identity(path: Path, template: str | None) -> str:
    """The binding's ``tokenizer`` for a transformers tokenizer: its files' hash, and
    the chat template's when one renders the documents."""
    if path.is_dir():
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                digest.update(name.encode() + b"\0" + file_sha256(path / name).encode())
        identity = f"tokenizer directory sha256:{digest.hexdigest()}"
    else:
        identity = tokenizer_identity(path)
    if template is not None:
        identity += f" chat_template sha256:{hashlib.sha256(template.encode()).hexdigest()}"
    return identity


def _check_template(tokenizer: Any, path: Path, train_on: str) -> str:
    """The chat template that renders ``messages``, refused when it cannot mark the
    assistant's tokens that ``train_on`` asks for."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise InvalidConfig(
            f"--tokenizer {str(path)!r} has no chat template; give one with --chat-template "
            f"FILE (a Jinja template, as chat_template.jinja holds)"
        )
    if train_on != "all" and not _GENERATION.search(template):
        raise InvalidConfig(
            f"the chat template of {str(path)!r} has no {{% generation %}} block, so "
            f"transformers cannot mark the assistant's tokens (--train-on {train_on} would "
            f"train nothing); wrap each assistant message's content (and its end-of-turn "
            f"token) in {{% generation %}}...{{% endgeneration %}} and pass it with "
            f"--chat-template FILE, or use --train-on all"
        )
    return template


def _last_run(mask: list[int]) -> list[int]:
    """Only the last run of ones of ``mask`` (the final assistant turn)."""
    out = [0] * len(mask)
    i = len(mask) - 1
    while i >= 0 and not mask[i]:
        i -= 1
    while i >= 0 and mask[i]:
        out[i] = 1
        i -= 1
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _supervised_documents(
    source: Path, tokenizer: Any, fmt: str, train_on: str, report: BuildReport
) -> Iterator[tuple[list[int], list[int]]]:
    """``(tokens, mask)`` per usable record of ``source`` (see the module docstring)."""
    eos = tokenizer.eos_token
    for where, row in _rows(source):
        if fmt == "prompt-completion":
            prompt, completion = (row or {}).get("prompt"), (row or {}).get("completion")
            if not isinstance(prompt, str) or not isinstance(completion, str):
                _skip(report, where, "no string 'prompt' and 'completion' fields")
                continue
            if eos is not None and not completion.endswith(eos):
                completion += eos  # TRL's rule: the EOS is part of the completion
            prompt_ids = tokenizer(prompt)["input_ids"]
            ids = tokenizer(prompt + completion)["input_ids"]
            start = _common_prefix(prompt_ids, ids)
            yield ids, [0] * start + [1] * (len(ids) - start)
            continue
        messages = (row or {}).get("messages")
        if not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            _skip(report, where, "no 'messages' list of {'role', 'content'} strings")
            continue
        rendered = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=train_on != "all",
        )
        ids = list(rendered["input_ids"])
        if train_on == "all":
            mask = [1] * len(ids)
        else:
            mask = list(rendered["assistant_masks"])
            mask = _last_run(mask) if train_on == "last" else mask
        if not any(mask[1:]):
            _skip(report, where, "no assistant tokens to train on")
            continue
        yield ids, mask


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
    fmt: str = "text",
    chat_template: Path | None = None,
    train_on: str = "assistant",
) -> BuildReport:
    """Tokenize ``source`` (``.jsonl`` or ``.parquet``) into token shards and a manifest
    in ``out`` (created; refused when it already holds a manifest). ``progress``, when
    given, is a :class:`streampack.progress.Progress` updated per batch. ``fmt``
    ``prompt-completion`` and ``messages`` write masked shards (module docstring)."""
    regular_file(source, "input file")
    if source.suffix not in (".jsonl", ".parquet"):
        raise InvalidConfig(f"--from {str(source)!r}: expected a .jsonl or .parquet file")
    if partition not in ("train", "validation", "test"):
        raise InvalidConfig(f"--partition {partition!r}; expected train, validation or test")
    if shard_tokens < 1:
        raise InvalidConfig(f"--shard-tokens {shard_tokens}; expected a positive count")
    if fmt not in FORMATS:
        raise InvalidConfig(f"--format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if train_on not in TRAIN_ON:
        raise InvalidConfig(f"--train-on {train_on!r}; expected one of {', '.join(TRAIN_ON)}")
    if fmt == "text" and chat_template is not None:
        raise InvalidConfig("--chat-template applies to --format messages only")
    if fmt != "text":
        return _build_supervised(
            source,
            tokenizer_path,
            out,
            eos=eos,
            shard_tokens=shard_tokens,
            partition=partition,
            split_receipt=split_receipt,
            progress=progress,
            fmt=fmt,
            chat_template=chat_template,
            train_on=train_on,
        )
    tokenizer = _load_tokenizer(tokenizer_path)
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise InvalidConfig(f"--eos {eos!r} is not a token of {str(tokenizer_path)!r}")
    _make_out(out)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    report = BuildReport()
    report.binding = _binding(
        vocab_size, tokenizer_identity(tokenizer_path), source, split_receipt, partition
    )
    writer = _ShardWriter(out, vocab_size, shard_tokens, masked=False)
    reader = _jsonl_texts if source.suffix == ".jsonl" else _parquet_texts
    for batch in _batched(reader(source, text_column, report)):
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=True):
            ids = encoding.ids if eos_id is None else [*encoding.ids, eos_id]
            writer.add(ids, None)
            report.documents += 1
            report.tokens += len(ids)
        if progress is not None:
            progress.update(done=report.documents, tokens=report.tokens)
    return _finish(writer, report, source, f"text under {text_column!r}")


def _build_supervised(
    source: Path,
    tokenizer_path: Path,
    out: Path,
    *,
    eos: str | None,
    shard_tokens: int,
    partition: str,
    split_receipt: str | None,
    progress: Any,
    fmt: str,
    chat_template: Path | None,
    train_on: str,
) -> BuildReport:
    """``build_corpus`` for the fine-tuning formats: masked token shards."""
    tokenizer = _load_hf_tokenizer(tokenizer_path, eos, chat_template)
    template = None
    if fmt == "messages":
        template = _check_template(tokenizer, tokenizer_path, train_on)
    elif tokenizer.eos_token is None:
        raise InvalidConfig(
            f"--format prompt-completion ends each completion with the EOS token, and "
            f"{str(tokenizer_path)!r} names none; give --eos TOKEN"
        )
    _make_out(out)
    vocab_size = len(tokenizer)
    report = BuildReport(supervised=0)
    report.binding = _binding(
        vocab_size, _hf_identity(tokenizer_path, template), source, split_receipt, partition
    )
    writer = _ShardWriter(out, vocab_size, shard_tokens, masked=True)
    for ids, mask in _supervised_documents(source, tokenizer, fmt, train_on, report):
        writer.add(ids, mask)
        report.documents += 1
        report.tokens += len(ids)
        report.supervised = (report.supervised or 0) + sum(mask)
        if progress is not None and report.documents % _BATCH == 0:
            progress.update(done=report.documents, tokens=report.tokens)
    what = "prompt/completion pairs" if fmt == "prompt-completion" else "conversations"
    return _finish(writer, report, source, what)


def _make_out(out: Path) -> None:
    if (out / "manifest.json").exists():
        raise InvalidConfig(
            f"--out {str(out)!r} already holds a corpus (manifest.json); choose a new directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidConfig(f"cannot create --out {str(out)!r}: {exc}") from None


def _binding(
    vocab_size: int, tokenizer: str, source: Path, split_receipt: str | None, partition: str
) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "split_receipt": split_receipt or f"{source.name} sha256:{file_sha256(source)}",
        "partition": partition,
    }


class _ShardWriter:
    """Documents gathered into shards of about ``shard_tokens`` tokens (uint16, or
    int32 for larger vocabularies), each with its mask file when ``masked``."""

    def __init__(self, out: Path, vocab_size: int, shard_tokens: int, *, masked: bool) -> None:
        self.out = out
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        self.shard_tokens = shard_tokens
        self.masked = masked
        self.names: list[str] = []
        self.pending: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending_tokens = 0

    def add(self, ids: list[int], mask: list[int] | None) -> None:
        self.pending.append(np.asarray(ids, dtype=np.int64))
        if self.masked:
            self.masks.append(np.asarray(mask, dtype=np.uint8))
        self.pending_tokens += len(ids)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        name = f"shard-{len(self.names):05d}"
        lengths = [len(ids) for ids in self.pending]
        np.save(self.out / f"{name}.tokens.npy", np.concatenate(self.pending).astype(self.dtype))
        np.save(
            self.out / f"{name}.offsets.npy",
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )
        if self.masked:
            np.save(self.out / f"{name}.mask.npy", np.concatenate(self.masks))
        self.names.append(name)
        self.pending, self.masks, self.pending_tokens = [], [], 0


def _finish(writer: _ShardWriter, report: BuildReport, source: Path, what: str) -> BuildReport:
    """Flush the last shard and write the manifest."""
    if writer.pending:
        writer.flush()
    if not writer.names:
        raise InvalidConfig(f"{str(source)!r} holds no {what}: nothing to build")
    report.shards = len(writer.names)
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "binding": report.binding,
        "shards": writer.names,
    }
    if writer.masked:
        manifest["mask"] = True
    (writer.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return report
