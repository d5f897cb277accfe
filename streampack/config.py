"""PackConfig: the one frozen description of how a pack call shapes its batches."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidConfig

#: Default metadata budget of one pack call (rule C8): 1 GiB.
DEFAULT_MAX_METADATA_BYTES = 1 << 30

_INT32_MAX = 2**31 - 1


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
    """

    capacity: int
    max_rows_per_batch: int
    max_cells: int | None = None
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES

    def __post_init__(self) -> None:
        _require_positive_int("capacity", self.capacity, maximum=_INT32_MAX)
        _require_positive_int("max_rows_per_batch", self.max_rows_per_batch)
        _require_positive_int("max_metadata_bytes", self.max_metadata_bytes)
        max_cells = self.max_cells
        if max_cells is None:
            max_cells = self.capacity * self.max_rows_per_batch
            object.__setattr__(self, "max_cells", max_cells)
        _require_positive_int("max_cells", max_cells)
        if max_cells < self.capacity:
            raise InvalidConfig(
                f"max_cells={self.max_cells} is smaller than one row (capacity={self.capacity}); "
                f"accepted: max_cells >= {self.capacity}"
            )
