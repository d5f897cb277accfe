"""streampack: next-fit sequence packing that keeps every example exactly as it was.

The public names below are loaded on first use (PEP 562), so that ``import
streampack.errors`` or ``import streampack.client`` does not pay for Numba, the
decoder or the audit. ``from streampack import X`` and ``streampack.X`` work as
before; ``__all__`` lists every public name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The errors and the config have no dependencies: loaded eagerly.
from .config import PackConfig
from .errors import (
    BindingMismatch,
    CapacityError,
    CorpusUnavailable,
    EmptyObjective,
    InternalError,
    InvalidArray,
    InvalidConfig,
    InvalidCoordinate,
    InvalidExample,
    MetadataBudgetError,
    OversizedExample,
    ProtocolError,
    ResumeError,
    StreampackError,
    StreamTimeout,
)

if TYPE_CHECKING:
    from .auditing import AuditReport, audit
    from .batch import NO_SEGMENT, OCCURRENCE_DTYPE, PAD_CELL, CompactBatch, CuSeqlens, PackedBatch
    from .client import BatchStream
    from .decoder import Decoder, DecoderConfig
    from .examples import Binding, Examples
    from .kernels import range_attention, range_attention_backward
    from .loss import (
        LossResult,
        document_mean,
        loss_gradient,
        probe_logits,
        row_mean,
        token_loss,
    )
    from .packing import PackedEpoch, pack_compact, pack_examples

# Public name -> the module (relative to this package) that defines it.
_LAZY: dict[str, str] = {
    "AuditReport": ".auditing",
    "audit": ".auditing",
    "NO_SEGMENT": ".batch",
    "OCCURRENCE_DTYPE": ".batch",
    "PAD_CELL": ".batch",
    "CompactBatch": ".batch",
    "CuSeqlens": ".batch",
    "PackedBatch": ".batch",
    "BatchStream": ".client",
    "Decoder": ".decoder",
    "DecoderConfig": ".decoder",
    "Binding": ".examples",
    "Examples": ".examples",
    "range_attention": ".kernels",
    "range_attention_backward": ".kernels",
    "LossResult": ".loss",
    "document_mean": ".loss",
    "loss_gradient": ".loss",
    "probe_logits": ".loss",
    "row_mean": ".loss",
    "token_loss": ".loss",
    "PackedEpoch": ".packing",
    "pack_compact": ".packing",
    "pack_examples": ".packing",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "NO_SEGMENT",
    "OCCURRENCE_DTYPE",
    "PAD_CELL",
    "AuditReport",
    "BatchStream",
    "Binding",
    "BindingMismatch",
    "CapacityError",
    "CorpusUnavailable",
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
    "ResumeError",
    "StreamTimeout",
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
