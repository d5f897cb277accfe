"""pack_examples: packing of whole examples into fixed-width rows — next-fit (rule C2,
the default) or an opt-in bounded best-fit.

The picture for the worked example, capacity 6::

    supplied   A (3 pairs)   B (2 pairs)   C (4 pairs)
    row 0      A A A B B .       A fills 0..2, B fits in 3..4, one cell left
    row 1      C C C C . .       C needs 4 > 1 cells left: next row

Each example becomes one occurrence with its own segment (its ordinal in this call),
its own local positions and its own targets. Rows are never revisited, nothing is
sorted, split or truncated, an exact fill opens no empty row, and the last batch
keeps its real row count.

``PackConfig(policy="best_fit", open_rows=K)`` keeps up to K rows open. Examples are
still taken whole in supplied order; each goes to the open row with the least room
that still fits it (ties: the row opened first). When none fits, a new row opens at
the end; if K rows are open, the fullest of them (ties: opened first) is closed first.
A row that becomes exactly full closes at once. Capacity 6, K = 2::

    supplied   A (4)   B (4)   C (2)   D (1)
    A          row 0  A A A A . .        the first row opens
    B          row 1  B B B B . .        2 cells left in row 0: a second row opens
    C          row 0  A A A A C C        rows 0 and 1 both leave 2: row 0 (opened first);
                                         row 0 is exactly full and closes
    D          row 1  B B B B D .        the only open row
    next-fit would give 3 rows: [A], [B C], [D]

Output order, for both policies: rows in the order they opened, batches of
``max_rows_per_batch`` consecutive rows, and in each batch the occurrence records row
by row, left to right. Every example keeps its supplied index as its ordinal and
segment (C3), so segments increase along each row; under best-fit a batch's segments
need not be consecutive (above, row 0 holds ordinals 0 and 2). Padding stays at row
tails (a row only grows at its end), so rule C6's ranges hold unchanged. The plan is a
pure function of the examples' lengths and the config — no clock, no hash order, no
threads — so each window packed alone gives the same batches on any worker.

The call runs in four steps, and nothing large is allocated before the step that
budgets it has passed (rule C8):

1. validate every example (all-or-nothing, errors name the example);
2. budget the planner and plan (compiled, sequential: both policies are inherently
   serial; best-fit then groups examples by row with a counting sort);
3. budget every batch array and occurrence record exactly, check ``max_cells``;
4. allocate each field once for the whole call and fill rows in parallel (compiled);
   each batch is a row slice of those arrays.

Byte counts use Python integers, which cannot overflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .batch import (
    CELL_DTYPES,
    OCCURRENCE_DTYPE,
    CompactBatch,
    PackedBatch,
    expanded_nbytes,
    kernel_mask,
)
from .config import PackConfig
from .errors import (
    CapacityError,
    InternalError,
    InvalidConfig,
    InvalidExample,
    MetadataBudgetError,
    OversizedExample,
)
from .examples import (
    Binding,
    Examples,
    check_offsets,
    check_ranges,
    describe_example,
    integer_column,
    location_columns,
)
from .kernels.pack_cpu import (
    fill_rows,
    gather_ranges,
    gather_ranges_masked,
    group_by_row,
    plan_best_fit,
    plan_next_fit,
)

_INT64 = np.dtype(np.int64).itemsize
#: Validation and occurrence-building temporaries: at most this many int64 per example.
_SCRATCH_INT64_PER_EXAMPLE = 3
#: Python objects of one batch (the dataclass, array views, occurrence slice).
_BATCH_OBJECT_BYTES = 4096
#: The call's own fixed overhead (epoch object, small arrays, interpreter frames).
_CALL_OVERHEAD_BYTES = 1 << 16
_MAX_OCCURRENCES = 2**31  # segment IDs 0 .. 2**31-1 must fit int32 (rule C3)


@dataclass(frozen=True, eq=False)
class PackedEpoch:
    """The batches of one pack call, in order, and what the call cost."""

    batches: list[PackedBatch]
    row_count: int
    occurrence_count: int
    metadata_peak: int


def planner_bytes(example_count: int, open_rows: int = 1) -> int:
    """Planner arrays (row, column and placement order per example, two per open row)
    plus validation scratch."""
    return (3 + _SCRATCH_INT64_PER_EXAMPLE) * _INT64 * example_count + 2 * _INT64 * open_rows


def metadata_bytes(
    example_count: int,
    row_count: int,
    batch_count: int,
    capacity: int,
    *,
    selected_tokens: int | None = None,
    open_rows: int = 1,
    masked: bool = False,
) -> int:
    """Every byte a pack call holds at its peak, given its plan (rule C8).

    ``pack_examples`` holds every batch array; ``pack_compact`` holds instead the
    ``selected_tokens`` of its examples (int32) and their offsets, and, ``masked``, their
    supervision mask (one byte a token). (``pack_examples`` reads the caller's mask in
    place: it writes only ``loss_mask``, counted with the batch arrays.)
    """
    common = (
        _CALL_OVERHEAD_BYTES
        + planner_bytes(example_count, open_rows)
        + _INT64 * (row_count + 1)  # first example of each row
        + OCCURRENCE_DTYPE.itemsize * example_count
        + batch_count * _BATCH_OBJECT_BYTES
    )
    if selected_tokens is None:
        return common + expanded_nbytes(row_count, capacity)
    per_token = np.dtype(np.int32).itemsize + (np.dtype(np.uint8).itemsize if masked else 0)
    return common + per_token * selected_tokens + _INT64 * (example_count + 1)


def _enforce_budget(needed: int, config: PackConfig, what: str) -> None:
    if needed > config.max_metadata_bytes:
        raise MetadataBudgetError(
            f"{what} needs {needed} bytes but max_metadata_bytes={config.max_metadata_bytes}; "
            "raise max_metadata_bytes or pack fewer examples per call"
        )


def _check_types(examples: Examples, binding: Binding, config: PackConfig) -> None:
    if not isinstance(examples, Examples):
        raise InvalidExample(f"examples must be streampack.Examples, got {type(examples).__name__}")
    if not isinstance(binding, Binding):
        raise InvalidConfig(f"binding must be streampack.Binding, got {type(binding).__name__}")
    if not isinstance(config, PackConfig):
        raise InvalidConfig(f"config must be streampack.PackConfig, got {type(config).__name__}")


def _validate(examples: Examples, binding: Binding, config: PackConfig) -> np.ndarray:
    """All-or-nothing checks; returns the prediction length of every example."""
    examples.check_vocabulary(binding.vocab_size)
    lengths = examples.prediction_lengths
    _check_lengths(lengths, config, examples.describe)
    return lengths


@dataclass(frozen=True)
class _Plan:
    """Where every example goes: validated, budgeted, not yet written."""

    lengths: np.ndarray  # prediction pairs per example
    row_of: np.ndarray  # row of each example, counted over the whole call
    column_of: np.ndarray  # first storage column of each example
    order: np.ndarray  # examples in placement order: row by row, left to right
    row_first: np.ndarray  # where each row starts in ``order``, plus the total
    row_count: int
    batch_count: int
    in_supplied_order: bool  # order is 0, 1, 2, ... (next-fit)

    def batch_rows(self, batch: int, rows_per_batch: int) -> tuple[int, int]:
        first = batch * rows_per_batch
        return first, min(first + rows_per_batch, self.row_count)


def _plan(
    examples: Examples, binding: Binding, config: PackConfig, *, compact: bool
) -> tuple[_Plan, int]:
    """Validate, budget and plan one call; returns the plan and its metadata peak."""
    _check_types(examples, binding, config)
    _enforce_budget(planner_bytes(len(examples), config.open_row_limit), config, "planning")
    lengths = _validate(examples, binding, config)
    return _place(lengths, config, compact=compact, masked=examples.mask is not None)


def _check_lengths(lengths: np.ndarray, config: PackConfig, describe: Callable[[int], str]) -> None:
    """Rule C2: no example is split, so each must fit one row."""
    oversized = np.flatnonzero(lengths > config.capacity)
    if oversized.size:
        i = int(oversized[0])
        raise OversizedExample(
            f"{describe(i)} has {int(lengths[i])} prediction pairs but a row holds "
            f"capacity={config.capacity}; raise capacity to at least {int(lengths[i])} or "
            "select shorter ranges upstream (streampack never splits or truncates)"
        )


def _place(
    lengths: np.ndarray, config: PackConfig, *, compact: bool, masked: bool = False
) -> tuple[_Plan, int]:
    """Place validated prediction lengths by ``config.policy`` and budget the result
    (``masked``: the compact batches will carry their tokens' mask too)."""
    count = len(lengths)
    if count > _MAX_OCCURRENCES:
        raise InvalidExample(
            f"{count} examples in one call; segment IDs are int32, accepted: <= {_MAX_OCCURRENCES}"
        )

    row_of = np.empty(count, np.int64)
    column_of = np.empty(count, np.int64)
    if config.policy == "best_fit":
        open_row = np.empty(config.open_row_limit, np.int64)
        open_used = np.empty(config.open_row_limit, np.int64)
        row_count = int(
            plan_best_fit(
                lengths,
                config.capacity,
                config.open_row_limit,
                row_of,
                column_of,
                open_row,
                open_used,
            )
        )
    else:
        row_count = int(plan_next_fit(lengths, config.capacity, row_of, column_of))
    rows_per_batch = config.max_rows_per_batch
    batch_count = -(-row_count // rows_per_batch)

    largest_batch_rows = min(rows_per_batch, row_count)
    max_cells = config.max_cells
    if max_cells is None:
        raise InternalError("PackConfig.max_cells is unset; PackConfig.__post_init__ sets it")
    if largest_batch_rows * config.capacity > max_cells:
        raise CapacityError(
            f"batch 0 would hold {largest_batch_rows} rows x capacity {config.capacity} = "
            f"{largest_batch_rows * config.capacity} cells but max_cells={config.max_cells}; "
            f"accepted: max_rows_per_batch <= {max_cells // config.capacity} "
            "or a larger max_cells"
        )
    selected = int(lengths.sum()) + count if compact else None
    peak = metadata_bytes(
        count,
        row_count,
        batch_count,
        config.capacity,
        selected_tokens=selected,
        open_rows=config.open_row_limit,
        masked=masked,
    )
    _enforce_budget(peak, config, f"packing {count} examples into {row_count} rows")
    if config.policy == "next_fit":  # rows already hold consecutive examples
        order = np.arange(count, dtype=np.int64)
        row_first = np.searchsorted(row_of, np.arange(row_count + 1, dtype=np.int64))
    else:
        order = np.empty(count, np.int64)
        row_first = np.empty(row_count + 1, np.int64)
        group_by_row(row_of, row_first, order)
    return _Plan(
        lengths,
        row_of,
        column_of,
        order,
        row_first,
        row_count,
        batch_count,
        config.policy == "next_fit",
    ), peak


def pack_examples(examples: Examples, binding: Binding, config: PackConfig) -> PackedEpoch:
    """Pack ``examples`` into batches of ``config`` (rules C1-C8): next-fit in supplied
    order, or bounded best-fit when ``config.policy == "best_fit"`` (module doc).

    Raises:
        InvalidExample / OversizedExample: an example breaks C1/C2 (the message names it).
        MetadataBudgetError: the call would hold more than ``max_metadata_bytes``.
        CapacityError: a batch would hold more than ``max_cells`` cells.
    Nothing large is allocated before the check that covers it has passed.
    """
    plan, peak = _plan(examples, binding, config, compact=False)
    shape = (plan.row_count, config.capacity)
    arrays = {name: np.empty(shape, dtype) for name, dtype in CELL_DTYPES.items()}
    valid_lengths = np.empty(plan.row_count, np.int32)
    fill_rows(
        examples.tokens,
        kernel_mask(examples.mask),
        examples.offsets,
        examples.doc,
        examples.start,
        examples.stop,
        plan.order,
        plan.row_first,
        0,
        arrays["inputs"],
        arrays["targets"],
        arrays["segments"],
        arrays["positions"],
        arrays["input_valid"],
        arrays["target_valid"],
        arrays["loss_mask"],
        arrays["segment_starts"],
        valid_lengths,
    )
    occurrences = _occurrence_records(examples, plan, config.max_rows_per_batch)

    batches = []
    for b in range(plan.batch_count):
        first_row, last_row = plan.batch_rows(b, config.max_rows_per_batch)
        rows = slice(first_row, last_row)
        batches.append(
            PackedBatch(
                # (mypy matches a ** dict against every parameter: see batch.py)
                **{name: array[rows] for name, array in arrays.items()},  # type: ignore[arg-type]
                valid_lengths=valid_lengths[rows],
                occurrences=occurrences[plan.row_first[first_row] : plan.row_first[last_row]],
                binding=binding,
                policy=config.policy,
            )
        )
    return PackedEpoch(
        batches=batches,
        row_count=plan.row_count,
        occurrence_count=len(examples),
        metadata_peak=peak,
    )


def plan_compact(
    examples: Examples, binding: Binding, config: PackConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The batches of ``pack_compact`` as plans alone, without their tokens.

    Returns every occurrence record in order (``row`` local to its batch) and how many
    records each batch holds. Same validation, placement and budget rules. This is
    what a pack worker sends: the producer already holds the window's tokens, and
    :func:`compact_batches` (or the producer's copy of the window) adds them.
    """
    plan, _ = _plan(examples, binding, config, compact=True)
    return _plans(examples, plan, config)


def plan_ranges(
    offsets: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    source_id: np.ndarray,
    example_id: np.ndarray,
    config: PackConfig,
    *,
    source: np.ndarray | None = None,
    piece_start: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_compact` for documents whose tokens are held elsewhere.

    Example ``i`` selects ``[start[i], stop[i])`` of document ``i``, whose boundaries are
    ``offsets``; ``source`` and ``piece_start`` are the ``Examples`` columns of those
    names (zeros when None). Placement, range and budget rules are those of ``plan_compact``;
    without tokens there is no vocabulary to check, so whoever adds the tokens checks
    them (the producer checks every batch it assembles, as a consumer does).
    """
    if not isinstance(config, PackConfig):
        raise InvalidConfig(f"config must be streampack.PackConfig, got {type(config).__name__}")
    offsets = integer_column("offsets", offsets, np.int64)
    start, stop, source_id, example_id = (
        integer_column(name, column, np.int64)
        for name, column in (
            ("start", start),
            ("stop", stop),
            ("source_id", source_id),
            ("example_id", example_id),
        )
    )
    count = start.shape[0]
    if offsets.shape[0] != count + 1 or any(
        column.shape[0] != count for column in (stop, source_id, example_id)
    ):
        raise InvalidExample(
            f"{count} ranges need {count + 1} offsets and {count} stops, source and example "
            f"ids; got {offsets.shape[0]}, {stop.shape[0]}, {source_id.shape[0]}, "
            f"{example_id.shape[0]}"
        )
    source, piece_start = location_columns(count, source, piece_start)
    _enforce_budget(planner_bytes(count, config.open_row_limit), config, "planning")
    check_offsets(offsets, int(offsets[-1]))  # no tokens here to end at: start, order
    doc = np.arange(count, dtype=np.int64)

    def describe(i: int) -> str:
        return describe_example(i, source_id, example_id)

    check_ranges(offsets, doc, start, stop, describe)
    lengths = stop - start - 1
    _check_lengths(lengths, config, describe)
    plan, _ = _place(lengths, config, compact=True)
    ranges = _Ranges(
        start=start,
        stop=stop,
        source_id=source_id,
        example_id=example_id,
        source=source,
        piece_start=piece_start,
    )
    return _plans(ranges, plan, config)


@dataclass(frozen=True)
class _Ranges:
    """The columns of ``Examples`` that occurrence records copy (no tokens)."""

    start: np.ndarray
    stop: np.ndarray
    source_id: np.ndarray
    example_id: np.ndarray
    source: np.ndarray
    piece_start: np.ndarray


def _plans(
    examples: Examples | _Ranges, plan: _Plan, config: PackConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Every occurrence record in order and how many records each batch holds."""
    occurrences = _occurrence_records(examples, plan, config.max_rows_per_batch)
    firsts = plan.row_first[: plan.row_count : config.max_rows_per_batch]
    sizes = np.diff(np.append(firsts, len(occurrences))).astype(np.int64)
    return occurrences, sizes


def select_tokens(
    tokens: np.ndarray,
    offsets: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of ranges ``[start[i], stop[i])`` of documents ``doc[i]``, concatenated
    in order — the ``tokens`` of a compact batch holding exactly those ranges — and
    where each range begins in them (plus the total). Keeps uint16 tokens uint16; any
    other dtype becomes int32."""
    dtype = np.uint16 if tokens.dtype == np.uint16 else np.int32
    return _gather(tokens, offsets, doc, start, stop, dtype)


def select_mask(
    mask: np.ndarray | None,
    offsets: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
) -> np.ndarray | None:
    """The supervision mask of the tokens :func:`select_tokens` selects (uint8, aligned
    with them), or None when there is no mask."""
    if mask is None:
        return None
    return _gather(mask, offsets, doc, start, stop, np.uint8)[0]


def _select_tokens_and_mask(
    tokens: np.ndarray,
    mask: np.ndarray,
    offsets: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`select_tokens` and :func:`select_mask` in one compiled pass."""
    out_offsets = np.zeros(len(doc) + 1, np.int64)
    np.cumsum(stop - start, out=out_offsets[1:])
    dtype = np.uint16 if tokens.dtype == np.uint16 else np.int32
    out: np.ndarray = np.empty(int(out_offsets[-1]), dtype)
    out_mask: np.ndarray = np.empty(int(out_offsets[-1]), np.uint8)
    gather_ranges_masked(tokens, mask, offsets, doc, start, stop, out_offsets, out, out_mask)
    return out, out_mask, out_offsets


def _gather(
    values: np.ndarray,
    offsets: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    dtype: type,
) -> tuple[np.ndarray, np.ndarray]:
    """``values`` of ranges ``[start[i], stop[i])`` of documents ``doc[i]``, in order, as
    ``dtype``, and where each range begins in them (plus the total)."""
    out_offsets = np.zeros(len(doc) + 1, np.int64)
    np.cumsum(stop - start, out=out_offsets[1:])
    out: np.ndarray = np.empty(int(out_offsets[-1]), dtype)
    gather_ranges(values, offsets, doc, start, stop, out_offsets, out)
    return out, out_offsets


def compact_batches(
    examples: Examples,
    occurrences: np.ndarray,
    sizes: np.ndarray,
    binding: Binding,
    capacity: int,
    policy: str = "next_fit",
) -> list[CompactBatch]:
    """The compact batches of a plan from :func:`plan_compact`, tokens gathered in the
    records' order (best-fit's is not the supplied order)."""
    ordinal = occurrences["ordinal"]
    ranges = (
        examples.offsets,
        examples.doc[ordinal],
        examples.start[ordinal],
        examples.stop[ordinal],
    )
    if examples.mask is None:
        selected, token_offsets = select_tokens(examples.tokens, *ranges)
        mask = None
    else:
        selected, mask, token_offsets = _select_tokens_and_mask(
            examples.tokens, examples.mask, *ranges
        )
    ends = np.cumsum(sizes)
    return [
        CompactBatch(
            tokens=selected[token_offsets[first] : token_offsets[last]],
            mask=None if mask is None else mask[token_offsets[first] : token_offsets[last]],
            occurrences=occurrences[first:last],
            rows=int(occurrences["row"][last - 1]) + 1,
            capacity=capacity,
            binding=binding,
            policy=policy,
        )
        for first, last in zip(ends - sizes, ends)
    ]


def pack_compact(examples: Examples, binding: Binding, config: PackConfig) -> list[CompactBatch]:
    """The batches of ``pack_examples`` as plans: occurrence records + selected tokens.

    Same validation, placement and budget rules; no cell is written. Each
    ``CompactBatch.expand()`` gives exactly the ``PackedBatch`` that ``pack_examples``
    returns at the same index. A compact batch is about 4 bytes per cell instead of 23.
    """
    occurrences, sizes = plan_compact(examples, binding, config)
    return compact_batches(examples, occurrences, sizes, binding, config.capacity, config.policy)


def warm_up_kernels(*, expand: bool = True) -> tuple[Examples, CompactBatch]:
    """Compile, or load from the Numba cache, every kernel between a window and a
    ``PackedBatch``: plan, gather, check and fill; returns the tiny window and batch used.
    With ``expand=False`` only planning, gathering and the content digests (what a producer
    and a worker that does not audit run: a quarter less to load, on the path to the first
    batch).

    Loading costs about a second per process. The service's processes pay it before they
    announce themselves ready, so it never lands inside a stream (or a measured rate).
    """
    binding = Binding(vocab_size=8, tokenizer="warm-up", split_receipt="warm-up", partition="train")
    examples = Examples.from_documents([[1, 2, 3], [4, 5]])
    config = PackConfig(capacity=4, max_rows_per_batch=1)
    (batch,) = pack_compact(examples, binding, config)
    masked = dataclasses.replace(examples, mask=np.array([1, 0, 1, 0, 1], np.uint8))
    (masked_batch,) = pack_compact(masked, binding, config)
    _warm_up_digests()  # the producer digests windows (data plane), a consumer batches
    if not expand:
        return examples, batch
    # Each argument type is its own specialization: tokens int32 or uint16 (the service
    # sends uint16 when the vocabulary fits), and arrays writable (made here) or
    # read-only (decoded from a message: a consumer's all, a producer's occurrences).
    # The mask is one type, masked or not (kernels.pack_cpu), but may be read-only.
    for tokens in (batch.tokens, batch.tokens.astype(np.uint16)):
        for read_only in ((), ("occurrences",), ("occurrences", "tokens", "mask")):
            for mask in (None, masked_batch.mask):
                arrays = {
                    "tokens": tokens.copy(),
                    "occurrences": batch.occurrences.copy(),
                    "mask": None if mask is None else mask.copy(),
                }
                for name in read_only:
                    if arrays[name] is not None:
                        arrays[name].flags.writeable = False
                dataclasses.replace(batch, **arrays).checked(max_cells=4).expand()
    pack_examples(masked, binding, config)
    return examples, batch


def _warm_up_digests() -> None:
    """Load the content digest kernel (``digests.range_digests``, on the data plane's
    path: the producer digests windows, a consumer the batches workers serve) for
    tokens and masks writable or read-only, as decoded frames are."""
    from .digests import range_digests

    offsets = np.array([0, 2, 3], np.int64)
    for read_only in (False, True):
        tokens = np.array([1, 2, 3], np.uint16)
        mask = np.array([1, 0, 1], np.uint8)
        tokens.flags.writeable = mask.flags.writeable = not read_only
        range_digests(tokens, offsets)
        range_digests(tokens, offsets, mask)


def _occurrence_records(
    examples: Examples | _Ranges, plan: _Plan, rows_per_batch: int
) -> np.ndarray:
    """One record per occurrence, in placement order (row by row, left to right); ``row``
    is local to the occurrence's batch, ``ordinal`` (= segment) the supplied index. The
    range is the one selected, in the caller's document coordinates: the tokens were
    selected by ``start``/``stop``, the record adds the example's ``piece_start``."""
    count = len(plan.lengths)
    # Next-fit places in supplied order: take each column whole rather than gathered.
    at: slice | np.ndarray = slice(None) if plan.in_supplied_order else plan.order
    records = np.empty(count, OCCURRENCE_DTYPE)
    records["ordinal"] = plan.order
    records["row"] = plan.row_of[at] % rows_per_batch
    records["start"] = plan.column_of[at]
    records["stop"] = records["start"] + plan.lengths[at]
    records["segment"] = records["ordinal"]
    records["source"] = examples.source[at]
    records["source_id"] = examples.source_id[at]
    records["example_id"] = examples.example_id[at]
    piece_start = examples.piece_start[at]
    records["range_start"] = examples.start[at] + piece_start
    records["range_stop"] = examples.stop[at] + piece_start
    return records
