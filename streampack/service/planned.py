"""A batch as the producer holds it: its plan and the window it comes from. No sockets.

The producer never needs a batch's tokens gathered to steer it. What it counts
(real tokens, supervised targets by rank and source, a step's targets) comes from the
occurrence records and one per-document column of the window; what it routes (the
route digest, ``wire.route_digest``) from the content digests of the documents'
selected ranges, computed straight from the window's buffer. Only a batch that goes
to a consumer with its tokens (``data_plane = "producer"``, a window no serving worker
holds, a reroute) is gathered, by :meth:`PlannedBatch.compact`, when it is sent.

The per-document columns are computed once per window, and only when first asked for
(``WindowFacts``): a window whose batches all go with their tokens is never hashed, and
one whose every batch is routed is never gathered.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import wire
from ..batch import CompactBatch, occurrence_sources
from ..digests import range_digests
from ..errors import InternalError
from ..examples import Binding
from ..windows import Window
from .plan_check import ContractPlan


class WindowFacts:
    """Per-document columns of one window that its batches share."""

    def __init__(self, window: Window, binding: Binding) -> None:
        self.window = window
        self.binding = binding

    @functools.cached_property
    def contents(self) -> np.ndarray:
        """``(documents, DIGEST_BYTES)``: the content digest of each document's selected
        range, in the token frame dtype. Whole documents are hashed in place (the
        window's own buffer); narrower ranges (a split long document's piece is whole in
        the window; a JSON Lines line's ``start``/``stop`` is not) are gathered first."""
        window = self.window
        dtype = wire.token_dtype(self.binding.vocab_size)
        if window.whole_documents:
            tokens, mask, offsets = window.tokens, window.mask, window.offsets
        else:
            n = len(window.start)
            tokens, mask = window.selected_tokens(0, n), window.selected_mask(0, n)
            offsets = np.zeros(n + 1, np.int64)
            np.cumsum(window.stop - window.start, out=offsets[1:])
        return range_digests(tokens.astype(dtype, copy=False), offsets, mask)

    @functools.cached_property
    def targets(self) -> np.ndarray:
        """int64 per document: the loss-eligible targets of its selected range (every
        token of it but the first, where the mask marks it; all of them unmasked)."""
        window = self.window
        pairs = (window.stop - window.start - 1).astype(np.int64)
        if window.mask is None:
            return pairs
        marked = np.zeros(window.mask.size + 1, np.int64)
        np.cumsum(window.mask, out=marked[1:])
        first = window.offsets[:-1] + window.start
        return marked[window.offsets[:-1] + window.stop] - marked[first + 1]


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """One batch of a window: its occurrence records and shape, tokens not gathered.

    It answers what the producer asks of a ``CompactBatch`` (``nbytes``, the counts,
    ``sources``) with the same values, without its tokens."""

    facts: WindowFacts
    occurrences: np.ndarray
    rows: int
    capacity: int
    policy: str
    step_targets: None = None  # the producer's delivery sets a step's targets per asker

    @property
    def binding(self) -> Binding:
        return self.facts.binding

    @property
    def sources(self) -> np.ndarray:
        return occurrence_sources(self.occurrences)

    @property
    def nbytes(self) -> int:
        """What its ``compact()`` holds: records, tokens in the frame dtype, their mask
        (the reorder budget counts batches as they would travel)."""
        tokens = int((self.occurrences["range_stop"] - self.occurrences["range_start"]).sum())
        width = wire.token_dtype(self.binding.vocab_size).itemsize
        mask = 0 if self.facts.window.mask is None else tokens
        return int(self.occurrences.nbytes) + tokens * width + mask

    def supervised_targets_by_occurrence(self) -> np.ndarray:
        """As ``CompactBatch.supervised_targets_by_occurrence`` (int64)."""
        return self.facts.targets[self.occurrences["ordinal"]]

    @property
    def supervised_targets(self) -> int:
        return int(self.supervised_targets_by_occurrence().sum())

    def route_digest(self) -> bytes:
        """``wire.route_digest`` of this batch: what a consumer's ``wire.frames_digest``
        of the frames a worker serves must equal."""
        return wire.route_digest(self.occurrences, self.facts.contents[self.occurrences["ordinal"]])

    def compact(self) -> CompactBatch:
        """The batch with its tokens (and mask), gathered from the window by the
        records' ordinals (best-fit's are not consecutive: a later document may sit in
        an earlier row)."""
        window, ordinals = self.facts.window, self.occurrences["ordinal"]
        return CompactBatch(
            tokens=window.batch_tokens(ordinals),
            mask=window.batch_mask(ordinals),
            occurrences=self.occurrences,
            rows=self.rows,
            capacity=self.capacity,
            binding=self.binding,
            policy=self.policy,
        )


def plan_batches(
    window: Window,
    plan: ContractPlan,
    binding: Binding,
    capacity: int,
    max_rows_per_batch: int,
    policy: str = "next_fit",
) -> list[PlannedBatch]:
    """The batches of the contract's plan of ``window``, sharing one ``WindowFacts``."""
    facts = WindowFacts(window, binding)
    batches = []
    ends = np.cumsum(plan.sizes)
    for first, last in zip((ends - plan.sizes).tolist(), ends.tolist()):
        occurrences = plan.occurrences[first:last]
        rows = int(occurrences["row"][-1]) + 1
        if rows > max_rows_per_batch:
            raise InternalError(
                f"plan_ranges placed {rows} rows in one batch of window "
                f"{(window.epoch, window.index)}; max_rows_per_batch is "
                f"{max_rows_per_batch}"
            )
        batches.append(PlannedBatch(facts, occurrences, rows, capacity, policy))
    return batches
