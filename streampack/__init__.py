"""streampack: next-fit sequence packing that keeps every example exactly as it was."""

from .audit import AuditReport, audit
from .batch import (
    NO_SEGMENT,
    OCCURRENCE_DTYPE,
    PAD_CELL,
    CompactBatch,
    CuSeqlens,
    PackedBatch,
)
from .config import PackConfig
from .decoder import Decoder, DecoderConfig
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
from .kernels import range_attention, range_attention_backward
from .loss import LossResult, document_mean, loss_gradient, probe_logits, row_mean, token_loss
from .packing import PackedEpoch, pack_compact, pack_examples

__all__ = [
    "NO_SEGMENT",
    "OCCURRENCE_DTYPE",
    "PAD_CELL",
    "AuditReport",
    "Binding",
    "BindingMismatch",
    "CapacityError",
    "CompactBatch",
    "CuSeqlens",
    "Decoder",
    "DecoderConfig",
    "EmptyObjective",
    "Examples",
    "InternalError",
    "InvalidArray",
    "InvalidConfig",
    "InvalidCoordinate",
    "InvalidExample",
    "LossResult",
    "MetadataBudgetError",
    "OversizedExample",
    "PackConfig",
    "PackedBatch",
    "PackedEpoch",
    "ProtocolError",
    "StreampackError",
    "audit",
    "document_mean",
    "loss_gradient",
    "pack_compact",
    "pack_examples",
    "probe_logits",
    "range_attention",
    "range_attention_backward",
    "row_mean",
    "token_loss",
]
