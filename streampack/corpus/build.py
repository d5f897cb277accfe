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

A build runs as three stages with a bounded queue between two of them (``_DEPTH``
batches, per encoder thread): a reader thread, encoder threads, and the caller's
thread writing shards::

    reader thread          encoder threads (one per CPU)        caller's thread
    lines -> records   ->  1024 records -> encode_batch  -> tokens, lengths, masks
    (json, Parquet;        -> one array, a batch each,        -> shards (np.save),
     skips bad lines)      taken back in input order             progress

For text, each encoder thread encodes a whole batch with tokenizers' own thread pool
turned off (``TOKENIZERS_PARALLELISM=false`` for the build; the tokenizer releases the
GIL while it encodes): one sequential batch per CPU costs less CPU than every CPU's
Rust threads splitting each batch, whose idle threads spin while Python converts and
writes (benchmarks/build.py measures both). The fine-tuning formats' encoder counts
and logs skipped rows in input order as it goes: one encoder thread for them, with the
tokenizer's own threads.

Each document is encoded on its own and batches are written in input order, so the
shards are byte for byte those of encoding one document at a time; memory holds a few
batches per thread and one shard, whatever the corpus.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from streampack.corpus.background import map_in_order, read_ahead
from streampack.corpus.files import file_sha256, regular_file, usable_cores
from streampack.corpus.manifest import MANIFEST_FORMAT, MANIFEST_VERSION
from streampack.corpus.output import Output
from streampack.corpus.parts import PART_RECORD, Part, jsonl_lines, row_groups, write_record
from streampack.corpus.storage import (
    CorpusPath,
    RemoteFile,
    StorageOptions,
    Url,
    as_location,
    file_size,
    open_binary,
)
from streampack.corpus.tables import ROWS_NAME, RowSpool, block_rows, write_manifest
from streampack.errors import InvalidConfig

logger = logging.getLogger(__name__)
_BATCH = 1024  # records tokenized per call (encode_batch runs them in parallel)
_DEPTH = 2  # batches waiting between two stages of the build (memory: a few batches)
_WARNINGS = 3  # skipped input lines logged one by one; the rest only counted
# A store's input is read through a small cache of its own: read once, in order.
BUILD_CACHE_BYTES = 256 << 20
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
    seconds: float = 0.0  # the whole build, from opening the tokenizer to the manifest
    documents_per_second: float = 0.0
    tokens_per_second: float = 0.0


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


def _lines(source: CorpusPath, part: Part | None) -> Iterator[tuple[str, bytes]]:
    """``(location, line)`` of the JSON Lines input's lines that ``part`` holds."""
    size = file_size(source, "input file")
    with open_binary(source, "input file") as handle:
        yield from jsonl_lines(handle, size, source.name, part)


def _jsonl_texts(
    source: CorpusPath, column: str, report: BuildReport, part: Part | None
) -> Iterator[str]:
    for where, line in _lines(source, part):
        try:
            text = json.loads(line)[column]
        except (ValueError, RecursionError, KeyError, TypeError, IndexError):
            text = None
        if not isinstance(text, str):
            _skip(report, where, f"no string {column!r} field; line skipped")
            continue
        yield text


def _skip(report: BuildReport, where: str, why: str) -> None:
    """Count a skipped input record; log the first few with where they are and ``why``
    (which says what was skipped)."""
    report.skipped += 1
    if report.skipped <= _WARNINGS:
        logger.warning(
            "%s: %s%s",
            where,
            why,
            " (further skips are only counted)" if report.skipped == _WARNINGS else "",
        )


