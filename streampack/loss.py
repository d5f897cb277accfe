"""The token-weighted objective (rule C7), its optimizer-step form, and the
constructed-logit probe.

Loss = (sum of NLL over loss-eligible targets) / (their count), across all rows. Cells
that are not loss-eligible are dropped *before* any arithmetic, by gathering the
eligible cells first, so a NaN or inf parked there can never reach the result
(multiplying it by a zero mask would give NaN).

Over one optimizer step the count is that of the whole step: ``W`` data-parallel ranks
times ``A`` gradient-accumulation micro-batches. Rank ``r``'s micro-batch ``a`` of step
``s`` is global batch ``base + (s * A + a) * W + r``, so step ``s`` is the ``A * W``
consecutive global batches ``step_range`` gives (``W = 2, A = 2``)::

    global batch   0   1   2   3 | 4   5   6   7 | ...
    rank           0   1   0   1 | 0   1   0   1
    micro-batch    0   0   1   1 | 0   0   1   1
    step           0             | 1

Each batch carries ``step_targets``, the loss-eligible targets of its step (all ranks,
all micro-batches; a filler counts 0, a batch a drop tail leaves out is in no step).
A rank's loss for one micro-batch is then ``nll_sum * W / step_targets``: summing it
over the ``A`` micro-batches and taking DDP's mean over the ``W`` ranks gives exactly
``(NLL over the step) / step_targets``, with no communication; a filler's ``nll_sum``
is 0, so its loss is exactly 0 and its gradient zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .batch import PackedBatch
from .errors import EmptyObjective, InvalidArray


class LossResult(NamedTuple):
    sum: float
    count: int  # type: ignore[assignment]  # a field named like tuple.count, on purpose: the API's name
    mean: float


def _eligible(logits: np.ndarray, batch: PackedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat indices, float64 logits and gold classes of every loss-eligible cell."""
    vocab = batch.binding.vocab_size
    expected = (batch.rows, batch.capacity, vocab)
    if not isinstance(logits, np.ndarray) or logits.shape != expected:
        shape = getattr(logits, "shape", None)
        raise InvalidArray(
            f"logits has shape {shape}; expected [rows, capacity, vocab] = {expected}"
        )
    if logits.dtype.kind != "f":
        raise InvalidArray(f"logits has dtype {logits.dtype}; expected a floating dtype")
    cells = np.flatnonzero(batch.loss_mask.ravel())
    if cells.size == 0:
        raise EmptyObjective(
            "batch has 0 loss-eligible targets; the token mean has no denominator "
            "(accepted: a batch with at least one eligible target)"
        )
    gathered = logits.reshape(-1, vocab)[cells].astype(np.float64)
    gold = batch.targets.ravel()[cells].astype(np.int64)
    return cells, gathered, gold


def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _nll(logits: np.ndarray, batch: PackedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cells, gathered, gold = _eligible(logits, batch)
    log_p = _log_softmax(gathered)
    return cells, -log_p[np.arange(gold.size), gold], log_p


def token_loss(logits: np.ndarray, batch: PackedBatch) -> LossResult:
    """Token-weighted mean NLL over loss-eligible targets, with its sum and count."""
    _, nll, _ = _nll(logits, batch)
    total = float(nll.sum())
    return LossResult(total, int(nll.size), total / nll.size)


def loss_gradient(logits: np.ndarray, batch: PackedBatch) -> np.ndarray:
    """d(token mean)/d(logits): ``(softmax - onehot(gold)) / N`` on eligible cells, 0 elsewhere."""
    cells, nll, log_p = _nll(logits, batch)
    count = nll.size
    grad_rows = np.exp(log_p)
    grad_rows[np.arange(count), batch.targets.ravel()[cells]] -= 1.0
    grad = np.zeros((batch.rows * batch.capacity, batch.binding.vocab_size), np.float64)
    grad[cells] = grad_rows / count
    return grad.reshape(logits.shape).astype(logits.dtype, copy=False)


def row_mean(logits: np.ndarray, batch: PackedBatch) -> float:
    """Mean of per-row means (rows with no target skipped). A *wrong* weighting, for contrast."""
    cells, nll, _ = _nll(logits, batch)
    row = cells // batch.capacity
    sums = np.bincount(row, weights=nll, minlength=batch.rows)
    counts = np.bincount(row, minlength=batch.rows)
    kept = counts > 0
    return float((sums[kept] / counts[kept]).mean())


def document_mean(logits: np.ndarray, batch: PackedBatch) -> float:
    """Mean of per-occurrence means. A *wrong* weighting, for contrast."""
    cells, nll, _ = _nll(logits, batch)
    segment = batch.segments.ravel()[cells]
    _, inverse = np.unique(segment, return_inverse=True)
    sums = np.bincount(inverse, weights=nll)
    counts = np.bincount(inverse)
    return float((sums / counts).mean())


def probe_logits(batch: PackedBatch, gold_probability: float | np.ndarray) -> np.ndarray:
    """Logits that give each eligible target exactly ``gold_probability`` (in ideal arithmetic).

    Every non-gold class gets 0 and the gold class ``ln((V-1) q / (1-q))``.
    ``gold_probability`` is a scalar or a ``[rows, capacity]`` array read on eligible
    cells; each value used must lie strictly between 0 and 1. Ineligible cells are 0.
    """
    vocab = batch.binding.vocab_size
    q = np.broadcast_to(np.asarray(gold_probability, np.float64), batch.loss_mask.shape)
    eligible = batch.loss_mask
    used = q[eligible]
    bad = (used <= 0) | (used >= 1) | ~np.isfinite(used)
    if bad.any():
        raise InvalidArray(
            f"gold_probability {used[bad][0]!r} on an eligible cell; accepted: 0 < q < 1"
        )
    if vocab < 2:
        raise InvalidArray(f"vocab_size={vocab}; the probe needs at least 2 classes")
    logits = np.zeros((batch.rows, batch.capacity, vocab), np.float64)
    rows, columns = np.nonzero(eligible)
    logits[rows, columns, batch.targets[rows, columns]] = np.log((vocab - 1) * used / (1 - used))
    return logits


def step_range(index: int, world_size: int, accumulation: int, base: int = 0) -> tuple[int, int]:
    """The global batches ``[first, stop)`` of the optimizer step that global batch
    ``index`` belongs to (module doc): ``world_size * accumulation`` consecutive batches,
    counted from ``base`` (the first batch of the epoch's shares: 0 except where an
    elastic resume continues)."""
    span = world_size * accumulation
    first = base + (index - base) // span * span
    return first, first + span


def step_loss(nll_sum: Any, step_targets: int, world_size: int = 1) -> Any:
    """One micro-batch's share of its step's token-weighted loss: ``nll_sum * world_size
    / step_targets`` (module doc; ``world_size`` undoes DDP's gradient mean). A step
    with no eligible target (all fillers) has nothing to learn: the loss is
    ``nll_sum * 0``, zero with a zero gradient, never 0/0."""
    if step_targets < 0:
        raise InvalidArray(f"step_targets = {step_targets}; accepted: >= 0")
    return nll_sum * world_size / max(step_targets, 1)
