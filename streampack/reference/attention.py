"""Dense-mask softmax attention in plain numpy: the slow, obviously right reference.

The compiled kernels in :mod:`streampack.kernels.attention` never build a mask; this
module does, on purpose, so that a test can compare the two. The mask comes either
from :meth:`streampack.PackedBatch.permission` (the full rule C6: valid, same segment,
position not later) or from :func:`range_mask`, which spells out the range form the
kernels take: query ``q < valid_lengths[r]`` may use keys ``[segment_starts[r, q], q]``.

Layout everywhere: ``[rows, heads, capacity, head_dim]``; ``mask`` is
``bool[rows, capacity, capacity]`` (query, key) and is shared by every head. A query
whose mask row is empty is inactive: output 0, ``lse = -inf``, no gradient.
"""

from __future__ import annotations

import numpy as np


def range_mask(segment_starts: np.ndarray, valid_lengths: np.ndarray) -> np.ndarray:
    """``bool[rows, capacity, capacity]``: ``mask[r, q, k]`` iff ``start[r, q] <= k <= q``.

    Only queries ``q < valid_lengths[r]`` get a non-empty row.
    """
    starts = np.asarray(segment_starts)
    rows, capacity = starts.shape
    q = np.arange(capacity)[:, None]
    k = np.arange(capacity)[None, :]
    active = q < np.asarray(valid_lengths)[:, None, None]  # [rows, capacity, 1]
    return active & (k >= starts[:, :, None]) & (k <= q)


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / np.sqrt(head_dim) if scale is None else float(scale)


def attention_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, *, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Masked softmax attention; returns ``(out, lse)`` in the dtype of ``q``."""
    dtype = q.dtype
    scores = (q @ np.swapaxes(k, -1, -2)) * _scale(q.shape[-1], scale)
    allowed = np.broadcast_to(mask[:, None], scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    active = allowed.any(axis=-1)  # [rows, heads, capacity]
    row_max = np.where(active, scores.max(axis=-1, initial=-np.inf), 0.0)
    weights = np.where(allowed, np.exp(scores - row_max[..., None]), 0.0)
    total = weights.sum(axis=-1)
    safe_total = np.where(active, total, 1.0)
    probs = weights / safe_total[..., None]
    out = probs @ v
    lse = np.where(active, row_max + np.log(safe_total), -np.inf)
    return out.astype(dtype), lse.astype(dtype)


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    d_out: np.ndarray,
    *,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(out * d_out)``, recomputed from scratch.

    With ``P`` the probabilities and ``dP = d_out @ v^T``, the softmax Jacobian gives
    ``dS = P * (dP - rowsum(dP * P))``; then ``dq = scale * dS @ k``,
    ``dk = scale * dS^T @ q`` and ``dv = P^T @ d_out``.
    """
    dtype = q.dtype
    s = _scale(q.shape[-1], scale)
    scores = (q @ np.swapaxes(k, -1, -2)) * s
    allowed = np.broadcast_to(mask[:, None], scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    active = allowed.any(axis=-1)
    row_max = np.where(active, scores.max(axis=-1, initial=-np.inf), 0.0)
    weights = np.where(allowed, np.exp(scores - row_max[..., None]), 0.0)
    total = np.where(active, weights.sum(axis=-1), 1.0)
    probs = weights / total[..., None]
    d_probs = d_out @ np.swapaxes(v, -1, -2)
    d_scores = probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))
    dq = (d_scores @ k) * s
    dk = (np.swapaxes(d_scores, -1, -2) @ q) * s
    dv = np.swapaxes(probs, -1, -2) @ d_out
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)
