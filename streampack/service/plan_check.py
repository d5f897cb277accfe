"""Checking a worker's plan against the window it was given.

The producer holds the truth: the window's documents and the packing contract. So it
computes the contract's plan itself, with the very function workers plan with
(:func:`streampack.packing.plan_ranges`, which honours ``PackConfig``), and accepts a
worker's answer only when it is *exactly* that plan: every occurrence record byte for
byte and every batch size. Planning a window costs microseconds; what the workers
save the producer is the audit and the message traffic, not the planning. A plan that
differs in any way (not next-fit, a rewritten ``source`` column, a shifted ordinal, a
changed range) is refused; the stream a trainer receives can therefore only be the one
``streampack digest`` computes.

The batches are built from the producer's own plan and its own copy of the window
(``planned.py``), never from anything a worker sent.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import PackConfig
from ..errors import ProtocolError, StreampackError
from ..packing import plan_ranges

if TYPE_CHECKING:  # a worker checks no window: importing windows loads the corpus readers
    from ..windows import Window


@dataclasses.dataclass(frozen=True)
class ContractPlan:
    """The contract's plan of one window, or why the window cannot be packed."""

    occurrences: np.ndarray  # every occurrence record, in order (row local to its batch)
    sizes: np.ndarray  # records per batch
    error: str = ""  # non-empty: packing this window fails by the contract (quarantine)

    @property
    def batches(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.occurrences.nbytes + self.sizes.nbytes)


def ranges_plan(arrays: dict[str, Any], config: PackConfig) -> tuple[Any, Any]:
    """The plan of a window sent without tokens, from its range frames (``Window.arrays``
    or a decoded ``window`` message): what every correct worker answers."""
    return plan_ranges(
        arrays["offsets"],
        arrays["start"],
        arrays["stop"],
        arrays["source_id"],
        arrays["example_id"],
        config,
        source=arrays["source"],
        piece_start=arrays["piece_start"],
    )


def contract_plan(window: Window, config: PackConfig) -> ContractPlan:
    """What any correct worker answers for ``window`` (``error`` set when the contract
    refuses the window: a budget too small, a document longer than a row)."""
    try:
        occurrences, sizes = ranges_plan(window.arrays(), config)
    except StreampackError as exc:
        empty = np.zeros(0, np.int64)
        return ContractPlan(occurrences=empty, sizes=empty, error=str(exc))
    return ContractPlan(occurrences=occurrences, sizes=sizes)


def check_plan(
    key: tuple[int, int],
    expected: ContractPlan,
    capacity: int,
    occurrences: np.ndarray,
    sizes: np.ndarray,
    reported_capacity: int,
) -> None:
    """Raise ``ProtocolError`` unless a worker's plan is exactly ``expected``."""

    def refuse(what: str) -> ProtocolError:
        return ProtocolError(f"plans of window {key}: {what}")

    if reported_capacity != capacity:
        raise refuse(f"capacity {reported_capacity}; this producer packs capacity {capacity}")
    if expected.error:
        raise refuse(
            f"the window cannot be packed by the contract ({expected.error}); no plan is accepted"
        )
    if sizes.shape != expected.sizes.shape or not np.array_equal(sizes, expected.sizes):
        raise refuse(
            f"batch sizes {sizes.tolist()[:8]} are not the contract's {expected.sizes.tolist()[:8]}"
        )
    if occurrences.shape != expected.occurrences.shape:
        raise refuse(
            f"{len(occurrences)} occurrence records; the contract places "
            f"{len(expected.occurrences)}, each of the window's documents once, in order"
        )
    if occurrences.tobytes() != expected.occurrences.tobytes():
        names = expected.occurrences.dtype.names or ()
        differ = [n for n in names if not np.array_equal(occurrences[n], expected.occurrences[n])]
        raise refuse(f"occurrence records differ from the contract's plan in {differ}")