def _rows(source: CorpusPath, part: Part | None) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` of every record of a JSON Lines or Parquet file that ``part``
    holds (a row that is not a JSON object comes as ``None``)."""
    if source.name.endswith(".jsonl"):
        for where, line in _lines(source, part):
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            yield where, row if isinstance(row, dict) else None
        return
    with _parquet_file(source) as handle:
        groups = row_groups(handle.num_row_groups, part)
        # Row numbers count from the file's start, whichever part reads them.
        first = groups[0] if groups else 0
        number = sum(handle.metadata.row_group(g).num_rows for g in range(first))
        for batch in _row_group_batches(handle, groups, None):
            for row in batch.to_pylist():
                yield f"{source.name}:{number}", row
                number += 1


@contextlib.contextmanager
def _parquet_file(source: CorpusPath) -> Iterator[Any]:
    """The Parquet input opened (a store's object read by ranges through the cache)."""
    from streampack.corpus.arrow import import_pyarrow

    pa = import_pyarrow("Parquet files")
    import pyarrow.parquet as pq

    with contextlib.ExitStack() as stack:
        where: Any = str(source)
        if isinstance(source, Url):
            where = stack.enter_context(open_binary(source, "input file"))
        try:
            handle = pq.ParquetFile(where)
        except (pa.ArrowException, OSError) as exc:
            raise InvalidConfig(
                f"Parquet file {str(source)!r} is corrupt or not Parquet: {exc}"
            ) from None
        yield handle


def _row_group_batches(handle: Any, groups: list[int], columns: list[str] | None) -> Iterator[Any]:
    """The record batches of ``groups`` (none when there are none: pyarrow would read
    every group for an empty list)."""
    if groups:
        yield from handle.iter_batches(batch_size=_BATCH, row_groups=groups, columns=columns)


def _parquet_texts(
    source: CorpusPath, column: str, report: BuildReport, part: Part | None
) -> Iterator[str]:
    from streampack.corpus.arrow import import_pyarrow

    pa = import_pyarrow("Parquet files")
    with _parquet_file(source) as handle:
        yield from _parquet_column(pa, handle, source, column, report, part)


def _parquet_column(
    pa: Any, handle: Any, path: CorpusPath, column: str, report: BuildReport, part: Part | None
) -> Iterator[str]:
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
    groups = row_groups(handle.num_row_groups, part)
    for batch in _row_group_batches(handle, groups, [column]):
        for text in batch.column(0).to_pylist():
            if text is None:
                report.skipped += 1
                continue
            yield text


def _batched(items: Iterable[_Item]) -> Iterator[list[_Item]]:
    batch: list[_Item] = []
    for item in items:
        batch.append(item)
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


def _prompt_completion(row: Any, eos: str | None) -> tuple[str, str] | None:
    """A record's prompt and completion (ending with ``eos``), or ``None``."""
    prompt, completion = (row or {}).get("prompt"), (row or {}).get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None
    if eos is not None and not completion.endswith(eos):
        completion += eos  # TRL's rule: the EOS is part of the completion
    return prompt, completion


def _conversation(row: Any) -> list[dict[str, str]] | None:
    """A record's messages, or ``None`` when they are not all ``{role, content}`` strings."""
    messages = (row or {}).get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return messages
    return None


def _supervised_encoder(
    tokenizer: Any, fmt: str, train_on: str, report: BuildReport
) -> Callable[[list[tuple[str, Any]]], _Encoded]:
    """Per batch of ``(location, row)`` records: the usable rows tokenized in one call
    (see the module docstring), the others skipped and logged in record order."""
    eos = tokenizer.eos_token

    def parse(row: Any) -> Any:
        return _prompt_completion(row, eos) if fmt == "prompt-completion" else _conversation(row)

    def tokenize(inputs: list[Any]) -> list[tuple[list[int], list[int]] | str]:
        """``(tokens, mask)`` per input, or why it is skipped."""
        if fmt == "prompt-completion":
            prompts = tokenizer([p for p, _ in inputs])["input_ids"]
            whole = tokenizer([p + c for p, c in inputs])["input_ids"]
            starts = [_common_prefix(p, ids) for p, ids in zip(prompts, whole)]
            return [(ids, [0] * n + [1] * (len(ids) - n)) for ids, n in zip(whole, starts)]
        rendered = tokenizer.apply_chat_template(
            inputs,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=train_on != "all",
        )
        out: list[tuple[list[int], list[int]] | str] = []
        for k, ids in enumerate(rendered["input_ids"]):
            if train_on == "all":
                mask = [1] * len(ids)
            else:
                mask = list(rendered["assistant_masks"][k])
                mask = _last_run(mask) if train_on == "last" else mask
            out.append((list(ids), mask) if any(mask[1:]) else "no assistant tokens to train on")
        return out

    unusable = (
        "no string 'prompt' and 'completion' fields"
        if fmt == "prompt-completion"
        else "no 'messages' list of {'role', 'content'} strings"
    )

    def encode(records: list[tuple[str, Any]]) -> _Encoded:
        parsed = [parse(row) for _, row in records]
        usable = [p for p in parsed if p is not None]
        results = iter(tokenize(usable) if usable else [])
        ids: list[list[int]] = []
        masks: list[list[int]] = []
        for (where, _), item in zip(records, parsed):
            result = unusable if item is None else next(results)
            if isinstance(result, str):
                _skip(report, where, f"{result}; skipped")
                continue
            ids.append(result[0])
            masks.append(result[1])
        return _encoded(ids, masks)

    return encode


def _text_encoder(tokenizer: Any, eos_id: int | None) -> Callable[[list[str]], _Encoded]:
    """Per batch of texts: each encoded with the tokenizer's special tokens (and
    ``eos_id`` appended), in one parallel call."""
    # encode_batch_fast (newer tokenizers) leaves out the character offsets, which a
    # build never reads: the same ids, in about half the time.
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode(texts: list[str]) -> _Encoded:
        ids = [e.ids for e in encode_batch(texts, add_special_tokens=True)]
        if eos_id is not None:
            for document in ids:
                document.append(eos_id)
        return _encoded(ids)

    return encode


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """A batch's documents: their tokens end to end, their lengths, their masks."""

    tokens: np.ndarray  # int64
    lengths: np.ndarray  # int64, one per document
    mask: np.ndarray | None  # uint8, one per token (fine-tuning formats)


def _encoded(ids: list[list[int]], masks: list[list[int]] | None = None) -> _Encoded:
    lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=total)
    mask = None
    if masks is not None:
        mask = np.fromiter(itertools.chain.from_iterable(masks), np.uint8, count=total)
    return _Encoded(tokens, lengths, mask)


_Item = TypeVar("_Item")


def _pipeline(
    batches: Iterator[_Item], encode: Callable[[_Item], _Encoded], threads: int = 1
) -> Generator[_Encoded, None, None]:
    """The encoded batches, in input order: ``batches`` read in one thread, encoded in
    ``threads`` others (the module docstring's picture)."""
    read = read_ahead(batches, _DEPTH, "corpus-build-read")
    try:
        yield from map_in_order(encode, read, threads, threads * _DEPTH, "corpus-build-encode")
    finally:
        read.close()  # after the encoder threads have stopped: nothing reads it any more


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while the block runs (tokenizers reads it at
    every call), then as it was: the build's own threads encode one batch each."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _write(
    encoded: Generator[_Encoded, None, None],
    writer: _ShardWriter,
    report: BuildReport,
    progress: Any,
) -> None:
    """Write every encoded batch into shards, counting it in ``report``."""
    with contextlib.closing(encoded):  # a failed write stops the other threads
        for batch in encoded:
            writer.add(batch)
            report.documents += len(batch.lengths)
            report.tokens += len(batch.tokens)
            if batch.mask is not None:
                report.supervised = (report.supervised or 0) + int(batch.mask.sum())
            if progress is not None:
                progress.update(done=report.documents, tokens=report.tokens)


def build_corpus(
    source: str | Path | Url,
    tokenizer_path: Path,
    out: str | Path | Url,
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
    shard: Part | None = None,
    storage: StorageOptions | None = None,
) -> BuildReport:
    """Tokenize ``source`` (``.jsonl`` or ``.parquet``, a path or a URL) into token
    shards and a manifest in ``out`` (a directory, created, or a store's folder; refused
    when it already holds a manifest). ``progress``, when given, is a
    :class:`streampack.progress.Progress` updated per batch. ``fmt``
    ``prompt-completion`` and ``messages`` write masked shards (module docstring).
    ``shard`` builds only that part of the input, into its part folder, with its
    record instead of a manifest (:mod:`.parts`); ``storage`` says how URLs are reached."""
    storage = storage or StorageOptions(cache_bytes=BUILD_CACHE_BYTES)
    source = as_location(source, storage)
    regular_file(source, "input file")
    if not source.name.endswith((".jsonl", ".parquet")):
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
    run = _Run(
        source=source,
        part=shard,
        root=as_location(out, storage),
        settings={
            "build_format": fmt,
            "text_column": text_column if fmt == "text" else None,
            "eos": eos,
            "train_on": train_on if fmt == "messages" else None,
            "partition": partition,
            "split_receipt": split_receipt,
        },
        started=time.perf_counter(),
    )
    if fmt != "text":
        return _build_supervised(
            run,
            tokenizer_path,
            eos=eos,
            shard_tokens=shard_tokens,
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
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    report = BuildReport()
    writer = run.start(report, vocab_size, tokenizer_identity(tokenizer_path), shard_tokens, False)
    reader = _jsonl_texts if source.name.endswith(".jsonl") else _parquet_texts
    texts = _batched(reader(source, text_column, report, shard))
    threads = usable_cores()
    with _tokenizer_threads_off():
        encoded = _pipeline(texts, _text_encoder(tokenizer, eos_id), threads)
        _write(encoded, writer, report, progress)
    return run.finish(writer, report, f"text under {text_column!r}")


def _build_supervised(
    run: _Run,
    tokenizer_path: Path,
    *,
    eos: str | None,
    shard_tokens: int,
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
    report = BuildReport(supervised=0)
    identity = _hf_identity(tokenizer_path, template)
    writer = run.start(report, len(tokenizer), identity, shard_tokens, True)
    encode = _supervised_encoder(tokenizer, fmt, train_on, report)
    _write(_pipeline(_batched(_rows(run.source, run.part)), encode), writer, report, progress)
    what = "prompt/completion pairs" if fmt == "prompt-completion" else "conversations"
    return run.finish(writer, report, what)


@dataclasses.dataclass
class _Run:
    """One build: what it reads, the folder it writes (``root``, or a part's folder
    under it), and the settings a part records for ``corpus merge`` to compare."""

    source: CorpusPath
    part: Part | None
    root: CorpusPath
    settings: dict[str, Any]
    started: float

    def start(
        self, report: BuildReport, vocab_size: int, tokenizer: str, shard_tokens: int, masked: bool
    ) -> _ShardWriter:
        """The output folder made ready (refused when it holds a corpus already) and
        its writer; the binding in ``report`` (a part's without the default
        ``split_receipt``: the merge hashes the input once)."""
        root = Output(self.root)
        if root.exists("manifest.json"):
            raise InvalidConfig(
                f"--out {str(root)!r} already holds a corpus (manifest.json); choose a new "
                f"directory"
            )
        out = root if self.part is None else root.child(self.part.folder)
        out.make()
        if self.part is not None:
            out.remove(PART_RECORD)  # a part built again (a retried job) is built anew
        receipt = self.settings["split_receipt"]
        if receipt is None and self.part is None:
            receipt = f"{self.source.name} sha256:{file_sha256(self.source)}"
        report.binding = {
            "vocab_size": vocab_size,
            "tokenizer": tokenizer,
            "split_receipt": receipt,
            "partition": self.settings["partition"],
        }
        return _ShardWriter(out, vocab_size, shard_tokens, masked=masked)

    def finish(self, writer: _ShardWriter, report: BuildReport, what: str) -> BuildReport:
        """Flush the last shard, write the manifest (a part: its record) and time the
        build."""
        if writer.lengths:
            writer.flush()
        report.shards = len(writer.names)
        try:
            if self.part is not None:
                writer.out.put(ROWS_NAME, writer.table.write)  # the merge joins them
                write_record(writer.out, self.part, self._record(writer, report))
            elif not writer.names:
                raise InvalidConfig(f"{str(self.source)!r} holds no {what}: nothing to build")
            else:
                manifest: dict[str, Any] = {
                    "format": MANIFEST_FORMAT,
                    "version": MANIFEST_VERSION,
                    "binding": report.binding,
                    "shards": writer.names,
                }
                if writer.masked:
                    manifest["mask"] = True
                write_manifest(writer.out, manifest, writer.table)
        finally:
            writer.table.close()
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        report.seconds = round(elapsed, 3)
        report.documents_per_second = round(report.documents / elapsed, 1)
        report.tokens_per_second = round(report.tokens / elapsed, 1)
        return report

    def _record(self, writer: _ShardWriter, report: BuildReport) -> dict[str, Any]:
        """What a part's record holds: the settings and input every part must share,
        its shards and counts."""
        source = self.source
        if isinstance(source, Url):
            location, version = str(source), RemoteFile(source, "input file").etag
        else:
            location, version = str(source.resolve()), None
        return {
            **self.settings,
            "tokenizer": report.binding["tokenizer"],
            "vocab_size": report.binding["vocab_size"],
            "source": {
                "name": source.name,
                "location": location,
                "bytes": file_size(source, "input file"),
                "version": version,
            },
            "masked": writer.masked,
            "shards": writer.names,
            "documents": report.documents,
            "tokens": report.tokens,
            "skipped": report.skipped,
            "supervised": report.supervised,
        }


class _ShardWriter:
    """Documents gathered into shards of about ``shard_tokens`` tokens (uint16, or
    int32 for larger vocabularies), each with its mask file when ``masked``: a shard
    ends with the document that brings it to ``shard_tokens``."""

    def __init__(self, out: Output, vocab_size: int, shard_tokens: int, *, masked: bool) -> None:
        self.out = out
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        self.shard_tokens = shard_tokens
        self.masked = masked
        self.names: list[str] = []
        # The pending shard, in pieces of batches: tokens, document lengths, masks.
        self.tokens: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending_tokens = 0
        self.vocab_size = vocab_size
        # The document table's rows (corpus/tables.py), computed from each shard as
        # written: the tokens and masks its reader will yield.
        self.table = RowSpool()

    def add(self, batch: _Encoded) -> None:
        ends = np.cumsum(batch.lengths)  # each document's end in batch.tokens
        first = 0  # the first document of the batch not yet in a shard
        while first < len(ends):
            start = int(ends[first - 1]) if first else 0
            filled = self.pending_tokens + (ends[first:] - start)
            # The document that fills the shard (len(ends) when none does).
            full = first + int(np.searchsorted(filled, self.shard_tokens))
            stop = min(full + 1, len(ends))
            end = int(ends[stop - 1])
            self.tokens.append(batch.tokens[start:end].astype(self.dtype))
            self.lengths.append(batch.lengths[first:stop])
            if batch.mask is not None:
                self.masks.append(batch.mask[start:end])
            self.pending_tokens += end - start
            if full < len(ends):
                self.flush()
            first = stop

    def flush(self) -> None:
        name = f"shard-{len(self.names):05d}"
        lengths = np.concatenate(self.lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays = {"tokens": np.concatenate(self.tokens), "offsets": offsets}
        if self.masked:
            arrays["mask"] = np.concatenate(self.masks)
        for kind, array in arrays.items():
            self.out.put(f"{name}.{kind}.npy", functools.partial(np.save, arr=array))
        self.table.add(
            block_rows(
                arrays["tokens"],
                lengths,
                self.vocab_size,
                masked=self.masked,
                mask=arrays.get("mask"),
            )
        )
        self.names.append(name)
        self.tokens, self.lengths, self.masks, self.pending_tokens = [], [], [], 0
