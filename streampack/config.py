"""PackConfig: the one frozen description of how a pack call shapes its batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidConfig, ProtocolError

#: Default metadata budget of one pack call (rule C8): 1 GiB.
DEFAULT_MAX_METADATA_BYTES = 1 << 30

_INT32_MAX = 2**31 - 1

#: Placement policies: rule C2's next-fit (the default) and the opt-in bounded best-fit.
POLICIES = ("next_fit", "best_fit")
#: Open rows of ``policy="best_fit"`` when ``open_rows`` is not given.
DEFAULT_BEST_FIT_OPEN_ROWS = 16
#: Most open rows ``best_fit`` may keep: each example scans them all.
MAX_OPEN_ROWS = 4096


def _require_positive_int(name: str, value: object, *, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfig(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise InvalidConfig(f"{name}={value} is too large; accepted: 1..{maximum}")


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """How pack_examples lays out rows and batches.

    Attributes:
        capacity: prediction pairs (cells) per row. int32 columns, so at most 2**31-1.
        max_rows_per_batch: rows in every batch but possibly the last (rule C2).
        max_cells: most cells ``rows * capacity`` one batch may hold (rule C8);
            defaults to ``capacity * max_rows_per_batch``. Must hold at least one row.
        max_metadata_bytes: most bytes one pack call may hold, planner, occurrence
            records and batch arrays together (rule C8).
        policy: where each example goes. ``"next_fit"`` (default): rule C2, in supplied
            order. ``"best_fit"`` (opt-in): the open row with the least room that still
            fits, among at most ``open_rows`` open rows (see ``streampack.packing``).
        open_rows: rows ``best_fit`` keeps open (1..4096; default 16). More rows fill
            better and plan slower. ``best_fit`` with one open row is next-fit. For
            ``next_fit`` it is 1, the only value accepted.
    """

    capacity: int
    max_rows_per_batch: int
    max_cells: int | None = None
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
    policy: str = "next_fit"
    open_rows: int | None = None

    POLICIES = POLICIES

    def to_wire(self) -> dict[str, Any]:
        """Every field, as the ``config`` of a ``window`` message carries it (the
        worker holds no settings of the stream: each window says how to pack it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> PackConfig:
        """The configuration ``to_wire`` sent. ``ProtocolError`` for a missing or
        unknown field; ``InvalidConfig`` for a value ``__post_init__`` refuses."""
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ProtocolError(f"window config {dict(fields)!r} is malformed: {exc}") from None

    @property
    def open_row_limit(self) -> int:
        """``open_rows`` as ``__post_init__`` settled it: the policy's default when not
        given, so never None."""
        return self.open_rows or 1

    def __post_init__(self) -> None:
        _require_positive_int("capacity", self.capacity, maximum=_INT32_MAX)
        _require_positive_int("max_rows_per_batch", self.max_rows_per_batch)
        _require_positive_int("max_metadata_bytes", self.max_metadata_bytes)
        max_cells = self.max_cells
        if max_cells is None:
            max_cells = self.capacity * self.max_rows_per_batch
            object.__setattr__(self, "max_cells", max_cells)
        _require_positive_int("max_cells", max_cells)
        if self.policy not in POLICIES:
            raise InvalidConfig(
                f"policy={self.policy!r}; accepted: {', '.join(map(repr, POLICIES))}"
            )
        if self.open_rows is None:
            default = DEFAULT_BEST_FIT_OPEN_ROWS if self.policy == "best_fit" else 1
            object.__setattr__(self, "open_rows", default)
        _require_positive_int("open_rows", self.open_rows, maximum=MAX_OPEN_ROWS)
        if self.policy == "next_fit" and self.open_rows != 1:
            raise InvalidConfig(
                f"open_rows={self.open_rows} with policy='next_fit', which keeps one row "
                "open; accepted: open_rows=1 (or None), or policy='best_fit'"
            )
        if max_cells < self.capacity:
            raise InvalidConfig(
                f"max_cells={self.max_cells} is smaller than one row (capacity={self.capacity}); "
                f"accepted: max_cells >= {self.capacity}"
            )
