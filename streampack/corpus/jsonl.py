"""JSON Lines of token lists, read lazily line by line.

One document per line: ``{"tokens": [...]}`` with optional ``"id"`` (int, becomes the
example id) and ``"start"``/``"stop"`` (the selected range; default the whole
document). Every line is a document and takes a source id, blank and malformed lines
too (they are quarantined as ``malformed``), so a source id always names a line.

A bad line is a document's problem; a file none of whose first lines is a document
(``SNIFF_LINES`` non-blank lines, all not JSON objects with a ``tokens`` list of
integers: compressed or binary data, another schema such as ``{"input_ids": ...}``,
a JSON array) is the file's, and refuses the corpus at open rather than quarantining
every line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.reader import BindingSpec, Record, SingleSource
from streampack.errors import InvalidConfig

#: Non-blank lines read at open: a file where none is a document is refused.
SNIFF_LINES = 8
#: A line longer than this is not judged at open (its document is screened as usual).
SNIFF_BYTES = 1 << 20
#: Reasons that say the line is not this format's document at all.
NOT_A_DOCUMENT = ("malformed", "wrong_dtype")


class JsonlSource(SingleSource):
    """JSON Lines files in manifest order; sequential (shuffles use a bounded buffer)."""

    random_access = False

    def __init__(self, paths: list[Path], binding: BindingSpec) -> None:
        self.binding = binding
        self.paths = [regular_file(path, "JSON Lines file") for path in paths]
        for path in self.paths:
            if path.stat().st_size == 0:
                raise InvalidConfig(
                    f"JSON Lines file {str(path)!r} is empty (0 bytes); "
                    f"expected one document per line"
                )
            refuse_without_documents(path)
        self.num_documents: int | None = None

    def records(self) -> Iterator[Record]:
        source_id = 0
        for path in self.paths:
            with open(path, "rb") as handle:
                for line_number, line in enumerate(handle, start=1):
                    yield parse_line(line, source_id, f"{path.name}:{line_number}")
                    source_id += 1


def refuse_without_documents(path: Path) -> None:
    """Refuse ``path`` when none of its first ``SNIFF_LINES`` non-blank lines is a
    document (see module docstring); any one that is, good or bad on its own account
    (a range, a token out of the vocabulary), or a line too long to judge, passes."""
    first = None
    seen = 0
    with open(path, "rb") as handle:
        while seen < SNIFF_LINES:
            line = handle.readline(SNIFF_BYTES)
            if not line:
                break
            if len(line) == SNIFF_BYTES and not line.endswith(b"\n"):
                return
            if not line.strip():
                continue
            seen += 1
            record = parse_line(line, 0, f"line {seen}")
            if record.reason not in NOT_A_DOCUMENT:
                return
            first = first or record
    if first is not None:
        raise InvalidConfig(
            f"JSON Lines file {str(path)!r}: none of its first {seen} non-blank line(s) is "
            f"a document (first: {first.detail}); expected one JSON object per line, "
            f'{{"tokens": [integer token ids, ...]}}'
        )


def parse_line(line: bytes, source_id: int, location: str) -> Record:
    """The document of one JSON Lines line; a bad line becomes a quarantined record."""

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
    return Record(source_id, tokens, start, stop, example_id, None, "", location)
