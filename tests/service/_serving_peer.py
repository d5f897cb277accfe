"""A pack worker that plans honestly but serves consumers wrongly (tests only).

``python tests/service/_serving_peer.py MODE WORKER-FLAGS...`` runs ``streampack worker``
with one change, by MODE:

- ``tamper``: every batch it serves has its first token changed (a worker that alters
  one token of a batch: the consumer must catch it before yielding the batch);
- ``drop``: every batch it serves lacks its last document (record and tokens);
- ``repeat``: every batch it serves has its last document twice;
- ``reorder``: the tokens (and mask) of every batch's first two documents are swapped,
  the records left in place: the same token count, every token in the vocabulary;
- ``other``: it serves the first batch it ever packed for every batch of a later
  window (another window's batch, itself well formed);
- ``hang``: it accepts a consumer's ``get`` and never answers.

Its plans are exactly the contract's (the producer accepts them), so the only fault is
on the data plane.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from streampack import cli
from streampack.service import worker
from streampack.service.store import BatchStore

MODES = ("tamper", "drop", "repeat", "reorder", "other", "hang")


def spans(batch: Any) -> list[slice]:
    """Where each occurrence's tokens lie in the batch's tokens."""
    lengths = batch.occurrences["range_stop"] - batch.occurrences["range_start"]
    ends = np.cumsum(lengths).tolist()
    return [slice(end - n, end) for end, n in zip(ends, lengths.tolist())]


def remade(batch: Any, occurrences: np.ndarray, pieces: list[slice]) -> Any:
    """``batch`` with these records, and its tokens (and mask) cut into ``pieces``,
    laid end to end."""

    def cut(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else np.concatenate([array[piece] for piece in pieces])

    return dataclasses.replace(
        batch, occurrences=occurrences, tokens=cut(batch.tokens), mask=cut(batch.mask)
    )


def altered(batch: Any, mode: str) -> Any:
    """``batch`` as a ``mode`` worker serves it."""
    occ, parts = batch.occurrences, spans(batch)
    if mode == "tamper":
        tokens = batch.tokens.copy()
        tokens[0] = (int(tokens[0]) + 1) % batch.binding.vocab_size
        return dataclasses.replace(batch, tokens=tokens)
    if mode == "reorder" and len(parts) >= 2:
        return remade(batch, occ, [parts[1], parts[0], slice(parts[1].stop, None)])
    if mode == "drop" and len(parts) >= 2:
        return remade(batch, occ[:-1], [slice(0, parts[-1].start)])
    if mode == "repeat":
        return remade(batch, np.concatenate([occ, occ[-1:]]), [slice(0, None), parts[-1]])
    return batch


class WrongStore(BatchStore):
    mode = ""
    first: tuple[Any, Any] | None = None  # (key, batch) of the first batch put

    def put(self, key: Any, batch: Any, now: float) -> None:
        if self.first is None:
            self.first = (key, batch)
        super().put(key, batch, now)

    def take(self, key: Any, now: float) -> Any:
        batch = super().take(key, now)
        if batch is None:
            return None
        if self.mode == "other":
            assert self.first is not None
            first_key, first_batch = self.first
            return first_batch if key[:2] != first_key[:2] else batch
        return altered(batch, self.mode)


class ServingPeer(worker.Worker):
    mode = ""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        if self.mode != "hang":
            self.store = WrongStore(settings.store_bytes, settings.store_seconds)
            self.store.mode = self.mode

    def handle_get(self, serving: Any) -> None:
        if self.mode == "hang":
            serving.recv_multipart()  # taken, never answered
            return
        super().handle_get(serving)


if __name__ == "__main__":
    ServingPeer.mode = sys.argv[1]
    assert ServingPeer.mode in MODES, sys.argv
    worker.Worker = ServingPeer  # type: ignore[misc]
    sys.exit(cli.main(["worker", *sys.argv[2:]]))
