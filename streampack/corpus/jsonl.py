"""JSON Lines of token lists, read lazily line by line.

One document per line: ``{"tokens": [...]}`` with optional ``"id"`` (int, becomes the
example id) and ``"start"``/``"stop"`` (the selected range; default the whole
document). Every line is a document and takes a source id, blank and malformed lines
too (they are quarantined as ``malformed``), so a source id always names a line.

Supervision (:mod:`streampack.corpus.masks`): ``"mask": "FIELD"`` in the manifest
makes each line carry a list of 0/1 (or true/false) per token under ``FIELD``
(``{"tokens": [...], "mask": [0, 0, 1, 1]}``); ``"labels": "FIELD"`` a list of Hugging
Face labels (-100, or the token). A line without it, or with one of another length or
other values, is quarantined (``mask_length``, ``mask_values``, ``labels_mismatch``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.masks import MaskSpec, labels_to_mask, mask_spec
from streampack.corpus.reader import BindingSpec, Block, Record, SingleSource
from streampack.errors import InternalError, InvalidConfig


class JsonlSource(SingleSource):
    """JSON Lines files in manifest order; sequential (shuffles use a bounded buffer)."""

    random_access = False

    def __init__(
        self, paths: list[Path], binding: BindingSpec, entry: dict[str, Any] | None = None
    ) -> None:
        self.binding = binding
        self.paths = [regular_file(path, "JSON Lines file") for path in paths]
        for path in self.paths:
            if path.stat().st_size == 0:
                raise InvalidConfig(
                    f"JSON Lines file {str(path)!r} is empty (0 bytes); "
                    f"expected one document per line"
                )
        self.num_documents: int | None = None
        where = f"JSON Lines file {str(self.paths[0])!r}" if self.paths else "JSON Lines"
        # The first line's fields stand for the file's: enough to catch a supervision
        # field the manifest does not name, at the cost of one line.
        self.spec = mask_spec(entry or {}, where, _first_fields(self.paths[:1]))
        self.masked = self.spec is not None

    def records(self) -> Iterator[Record]:
        source_id = 0
        for path in self.paths:
            with open(path, "rb") as handle:
                for line_number, line in enumerate(handle, start=1):
                    yield parse_line(line, source_id, f"{path.name}:{line_number}", self.spec)
                    source_id += 1

    def blocks(self) -> Iterator[Block]:
        """The records in blocks of 1024 lines (with their locations)."""
        records = self.records()
        while chunk := list(itertools.islice(records, 1024)):
            yield Block.from_records(chunk, self.masked)

    def location(self, source_id: int) -> str:
        raise InternalError("JSON Lines blocks carry their locations (a bug)")


def _first_fields(paths: list[Path]) -> list[str]:
    """The fields of the first line of ``paths[0]`` that is a JSON object, else none."""
    for path in paths:
        with open(path, "rb") as handle:
            for line in handle:
                if line.strip():
                    try:
                        data = json.loads(line)
                    except (ValueError, UnicodeDecodeError, RecursionError):
                        return []
                    return list(data) if isinstance(data, dict) else []
    return []


def parse_line(line: bytes, source_id: int, location: str, spec: MaskSpec | None = None) -> Record:
    """The document of one JSON Lines line; a bad line becomes a quarantined record.
    With ``spec``, the line's mask (or labels, as a mask) comes with it."""

    def bad(reason: str, detail: str, tokens: np.ndarray | None = None) -> Record:
        return Record(source_id, tokens, 0, 0, source_id, reason, detail, location)

    if not line.strip():
        return bad("malformed", "blank line; expected a JSON object")
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also a 5000-digit int
        return bad("malformed", f"not JSON: {exc}")
    except RecursionError:
        # Deep nesting ("[[[[..."): the parser's recursion limit, not a crash.
        return bad("malformed", "JSON nested too deeply")
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        return bad("malformed", "expected an object with a 'tokens' list")
    raw = data["tokens"]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        kinds = sorted(
            {type(t).__name__ for t in raw if not isinstance(t, int) or isinstance(t, bool)}
        )
        return bad("wrong_dtype", f"tokens must be integers; found {kinds}")
    try:
        tokens = np.array(raw, dtype=np.int64)
    except OverflowError:
        return bad("out_of_vocabulary", "a token does not fit in 64 bits")
    example_id = data.get("id", source_id)
    if (
        isinstance(example_id, bool)
        or not isinstance(example_id, int)
        or not (-(2**63) <= example_id < 2**63)
    ):
        return bad("malformed", f"id {example_id!r} must be a 64-bit integer")
    start = data.get("start", 0)
    stop = data.get("stop", len(tokens))
    if (
        isinstance(start, bool)
        or isinstance(stop, bool)
        or not isinstance(start, int)
        or not isinstance(stop, int)
        or not 0 <= start <= stop <= len(tokens)
    ):
        return bad("bad_range", f"range [{start!r}, {stop!r}) is not inside 0..{len(tokens)}")
    if spec is None:
        return Record(source_id, tokens, start, stop, example_id, None, "", location)
    raw_mask = data.get(spec.name)
    if not isinstance(raw_mask, list):
        found = "missing" if raw_mask is None else f"a {type(raw_mask).__name__}"
        return bad(
            "mask_length",
            f"{spec.kind} field {spec.name!r} is {found}; expected a list of one value per token",
        )
    if not all(isinstance(v, int) for v in raw_mask):
        kinds = sorted({type(v).__name__ for v in raw_mask if not isinstance(v, int)})
        return bad("mask_values", f"{spec.kind} values must be integers; found {kinds}")
    try:
        mask = np.array(raw_mask, dtype=np.int64)
    except OverflowError:
        return bad("mask_values", f"a {spec.kind} value does not fit in 64 bits")
    if spec.kind == "labels":
        mask, problems = labels_to_mask(
            tokens, np.array([len(tokens)]), mask, np.array([len(mask)])
        )
        if problems:
            return bad(problems[0][1], problems[0][2])
    return Record(source_id, tokens, start, stop, example_id, None, "", location, mask)
