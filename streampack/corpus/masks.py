"""Supervision masks: which tokens of a document are trained (rule C5).

A document may carry one 0/1 value per token. The pair (input ``t[i]``, target
``t[i + 1]``) is loss-eligible exactly when its target is valid and ``mask[i + 1] ==
1``: the *target* token is marked, as in Hugging Face's ``labels`` (``labels[i] =
input_ids[i]`` where trained, ``-100`` elsewhere; the model shifts them). So::

    tokens   <s> What is 2+2 ? | 4  </s>
    mask      0   0   0  0   0 | 1   1       (TRL's completion_mask)
    pairs trained:  ?>4  4></s>             (the pair <s>>What is not: its target is 0)

Where a source says it holds masks (its manifest entry)::

    format    key                                   stored as
    shards    "mask": true (or NAME.mask.npy        NAME.mask.npy: bool or uint8, one per
              files present; "mask": false           token of NAME.tokens.npy
              ignores them)
    arrow,    "mask": "COLUMN"                      a list column of 0/1 per token (TRL's
    parquet                                         completion_mask / assistant_masks as
                                                    they are)
              "labels": "COLUMN"                    a list column of HF labels: -100 where
                                                    not trained, else equal to the token
    jsonl     "mask": "FIELD" / "labels": "FIELD"   a list per line, as above
    megatron  (none: a .bin/.idx holds no mask; asking for one is an error)

A columnar or JSON Lines source that holds a column (field) named ``labels``,
``completion_mask`` or ``assistant_masks`` but names none of them is refused at open
(``"mask": false`` says "train every token" on purpose): a mask dropped silently
trains on the prompts, a mistake that shows only in the model.

A mixture is masked when any of its sources is; the documents of its unmasked
sources then carry an all-ones mask, so a window's ``mask`` is ``None`` exactly for a
corpus without masks (whose windows stay byte-identical to before masks existed).

Readers hand the window cut each document's mask in its stored dtype (any integer or
bool), with its own length; the screen (``streampack.windows``) checks it against the
document (``mask_length``, ``mask_values``, ``unsupervised``) and keeps it as one
uint8 per token. Labels are turned into a mask as they are read, where the labels are
at hand, and a label that is neither -100 nor its token quarantines the document
(``labels_mismatch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from streampack.errors import InvalidConfig

IGNORE_INDEX = -100  # Hugging Face's label for "not trained"
#: Columns (JSON fields) that hold supervision in the datasets users bring (TRL's
#: completion-only and assistant-only preparation, and Hugging Face labels).
SUPERVISION_NAMES = ("labels", "completion_mask", "assistant_masks")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Where a columnar or JSON Lines source keeps its supervision."""

    kind: str  # "mask" (0/1 per token) or "labels" (-100 or the token, per token)
    name: str  # the column or field


def mask_spec(entry: dict[str, Any], where: str, present: Iterable[str]) -> MaskSpec | None:
    """A columnar or JSON Lines source's ``mask`` / ``labels`` key, checked.

    ``present`` are the column (field) names the source holds, so that a supervision
    column nobody named is refused rather than ignored."""
    mask, labels = entry.get("mask"), entry.get("labels")
    if mask is not None and labels is not None:
        raise InvalidConfig(
            f"{where}: both mask {mask!r} and labels {labels!r} are set; give one of them"
        )
    for key, value in (("mask", mask), ("labels", labels)):
        if value is None or (key == "mask" and value is False):
            continue
        if not isinstance(value, str) or not value:
            raise InvalidConfig(
                f"{where}: {key} {value!r} must name a column (field) of the source, "
                f'e.g. "{key}": "{"completion_mask" if key == "mask" else "labels"}"'
                + ('; or "mask": false to train every token' if key == "mask" else "")
            )
        return MaskSpec(key, value)
    unnamed = [n for n in SUPERVISION_NAMES if n in set(present)]
    if mask is None and unnamed:
        name = unnamed[0]
        key = "labels" if name == "labels" else "mask"
        raise InvalidConfig(
            f"{where} holds a {name!r} column but the manifest names no supervision; set "
            f'"{key}": "{name}" to train only the tokens it marks, or "mask": false to '
            f"train every token"
        )
    return None


def refuse_mask(entry: dict[str, Any], where: str, what: str) -> None:
    """For a format that cannot hold a mask: a ``mask`` or ``labels`` key is an error."""
    for key in ("mask", "labels"):
        if entry.get(key) not in (None, False):
            raise InvalidConfig(
                f"{where}: {key} {entry[key]!r} is set, but {what} hold no supervision mask; "
                f"store a masked corpus as token shards with NAME.mask.npy, Arrow or "
                f"Parquet (a mask or labels column) or JSON Lines"
            )


def labels_to_mask(
    tokens: np.ndarray, lengths: np.ndarray, labels: np.ndarray, label_lengths: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, str, str]]]:
    """The 0/1 mask ``labels != -100`` (bool, each document its labels' length) and the
    documents whose labels disagree with their tokens, as ``(position, reason, detail)``.

    ``tokens``/``labels`` are documents concatenated with ``lengths``/``label_lengths``;
    a document of two lengths is left to the screen (``mask_length``) and not compared."""
    labels = np.asarray(labels)
    mask = labels != IGNORE_INDEX
    same = lengths == label_lengths
    problems: list[tuple[int, str, str]] = []
    if not len(labels):
        return mask, problems
    # The tokens and labels of the documents of one length line up once both are cut
    # down to those documents.
    token_part = np.asarray(tokens)[np.repeat(same, lengths)]
    label_part = labels[np.repeat(same, label_lengths)]
    wrong = mask[np.repeat(same, label_lengths)] & (label_part != token_part)
    if wrong.any():
        docs = np.flatnonzero(same)
        doc_of = np.repeat(np.arange(len(docs)), lengths[same])
        starts = np.cumsum(lengths[same]) - lengths[same]
        seen: set[int] = set()
        for at in np.flatnonzero(wrong).tolist():
            d = int(doc_of[at])
            if d in seen:
                continue
            seen.add(d)
            k = at - int(starts[d])
            problems.append(
                (
                    int(docs[d]),
                    "labels_mismatch",
                    f"label {int(label_part[at])} at token {k} is neither -100 nor the "
                    f"token {int(token_part[at])}",
                )
            )
    return mask, problems
