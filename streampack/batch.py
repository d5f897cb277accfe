"""PackedBatch: one bounded model call of packed rows, and everything derived from it.

The worked example (capacity 6; A=[0,99,100,1], B=[0,101,1], C=[0,102,103,104,1]) as
one batch of two rows::

    column       0    1    2    3    4    5   |   0    1    2    3    4    5
    inputs       0   99  100    0  101   -1   |   0  102  103  104   -1   -1
    targets     99  100    1  101    1   -1   | 102  103  104    1   -1   -1
    segments     0    0    0    1    1   -1   |   2    2    2    2   -1   -1
    positions    0    1    2    0    1    0   |   0    1    2    3    0    0
    seg. start   0    0    0    3    3   -1   |   0    0    0    0   -1   -1
    valid_lengths  5                          |   4

Query ``q`` of row ``r`` may use keys ``[segment_starts[r, q], q + 1)`` when
``q < valid_lengths[r]`` and none otherwise (rule C6): B's queries at columns 3 and 4
see ``[3, 4)`` and ``[3, 5)``, never A's columns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import numpy as np

from .config import POLICIES
from .errors import (
    BindingMismatch,
    InternalError,
    InvalidArray,
    InvalidCoordinate,
    StreampackError,
)
from .examples import Binding

PAD_CELL = -1
NO_SEGMENT = -1

#: One record per occurrence: where it sits in the batch and where its tokens come from.
#:
#: - ``ordinal``: the example's index in the pack call (a window's document index in the
#:   service); ``segment``: its segment ID, equal to ``ordinal`` (rule C3).
#: - ``row``, ``start``, ``stop``: its storage cells, columns ``[start, stop)`` of ``row``
#:   (the row counted in its batch); ``stop - start`` prediction pairs.
#: - ``source``: the index of its source in the corpus manifest's ``sources`` (0 for a
#:   corpus of one source, or the ``Examples.source`` column when packed in-process).
#: - ``source_id``: its document's id in the corpus, the same for every format: the
#:   document's position in the order the reader yields them (a shard corpus's document
#:   index across shards, a JSON Lines corpus's non-blank line across files, a Parquet
#:   corpus's row across row groups and files). In a mixture the sources' documents are
#:   numbered one after another in manifest order: document ``i`` of source ``k`` has
#:   id ``i`` plus the documents of the sources before ``k``; ``(source, source_id)``
#:   names one document either way. In-process: the ``Examples.source_id`` column.
#: - ``example_id``: the example's own id (a JSON Lines ``id`` field, else ``source_id``).
#: - ``range_start``, ``range_stop``: its selected range in document coordinates, the
#:   token positions in the corpus document as the reader yields it: the occurrence's
#:   tokens (inputs, then the last target) are ``document_tokens[range_start:
#:   range_stop]``, a piece of a split long document included. In-process: the example's
#:   ``start``/``stop`` plus its ``Examples.piece_start``.
#:
#: The document inside the pack call is ``Examples.doc[ordinal]`` (the service's window
#: holds each document once, so there it is ``ordinal``).
OCCURRENCE_DTYPE = np.dtype(
    [
        ("ordinal", np.int64),
        ("row", np.int32),
        ("start", np.int32),
        ("stop", np.int32),
        ("segment", np.int32),
        ("source", np.int64),
        ("source_id", np.int64),
        ("example_id", np.int64),
        ("range_start", np.int64),
        ("range_stop", np.int64),
    ]
)

#: Array fields of a batch, in wire and digest order, with their dtypes.
ARRAY_DTYPES: dict[str, np.dtype] = {
    "inputs": np.dtype(np.int32),
    "targets": np.dtype(np.int32),
    "segments": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "input_valid": np.dtype(np.bool_),
    "target_valid": np.dtype(np.bool_),
    "loss_mask": np.dtype(np.bool_),
    "segment_starts": np.dtype(np.int32),
    "valid_lengths": np.dtype(np.int32),
}

#: The [rows, capacity] fields (all but valid_lengths).
CELL_DTYPES = {name: d for name, d in ARRAY_DTYPES.items() if name != "valid_lengths"}

#: What ``digest()`` hashes, in this order.
DIGEST_FIELDS = ("inputs", "targets", "segments", "positions", "loss_mask")

#: Bytes one cell costs across the [rows, capacity] arrays, and one row for valid_lengths.
BYTES_PER_CELL = sum(d.itemsize for d in CELL_DTYPES.values())
BYTES_PER_ROW = ARRAY_DTYPES["valid_lengths"].itemsize

#: The order ``expanded_arrays`` lays fields out in one block: widest dtype first, so
#: every field starts aligned whatever the shape.
_BLOCK_ORDER = sorted(ARRAY_DTYPES, key=lambda name: -ARRAY_DTYPES[name].itemsize)


#: What the compiled fillers take for "no supervision mask" (see ``kernels.pack_cpu``).
_NO_MASK = np.zeros(0, np.uint8)
_NO_MASK.flags.writeable = False


_INT32_MAX = 2**31 - 1


def occurrence_sources(occurrences: np.ndarray) -> np.ndarray:
    """int32 per occurrence record: its ``source`` (``CompactBatch.checked`` keeps each
    within int32)."""
    return occurrences["source"].astype(np.int32)


def kernel_mask(mask: np.ndarray | None) -> np.ndarray:
    """The ``mask`` argument of the compiled fillers: the mask, or an empty one for none."""
    return _NO_MASK if mask is None else mask


def expanded_nbytes(rows: int, capacity: int) -> int:
    """Bytes of every array field of a ``rows`` x ``capacity`` batch."""
    return rows * (capacity * BYTES_PER_CELL + BYTES_PER_ROW)


def expanded_arrays(
    rows: int, capacity: int, block: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Every array field of a batch of this shape, uninitialised, in ``ARRAY_DTYPES``
    order, as views of one uint8 ``block`` of at least ``expanded_nbytes`` (a fresh one
    when None). One block per batch is one allocation, and lets a consumer reuse it."""
    if block is None:
        block = np.empty(expanded_nbytes(rows, capacity), np.uint8)
    views, offset = {}, 0
    for name in _BLOCK_ORDER:  # np.ndarray over the block: the cheapest view numpy makes
        shape = (rows,) if name == "valid_lengths" else (rows, capacity)
        views[name] = np.ndarray(shape, ARRAY_DTYPES[name], block, offset)
        offset += views[name].nbytes
    return {name: views[name] for name in ARRAY_DTYPES}


