"""``corpus build --shard I/N``: the part of the input that part I of N builds, and
``corpus merge``: the one manifest over every part.

The split is a pure function of the input file, so N machines that never talk agree on
it, and the parts concatenated in order hold exactly the documents of the whole file in
its order::

    JSON Lines (bytes)   |----- part 0 -----|----- part 1 -----|----- part 2 -----|
                         0               size/3            2size/3              size
    a line belongs to the part its first byte falls in (it may end in the next one)

    Parquet              row groups [G*I//N, G*(I+1)//N) (a part may get none)

Part I writes its shards under ``OUT/part-IIIII-of-NNNNN/``, then ``part.json`` there
(last: a part is built exactly when its record exists). ``corpus merge`` reads every
record, checks that all N are there and were built from the same input with the same
settings and tokenizer, and writes ``OUT/manifest.json`` naming every part's shards in
part order. The binding's default ``split_receipt`` (the input file's SHA-256) is
computed by the merge, once: a part reads only its own share of the input.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from streampack.corpus.files import file_sha256
from streampack.corpus.manifest import MANIFEST_FORMAT, MANIFEST_VERSION
from streampack.corpus.output import Output
from streampack.corpus.storage import CorpusPath, as_location
from streampack.errors import CorpusUnavailable, InvalidConfig

PART_FORMAT = "streampack-corpus-part"
PART_RECORD = "part.json"
_SHARD = re.compile(r"^(\d+)/(\d+)$")


@dataclasses.dataclass(frozen=True)
class Part:
    """Part ``index`` (from 0, as a Kubernetes ``JOB_COMPLETION_INDEX``) of ``count``."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Part:
        """``I/N`` as ``--shard`` gives it."""
        found = _SHARD.match(text.strip())
        if not found:
            raise InvalidConfig(
                f"--shard {text!r} is not I/N; expected two whole numbers such as 0/4 "
                f"(part I of N, numbered from 0)"
            )
        index, count = int(found.group(1)), int(found.group(2))
        if count < 1 or index >= count:
            raise InvalidConfig(
                f"--shard {text!r}: there is no part {index} of {count}; expected I/N with "
                f"N >= 1 and 0 <= I < N (parts are numbered from 0)"
            )
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def folder(self) -> str:
        return f"part-{self.index:05d}-of-{self.count:05d}"

    def span(self, total: int) -> tuple[int, int]:
        """This part's share ``[lo, hi)`` of ``total`` bytes or row groups."""
        return total * self.index // self.count, total * (self.index + 1) // self.count


def jsonl_lines(
    handle: IO[bytes], size: int, name: str, part: Part | None
) -> Iterator[tuple[str, bytes]]:
    """``(location, line)`` of every line of a JSON Lines file that ``part`` holds (the
    lines whose first byte is in its share of the bytes; every line without a part)."""
    lo, hi = (0, size) if part is None else part.span(size)
    pos = 0
    if lo > 0:  # the line running through byte lo belongs to the part before
        handle.seek(lo - 1)
        pos = lo - 1 + len(handle.readline())
    number = 0
    while pos < hi:
        line = handle.readline()
        if not line:
            break
        number += 1
        # Line numbers are known from the file's start; later parts say the byte.
        yield (f"{name}:{number}" if lo == 0 else f"{name} (line at byte {pos})"), line
        pos += len(line)


def row_groups(total: int, part: Part | None) -> list[int]:
    """The Parquet row groups ``part`` holds (all of them without a part)."""
    lo, hi = (0, total) if part is None else part.span(total)
    return list(range(lo, hi))


def write_record(out: Output, part: Part, fields: dict[str, Any]) -> None:
    """A part's record, written after its shards."""
    record = {"format": PART_FORMAT, "version": MANIFEST_VERSION, "part": part.index}
    record.update(parts=part.count, **fields)
    out.put_bytes(PART_RECORD, (json.dumps(record, indent=1) + "\n").encode())


# What every part must agree on, and the flag that sets each (for the message).
_SAME = {
    "build_format": "--format",
    "text_column": "--text-column",
    "eos": "--eos",
    "train_on": "--train-on",
    "partition": "--partition",
    "split_receipt": "--split-receipt",
    "tokenizer": "--tokenizer",
    "vocab_size": "--tokenizer",
    "source": "--from",
}


