"""A batch in the trainer's own convention: transformers' keyword arguments and
Megatron-Core's THD parameters, built by ``PackedBatch.to_hf`` / ``to_megatron``.

The worked example (capacity 6; A=[0,99,100,1], B=[0,101,1], C=[0,102,103,104,1]),
``pad_id=0``, in both Hugging Face layouts::

    layout="rows"    [rows, capacity], padding kept (position 0, label -100)
      input_ids      [[0, 99, 100, 0, 101, 0], [0, 102, 103, 104, 0, 0]]
      position_ids   [[0, 1, 2, 0, 1, 0],     [0, 1, 2, 3, 0, 0]]
      shift_labels   [[99, 100, 1, 101, 1, -100], [102, 103, 104, 1, -100, -100]]

    layout="flat"    [1, real cells], padding dropped
      input_ids      [[0, 99, 100, 0, 101, 0, 102, 103, 104]]
      position_ids   [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
      shift_labels   [[99, 100, 1, 101, 1, 102, 103, 104, 1]]
      seq_idx        [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
      cu_seq_lens_q = cu_seq_lens_k = [0, 3, 5, 9];  max_length_q = max_length_k = 4

Why each choice (each one is a trap a hand-written glue falls into):

- ``input_ids`` hold ``pad_id`` in padding cells: an embedding table raises on -1.
- No 2-D ``attention_mask``, ever: transformers detects packed documents from
  ``position_ids`` (a position that does not follow its left neighbour starts a new
  document) only when the 2-D mask is absent; with one, every document attends to the
  documents before it in its row, silently. ``mask="padding"`` is refused for that
  reason. The explicit 4-D masks (``mask="bool"`` for sdpa, ``"additive"`` for eager:
  eager *adds* the mask to the scores, so a bool mask would mask nothing) are returned
  as-is by transformers' mask preparation.
- ``use_cache=False``: with a cache transformers skips the same detection, silently.
- Targets go in ``shift_labels``: they are already shifted (the target of a cell is in
  that cell). transformers' unshifted ``labels`` convention cannot hold them: it puts
  the target of cell ``t`` in cell ``t+1``, and a document's last target (a full row's
  last column, every document's last cell in ``flat``) has no cell ``t+1`` of its own.
  ``labels`` is the *same* tensor, present only because a transformers causal-LM
  computes a loss only when ``labels`` is given; its loss reads ``shift_labels`` when
  that is given and then never looks at ``labels``. Cells outside ``loss_mask`` are
  ``-100`` (transformers' ignore index), and its mean over the others is rule C7's
  token-weighted loss.
- ``flat``: FlashAttention-style kernels take document boundaries from
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` (int32 tensors, Python ints), and derive
  them from ``position_ids`` only when the batch has one row — so the flat layout has
  one row and no padding. sdpa and eager attention take them from ``position_ids``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidConfig, StreampackError

#: transformers' (and PyTorch's cross-entropy) ignore index.
IGNORE_INDEX = -100

HF_LAYOUTS = ("rows", "flat")
HF_MASKS = (None, "bool", "additive")

_PADDING_MASK_REFUSED = (
    "mask={mask!r} (a 2-D padding attention_mask) is refused: transformers reads a 2-D mask "
    "as the whole story, skips its packed-sequence detection, and every document would "
    "attend to the documents before it in its row. Leave mask=None (position_ids separate "
    "the documents) or ask for a 4-D mask: mask='bool' (sdpa) or mask='additive' (eager)"
)


def _torch() -> Any:
    try:
        import torch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise StreampackError(
            "the trainer exports need PyTorch; install it with: pip install 'streampack[hf]'"
        ) from error
    return torch


def _check_pad_id(pad_id: object) -> int:
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) or pad_id < 0:
        raise InvalidConfig(
            f"pad_id={pad_id!r}; accepted: a token id >= 0 the embedding holds (padding "
            "cells are never attended to nor scored, so any real id will do, e.g. the "
            "tokenizer's pad or EOS id)"
        )
    return int(pad_id)


def block_causal_mask(batch: Any) -> np.ndarray:
    """``[rows, 1, capacity, capacity]`` bool: rule C6's permission, True = may attend.

    A padding query (no keys under C6) is given itself as its only key: a query row with
    no key at all makes sdpa's softmax NaN, and a NaN output poisons the gradient even
    where its loss is ignored. Real queries never see a padding key either way.
    """
    capacity = batch.capacity
    column = np.arange(capacity)
    query, key = column[:, None], column[None, :]
    active = column[None, :] < batch.valid_lengths[:, None]  # [rows, q]
    starts = batch.segment_starts.astype(np.int64)
    allowed = (key[None] >= starts[:, :, None]) & (key[None] <= query[None])
    allowed &= active[:, :, None]
    allowed |= ~active[:, :, None] & (key == query)[None]
    return allowed[:, None]


def hf_arguments(
    batch: Any,
    layout: str,
    pad_id: int,
    mask: str | None,
    mask_dtype: Any,
    device: Any,
) -> dict[str, Any]:
    """The body of ``PackedBatch.to_hf`` (see there and the module picture)."""
    if layout not in HF_LAYOUTS:
        raise InvalidConfig(f"layout={layout!r}; accepted: {', '.join(map(repr, HF_LAYOUTS))}")
    if mask == "padding":
        raise InvalidConfig(_PADDING_MASK_REFUSED.format(mask=mask))
    if mask not in HF_MASKS:
        raise InvalidConfig(
            f"mask={mask!r}; accepted: None, 'bool' (sdpa) or 'additive' "
            "(eager); a 2-D padding mask is refused on purpose"
        )
    pad_id = _check_pad_id(pad_id)
    torch = _torch()

    input_ids = np.where(batch.input_valid, batch.inputs, pad_id).astype(np.int64)
    labels = np.where(batch.loss_mask, batch.targets, IGNORE_INDEX).astype(np.int64)
    positions = batch.positions.astype(np.int64)
    out: dict[str, Any]
    if layout == "rows":
        out = {"input_ids": input_ids, "position_ids": positions, "shift_labels": labels}
        if mask is not None:
            allowed = block_causal_mask(batch)
            if mask == "bool":
                out["attention_mask"] = allowed
            else:
                dtype = mask_dtype if mask_dtype is not None else torch.float32
                additive = torch.zeros(allowed.shape, dtype=dtype)
                additive.masked_fill_(torch.from_numpy(~allowed), torch.finfo(dtype).min)
                out["attention_mask"] = additive
    else:
        if mask is not None:
            raise InvalidConfig(
                f"mask={mask!r} with layout='flat'; the flat layout carries its documents' "
                "boundaries (position_ids, cu_seq_lens_q/k), so it takes mask=None"
            )
        if batch.filler or batch.occurrences.size == 0:
            raise InvalidConfig(
                "a filler batch has no real cells to flatten; skip batches whose "
                "`filler` is True (or use layout='rows')"
            )
        layout_ = batch.cu_seqlens()
        valid = batch.input_valid
        lengths = np.diff(layout_.cu_seqlens)
        out = {
            "input_ids": input_ids[valid][None],
            "position_ids": positions[valid][None],
            "shift_labels": labels[valid][None],
            "seq_idx": np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)[None],
            "cu_seq_lens_q": layout_.cu_seqlens,
            "cu_seq_lens_k": layout_.cu_seqlens.copy(),
            "max_length_q": layout_.max_seqlen,
            "max_length_k": layout_.max_seqlen,
        }
    tensors = {
        name: (
            torch.from_numpy(np.ascontiguousarray(value))
            if isinstance(value, np.ndarray)
            else value
        )
        for name, value in out.items()
    }
    if device is not None:
        tensors = {
            name: value.to(device) if hasattr(value, "to") else value
            for name, value in tensors.items()
        }
    tensors["labels"] = tensors["shift_labels"]  # the same tensor: see the module doc
    tensors["use_cache"] = False
    return tensors


def megatron_arguments(batch: Any, device: Any) -> dict[str, Any]:
    """The body of ``PackedBatch.to_megatron`` (see there)."""
    if batch.filler or batch.occurrences.size == 0:
        raise InvalidConfig(
            "a filler batch has no sequences to describe; skip batches whose `filler` is True"
        )
    torch = _torch()
    layout = batch.cu_seqlens()
    cu = torch.from_numpy(layout.cu_seqlens)
    padded = torch.from_numpy(layout.cu_seqlens_padded)
    if device is not None:
        cu, padded = cu.to(device), padded.to(device)
    return {
        "qkv_format": "thd",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "max_seqlen_q": layout.max_seqlen_padded,
        "max_seqlen_kv": layout.max_seqlen_padded,
    }


def megatron_loss_mask(batch: Any, device: Any) -> Any:
    """The body of ``PackedBatch.megatron_loss_mask`` (see there)."""
    torch = _torch()
    mask = torch.from_numpy(batch.loss_mask.reshape(1, -1).astype(np.float32))
    return mask if device is None else mask.to(device)