def check_binding(actual: Binding, expected: Binding) -> None:
    """Raise ``BindingMismatch`` naming every field where ``actual`` differs (rule C9)."""
    if actual == expected:
        return
    differences = [
        f"{name}: batch has {getattr(actual, name)!r}, expected {getattr(expected, name)!r}"
        for name in ("vocab_size", "tokenizer", "split_receipt", "partition")
        if getattr(actual, name) != getattr(expected, name)
    ]
    raise BindingMismatch("batch binding differs: " + "; ".join(differences))


class CuSeqlens(NamedTuple):
    """Varlen (THD) description of a batch flattened to ``rows * capacity`` cells.

    Occurrence ``i`` holds real cells ``[cu_seqlens_padded[i], cu_seqlens_padded[i] +
    lengths[i])``; the padding after it, up to ``cu_seqlens_padded[i + 1]``, is a gap.
    ``cu_seqlens`` is the running sum of real lengths, for kernels that take unpadded
    (gathered) tokens. ``max_seqlen`` is the longest real length; ``max_seqlen_padded``
    the longest padded span (an occurrence with the padding after it), the bound a
    kernel over the padded layout needs: it is at least ``max_seqlen``.
    """

    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    max_seqlen: int
    max_seqlen_padded: int


@dataclass(frozen=True, eq=False, kw_only=True)
class PackedBatch:
    """Packed rows of one model call; built by ``pack_examples``, never edited after."""

    inputs: np.ndarray
    targets: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    input_valid: np.ndarray
    target_valid: np.ndarray
    loss_mask: np.ndarray
    segment_starts: np.ndarray
    valid_lengths: np.ndarray
    occurrences: np.ndarray
    binding: Binding
    filler: bool = False
    #: The ``PackConfig.policy`` that placed the occurrences ("next_fit" or "best_fit").
    policy: str = "next_fit"
    #: Loss-eligible targets of this batch's whole optimizer step (every rank, every
    #: micro-batch: ``streampack.loss``), as the service and ``digest`` give it; None
    #: for a batch packed alone, whose step nobody knows.
    step_targets: int | None = None

    ARRAY_FIELDS = tuple(ARRAY_DTYPES)

    @property
    def sources(self) -> np.ndarray:
        """int32 per occurrence: its record's ``source``, the index in the corpus
        manifest's ``sources`` of the source it came from (all 0 for one source)."""
        return occurrence_sources(self.occurrences)

    def cell_sources(self) -> np.ndarray:
        """``[rows, capacity]`` int32: the source index of every cell's occurrence, -1 in
        padding. With ``loss_mask`` it splits a token-weighted loss by source, e.g.
        ``nll[loss_mask & (cell_sources() == k)].sum()``."""
        out = np.full((self.rows, self.capacity), -1, np.int32)
        occ = self.occurrences
        lengths = (occ["stop"] - occ["start"]).astype(np.int64)
        cells = np.repeat(
            occ["row"].astype(np.int64) * self.capacity
            + occ["start"]
            - np.cumsum(lengths)
            + lengths,
            lengths,
        ) + np.arange(int(lengths.sum()))
        out.reshape(-1)[cells] = np.repeat(self.sources, lengths)
        return out

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.inputs.shape[1])

    @classmethod
    def filler_like(
        cls,
        binding: Binding,
        rows: int,
        capacity: int,
        policy: str = "next_fit",
        step_targets: int | None = None,
    ) -> PackedBatch:
        """An all-padding batch (no occurrences, no targets), flagged ``filler``; it
        reports the ``policy`` of the stream it pads (and its step's targets)."""
        shape = (rows, capacity)
        return cls(
            inputs=np.full(shape, PAD_CELL, np.int32),
            targets=np.full(shape, PAD_CELL, np.int32),
            segments=np.full(shape, NO_SEGMENT, np.int32),
            positions=np.zeros(shape, np.int32),
            input_valid=np.zeros(shape, np.bool_),
            target_valid=np.zeros(shape, np.bool_),
            loss_mask=np.zeros(shape, np.bool_),
            segment_starts=np.full(shape, -1, np.int32),
            valid_lengths=np.zeros(rows, np.int32),
            occurrences=np.zeros(0, OCCURRENCE_DTYPE),
            binding=binding,
            filler=True,
            policy=policy,
            step_targets=step_targets,
        )

    # -- permission (rule C6) -------------------------------------------------------

    def _check_cell(self, row: int, *columns: int) -> None:
        if not 0 <= row < self.rows:
            raise InvalidCoordinate(
                f"row={row} is outside this batch; accepted: 0..{self.rows - 1}"
            )
        for name, column in zip(("query", "key"), columns):
            if not 0 <= column < self.capacity:
                raise InvalidCoordinate(
                    f"{name}={column} is outside the row; accepted: 0..{self.capacity - 1}"
                )

    def allowed_key(self, row: int, query: int, key: int) -> bool:
        """The full rule: both valid, same segment, key's local position not later."""
        self._check_cell(row, query, key)
        return bool(
            self.input_valid[row, query]
            and self.input_valid[row, key]
            and self.segments[row, query] == self.segments[row, key]
            and self.positions[row, key] <= self.positions[row, query]
        )

    def key_range(self, row: int, query: int) -> tuple[int, int]:
        """Half-open keys ``query`` may use; ``(0, 0)`` for an inactive query."""
        self._check_cell(row, query)
        if query >= self.valid_lengths[row]:
            return (0, 0)
        return (int(self.segment_starts[row, query]), query + 1)

    def permission(self, row: int) -> np.ndarray:
        """Dense ``[capacity, capacity]`` permission of one row. For display and tests."""
        self._check_cell(row)
        valid = self.input_valid[row]
        same_segment = self.segments[row][:, None] == self.segments[row][None, :]
        causal = self.positions[row][None, :] <= self.positions[row][:, None]
        return valid[:, None] & valid[None, :] & same_segment & causal

    # -- layouts and accounting -----------------------------------------------------

    def cu_seqlens(self) -> CuSeqlens:
        occ = self.occurrences
        lengths = (occ["stop"] - occ["start"]).astype(np.int64)
        cu = np.zeros(occ.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        padded = np.empty(occ.shape[0] + 1, np.int64)
        padded[:-1] = occ["row"].astype(np.int64) * self.capacity + occ["start"]
        padded[-1] = self.rows * self.capacity
        cells = self.rows * self.capacity
        if cells > np.iinfo(np.int32).max:
            raise StreampackError(
                f"batch of {cells} cells does not fit int32 cu_seqlens; accepted: <= 2**31-1 cells"
            )
        max_seqlen = int(lengths.max()) if lengths.size else 0
        max_seqlen_padded = int(np.diff(padded).max()) if lengths.size else 0
        return CuSeqlens(
            cu.astype(np.int32), padded.astype(np.int32), max_seqlen, max_seqlen_padded
        )

    def stats(self) -> dict[str, Any]:
        """Storage and attention counts. Per head: dense scores ``rows * capacity**2``,
        permitted edges ``sum l(l+1)/2`` over occurrences of length ``l``. Targets:
        ``real_targets`` (valid) and ``supervised_targets`` (loss-eligible, rule C5)."""
        occ = self.occurrences
        lengths = (occ["stop"] - occ["start"]).astype(np.int64)
        cells = self.rows * self.capacity
        valid_cells = int(self.valid_lengths.sum())
        dense = self.rows * self.capacity**2
        edges = int((lengths * (lengths + 1) // 2).sum())
        return {
            "rows": self.rows,
            "capacity": self.capacity,
            "cells": cells,
            "valid_cells": valid_cells,
            "real_targets": int(np.count_nonzero(self.target_valid)),
            # Loss-eligible targets (rule C5): the real targets a supervision mask marks;
            # equal to real_targets for an unmasked corpus.
            "supervised_targets": int(np.count_nonzero(self.loss_mask)),
            "padding_cells": cells - valid_cells,
            "padding_fraction": 1.0 - valid_cells / cells if cells else 0.0,
            "occurrences": int(occ.shape[0]),
            "dense_score_positions": dense,
            "permitted_edges": edges,
            "valid_density": valid_cells / cells if cells else 0.0,
            "edge_density": edges / dense if dense else 0.0,
            "policy": self.policy,
        }

    # -- identity ---------------------------------------------------------------------

    def check_binding(self, expected: Binding) -> None:
        """Raise ``BindingMismatch`` unless this batch carries ``expected`` (rule C9)."""
        check_binding(self.binding, expected)

    def digest(self) -> str:
        """SHA-256 hex over inputs, targets, segments, positions, loss_mask bytes, in order.

        Arrays are hashed as C-ordered little-endian bytes, so equal batches give equal
        digests on every machine.
        """
        h = hashlib.sha256()
        for name in DIGEST_FIELDS:
            array = getattr(self, name)
            h.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).data)
        return h.hexdigest()

    def to_hf(
        self,
        layout: str = "rows",
        *,
        pad_id: int,
        mask: str | None = None,
        mask_dtype: Any = None,
        device: Any = None,
        num_items_in_batch: bool = False,
    ) -> dict[str, Any]:
        """Keyword arguments for a transformers causal LM: ``model(**batch.to_hf(...))``.

        Args:
            layout: ``"rows"`` keeps the ``[rows, capacity]`` shape (padding cells get
                ``pad_id``, position 0 and label -100); ``"flat"`` is ``[1, real cells]``
                with ``cu_seq_lens_q/k`` (int32), ``max_length_q/k`` (ints) and
                ``seq_idx`` (int32), for FlashAttention-style kernels that read them.
            pad_id: the token id written in padding cells (never attended to or scored;
                any id the embedding holds).
            mask: ``None`` (default: transformers separates documents by
                ``position_ids``), ``"bool"`` (explicit 4-D mask for sdpa) or
                ``"additive"`` (explicit 4-D float mask for eager, of ``mask_dtype``,
                default float32), ``rows`` layout only. A 2-D padding mask
                (``"padding"``) is refused: it disables transformers' packed-sequence
                detection.
            device: where to put the tensors (default: CPU, zero-copy where possible).
            num_items_in_batch: also pass ``step_targets`` (at least 1) as transformers'
                ``num_items_in_batch``: the model's loss is then the NLL sum over this
                batch divided by the targets of the whole optimizer step (multiply by
                the world size under DDP; ``streampack.loss``). A filler's is exactly 0.
                Needs a batch that knows its step (from the service or ``digest``).

        Returns ``input_ids``, ``position_ids`` (int64), ``shift_labels`` (int64, the
        targets, -100 outside ``loss_mask``), ``labels`` (the same tensor: transformers
        computes a loss only when ``labels`` is given, and reads ``shift_labels`` instead
        when both are), ``use_cache=False`` (a cache also disables the detection), and
        the layout's extras. Why each choice: ``streampack.exports``. Needs the ``hf``
        extra (PyTorch).
        """
        from .exports import hf_arguments

        arguments = hf_arguments(self, layout, pad_id, mask, mask_dtype, device)
        if num_items_in_batch:
            if self.step_targets is None:
                raise InvalidArray(
                    "num_items_in_batch=True needs step_targets, which this batch does not "
                    "carry (it was packed alone); take batches from the service or digest, "
                    "or divide the NLL sum by your own step count"
                )
            arguments["num_items_in_batch"] = max(self.step_targets, 1)
        return arguments

    def to_megatron(self, device: Any = None) -> dict[str, Any]:
        """Megatron-Core's THD parameters: ``PackedSeqParams(**batch.to_megatron())``.

        The batch is one THD sequence of ``rows * capacity`` tokens (the arrays
        flattened row-major: ``batch.inputs.reshape(1, -1)`` and friends), padding
        kept in place. Fields:

        - ``qkv_format``: ``"thd"`` (tokens, heads, head dim: no batch dimension).
        - ``cu_seqlens_q``, ``cu_seqlens_kv``: int32 ``[occurrences + 1]``, running sum
          of the occurrences' real lengths (the same tensor twice: self-attention).
        - ``cu_seqlens_q_padded``, ``cu_seqlens_kv_padded``: int32 ``[occurrences + 1]``,
          where each occurrence starts in the flattened buffer; the last entry is
          ``rows * capacity``. Occurrence ``i`` owns ``[padded[i], padded[i+1])``: its
          real cells, then the padding up to the next occurrence (a row's tail).
        - ``max_seqlen_q``, ``max_seqlen_kv``: int, the longest padded span
          (``CuSeqlens.max_seqlen_padded``), which bounds every real length too.

        No Megatron import here: the dict is splatted by the caller. Needs PyTorch. The
        loss mask Megatron takes beside it is :meth:`megatron_loss_mask`.
        """
        from .exports import megatron_arguments

        return megatron_arguments(self, device)

    def megatron_loss_mask(self, device: Any = None) -> Any:
        """Megatron's ``loss_mask`` for this batch as one THD sequence: float32 ``[1,
        rows * capacity]``, 1 on the loss-eligible cells (rule C5: a supervision mask's
        marked targets only), 0 elsewhere, laid out as ``to_megatron``'s tokens. Needs
        PyTorch."""
        from .exports import megatron_loss_mask

        return megatron_loss_mask(self, device)

    def to_torch(self, device: Any = None, pin_memory: bool = False) -> dict[str, Any]:
        """The array fields as PyTorch tensors (zero-copy on CPU). Needs the torch extra."""
        try:
            import torch
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise StreampackError(
                "to_torch needs PyTorch; install it with: pip install 'streampack[torch]'"
            ) from error
        tensors = {}
        for name in self.ARRAY_FIELDS:
            tensor = torch.from_numpy(np.ascontiguousarray(getattr(self, name)))
            if pin_memory:
                tensor = tensor.pin_memory()
            if device is not None:
                tensor = tensor.to(device, non_blocking=pin_memory)
            tensors[name] = tensor
        return tensors


@dataclass(frozen=True, eq=False, kw_only=True)
class CompactBatch:
    """A batch as its plan: occurrence records plus the selected tokens, in order.

    Occurrence ``i`` contributes ``stop - start + 1`` tokens to ``tokens`` (its whole
    selected range; int32, or uint16 when the vocabulary fits, as the service sends
    them); ``expand()`` writes the cells exactly as ``pack_examples`` does.
    ``mask``, when the examples carry a supervision mask, is their uint8 0/1 mask of
    those same tokens, one to one (None otherwise): ``expand()`` makes ``loss_mask``
    from it (rule C5). This is 2 to 5 bytes per cell instead of 23, so it is what
    travels between processes. ``checked()`` validates one that arrived from elsewhere, so that the
    compiled fill can never read or write outside its arrays.
    """

    tokens: np.ndarray
    occurrences: np.ndarray
    rows: int
    capacity: int
    binding: Binding
    filler: bool = False
    policy: str = "next_fit"  # as PackedBatch.policy
    mask: np.ndarray | None = None  # uint8 0/1 per entry of ``tokens``, or None
    step_targets: int | None = None  # as PackedBatch.step_targets

    @property
    def sources(self) -> np.ndarray:
        """As ``PackedBatch.sources``."""
        return occurrence_sources(self.occurrences)

    @classmethod
    def filler_like(
        cls, binding: Binding, rows: int, capacity: int, policy: str = "next_fit"
    ) -> CompactBatch:
        return cls(
            tokens=np.zeros(0, np.int32),
            occurrences=np.zeros(0, OCCURRENCE_DTYPE),
            rows=rows,
            capacity=capacity,
            binding=binding,
            filler=True,
            policy=policy,
        )

    def checked(self, *, max_cells: int) -> CompactBatch:
        """Raise ``InvalidArray`` unless this is a batch ``pack_compact`` could have made."""
        occ, tokens = self.occurrences, self.tokens

        def fail(what: str) -> NoReturn:
            raise InvalidArray(f"compact batch rejected: {what}")

        if not (isinstance(self.rows, int) and isinstance(self.capacity, int)):
            fail(f"rows={self.rows!r} and capacity={self.capacity!r} must be integers")
        if not 1 <= self.capacity or self.rows < 1 or self.rows * self.capacity > max_cells:
            fail(
                f"rows={self.rows} x capacity={self.capacity}; accepted: rows >= 1, "
                f"capacity >= 1, rows x capacity <= {max_cells}"
            )
        if occ.dtype != OCCURRENCE_DTYPE or occ.ndim != 1:
            fail(f"occurrences dtype {occ.dtype} shape {occ.shape}; expected 1-D records")
        if tokens.dtype not in (np.int32, np.uint16) or tokens.ndim != 1:
            fail(f"tokens dtype {tokens.dtype} shape {tokens.shape}; expected 1-D int32 or uint16")
        if occ.size:
            source = occ["source"]
            low, high = int(source.min()), int(source.max())
            if low < 0 or high > _INT32_MAX:
                fail(
                    f"source index {low if low < 0 else high}; accepted: 0..{_INT32_MAX} "
                    "(the source's index in the manifest)"
                )
            low = int(occ["range_start"].min())
            if low < 0:
                fail(f"range_start {low}; accepted: >= 0 (a position in the document)")
        self._check_mask(fail)
        if self.policy not in POLICIES:
            fail(f"policy {self.policy!r}; accepted: {', '.join(map(repr, POLICIES))}")
        if self.filler or occ.size == 0:
            if not (self.filler and occ.size == 0 and tokens.size == 0 and self.mask is None):
                fail(
                    "a batch is a filler exactly when it has no occurrences, no tokens and no mask"
                )
            self._check_step(fail, 0)
            return self
        from .kernels import pack_cpu as k

        code, at = k.check_compact(occ, tokens, self.rows, self.capacity, self.binding.vocab_size)
        if code == k.COMPACT_OK:
            self._check_step(fail, self.supervised_targets)
            return self
        if code == k.COMPACT_TOKEN_COUNT:
            fail(f"token count must match the ranges: {tokens.size} tokens, the ranges select {at}")
        if code == k.COMPACT_VOCABULARY:
            fail(
                f"tokens outside the vocabulary: tokens[{at}] = {tokens[at]}, accepted "
                f"0..{self.binding.vocab_size - 1}"
            )
        rules = {
            k.COMPACT_ROWS: f"rows must run 0, 1, ... {self.rows - 1} with no gap",
            k.COMPACT_START: "each occurrence must start where the last ended (0 on a new row)",
            k.COMPACT_COLUMNS: f"occurrence columns out of range: need start < stop <= "
            f"{self.capacity}",
            k.COMPACT_ORDINAL: "ordinals must increase along each row and fit int32",
            k.COMPACT_SEGMENT: "segment must equal the ordinal",
            k.COMPACT_RANGE: "range length must be pairs + 1",
        }
        rule = rules.get(code)
        if rule is None:  # the kernel and this table disagree: a streampack bug
            raise InternalError(f"check_compact returned code {code}, which has no message")
        record = {
            name: int(occ[name][at])
            for name in ("row", "start", "stop", "ordinal", "segment", "range_start", "range_stop")
        }
        fail(f"{rule}; occurrence {at} has {record}")

    def _check_step(self, fail: Callable[[str], NoReturn], own: int) -> None:
        """A step's targets include this batch's own ``own`` (a trainer divides by it)."""
        step = self.step_targets
        if step is not None and (type(step) is not int or step < own):
            fail(
                f"step_targets {step!r}; accepted: an integer >= this batch's {own} "
                "loss-eligible targets (its step includes it)"
            )

    def _check_mask(self, fail: Callable[[str], NoReturn]) -> None:
        """The mask is None or one uint8 0/1 per token: the fill reads it by token index."""
        mask = self.mask
        if mask is None:
            return
        if not isinstance(mask, np.ndarray) or mask.dtype != np.uint8 or mask.ndim != 1:
            if not isinstance(mask, np.ndarray):
                fail(f"mask of type {type(mask).__name__}; expected a 1-D uint8 array")
            fail(f"mask dtype {mask.dtype} shape {mask.shape}; expected 1-D uint8, one per token")
        if mask.shape != self.tokens.shape:
            fail(
                f"mask has {mask.shape[0]} values for {self.tokens.shape[0]} tokens; "
                "expected one per token"
            )
        if mask.size and int(mask.max()) > 1:
            at = int(np.flatnonzero(mask > 1)[0])
            fail(f"mask[{at}] = {int(mask[at])}; accepted: 0 or 1")

    def expand(self, block: np.ndarray | None = None) -> PackedBatch:
        """The full ``PackedBatch``: every cell written once by the compiled fill, into
        views of ``block`` (see ``expanded_arrays``; a fresh one when None)."""
        from .kernels.pack_cpu import fill_compact

        if self.filler:
            return PackedBatch.filler_like(
                self.binding, self.rows, self.capacity, self.policy, self.step_targets
            )
        arrays = expanded_arrays(self.rows, self.capacity, block)
        fill_compact(self.tokens, kernel_mask(self.mask), self.occurrences, *arrays.values())
        return PackedBatch(
            # (mypy matches a ** dict against every parameter, the bool and Binding ones too)
            **arrays,  # type: ignore[arg-type]
            occurrences=self.occurrences,
            binding=self.binding,
            policy=self.policy,
            step_targets=self.step_targets,
        )

    @property
    def expanded_nbytes(self) -> int:
        """Bytes ``expand()`` writes: every array field of the full batch."""
        return expanded_nbytes(self.rows, self.capacity)

    @property
    def nbytes(self) -> int:
        mask = 0 if self.mask is None else self.mask.nbytes
        return int(self.tokens.nbytes + self.occurrences.nbytes + mask)

    @property
    def real_tokens(self) -> int:
        """Prediction pairs (real targets) this batch holds."""
        return int((self.occurrences["stop"] - self.occurrences["start"]).sum())

    @property
    def supervised_targets(self) -> int:
        """Loss-eligible targets (rule C5): ``expand().loss_mask.sum()``, without expanding.
        Every token but each range's first is a target; the mask marks the eligible ones."""
        if self.mask is None:
            return self.real_tokens
        lengths = (self.occurrences["range_stop"] - self.occurrences["range_start"]).astype(
            np.int64
        )
        firsts = np.cumsum(lengths) - lengths  # each range's first token: never a target
        return int(np.count_nonzero(self.mask)) - int(np.count_nonzero(self.mask[firsts]))

    def supervised_targets_by_occurrence(self) -> np.ndarray:
        """:attr:`supervised_targets` of each occurrence (int64; they sum to it): what
        the producer counts by mixture source."""
        pairs = (self.occurrences["stop"] - self.occurrences["start"]).astype(np.int64)
        if self.mask is None:
            return pairs
        # Occurrence i's tokens are mask[first_i : first_i + pairs_i + 1]; its targets
        # are all of them but the first.
        marked = np.zeros(len(self.mask) + 1, np.int64)
        np.cumsum(self.mask, out=marked[1:])
        ends = np.cumsum(pairs + 1)
        return marked[ends] - marked[ends - pairs]

    def check_binding(self, expected: Binding) -> None:
        check_binding(self.binding, expected)