def _read_record(out: Output, part: Part) -> dict[str, Any] | None:
    where = out.child(part.folder)
    try:
        data = json.loads(where.read(PART_RECORD, "part record"))
    except CorpusUnavailable as exc:
        if exc.missing:
            return None
        raise
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as exc:
        raise InvalidConfig(f"part record {str(where)}/{PART_RECORD} is not JSON: {exc}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != PART_FORMAT
        or data.get("version") != MANIFEST_VERSION
        or (data.get("part"), data.get("parts")) != (part.index, part.count)
    ):
        raise InvalidConfig(
            f"{str(where)}/{PART_RECORD} is not the record of part {part} written by "
            f"corpus build --shard {part}"
        )
    return data


def _write_merged(out: Output, parts: list[Part], manifest: dict[str, Any]) -> None:
    """The manifest, after the document table joined from the parts' rows (the rows a
    single build writes, byte for byte); without a table when a part has no rows (built
    by an older streampack)."""
    from streampack.corpus.tables import ROWS_NAME, RowSpool, write_manifest

    folders = [out.child(part.folder) for part in parts]
    if not all(folder.exists(ROWS_NAME) for folder in folders):
        out.put_bytes("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
        return
    spool = RowSpool()
    try:
        for folder in folders:
            spool.add(np.load(io.BytesIO(folder.read(ROWS_NAME, "part's document table"))))
        write_manifest(out, manifest, spool)
    finally:
        spool.close()


def merge_parts(out_path: str | CorpusPath, count: int, storage: Any = None) -> dict[str, Any]:
    """Write ``manifest.json`` over the ``count`` parts under ``out_path``; the merged
    corpus's figures, as ``corpus build`` reports them."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidConfig(f"--parts {count!r}; expected the N of --shard I/N (N >= 1)")
    out = Output(as_location(out_path, storage))
    if out.exists("manifest.json"):
        raise InvalidConfig(f"--out {str(out)!r} already holds a corpus (manifest.json)")
    parts = [Part(i, count) for i in range(count)]
    records = [_read_record(out, part) for part in parts]
    missing = [str(p.index) for p, r in zip(parts, records) if r is None]
    if missing:
        raise InvalidConfig(
            f"corpus merge: part(s) {', '.join(missing)} of {count} are not built under "
            f"{str(out)!r} (no {parts[int(missing[0])].folder}/{PART_RECORD}); run corpus "
            f"build --shard I/{count} for each, then merge again"
        )
    built = [r for r in records if r is not None]
    first = built[0]
    for part, record in zip(parts[1:], built[1:]):
        for key, flag in _SAME.items():
            if record.get(key) != first.get(key):
                raise InvalidConfig(
                    f"corpus merge: part {part.index} was built with {key} "
                    f"{record.get(key)!r} and part 0 with {first.get(key)!r}; build every "
                    f"part with the same {flag} (and the same input)"
                )
    documents = sum(int(r["documents"]) for r in built)
    source = first["source"]
    if documents == 0:
        raise InvalidConfig(f"{source['location']!r} holds no documents: nothing to merge")
    receipt = first["split_receipt"]
    if receipt is None:  # the default: the whole input's hash, read once, here
        location = as_location(source["location"], storage)
        receipt = f"{source['name']} sha256:{file_sha256(location)}"
    binding = {
        "vocab_size": first["vocab_size"],
        "tokenizer": first["tokenizer"],
        "split_receipt": receipt,
        "partition": first["partition"],
    }
    shards = [f"{p.folder}/{name}" for p, r in zip(parts, built) for name in r["shards"]]
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "binding": binding,
        "shards": shards,
    }
    if first["masked"]:
        manifest["mask"] = True
    _write_merged(out, parts, manifest)
    return {
        "out": str(out),
        "parts": count,
        "documents": documents,
        "tokens": sum(int(r["tokens"]) for r in built),
        "shards": len(shards),
        "skipped": sum(int(r["skipped"]) for r in built),
        "binding": binding,
        "supervised": sum(int(r["supervised"]) for r in built) if first["masked"] else None,
    }
