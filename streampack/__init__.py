"""streampack: next-fit sequence packing that keeps every example exactly as it was."""

from .batch import NO_SEGMENT, OCCURRENCE_DTYPE, PAD_CELL, CuSeqlens, PackedBatch
from .config import PackConfig
from .errors import (
    BindingMismatch,
    CapacityError,
    EmptyObjective,
    InternalError,
    InvalidArray,
    InvalidConfig,
    InvalidCoordinate,
    InvalidExample,
    MetadataBudgetError,
    OversizedExample,
    ProtocolError,
    StreampackError,
)
from .examples import Binding, Examples
from .packing import PackedEpoch, pack_examples

__all__ = [
    "NO_SEGMENT",
    "OCCURRENCE_DTYPE",
    "PAD_CELL",
    "Binding",
    "BindingMismatch",
    "CapacityError",
    "CuSeqlens",
    "EmptyObjective",
    "Examples",
    "InternalError",
    "InvalidArray",
    "InvalidConfig",
    "InvalidCoordinate",
    "InvalidExample",
    "MetadataBudgetError",
    "OversizedExample",
    "PackConfig",
    "PackedBatch",
    "PackedEpoch",
    "ProtocolError",
    "StreampackError",
    "pack_examples",
]
