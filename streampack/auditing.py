"""Audit a packed batch: does the reference decoder see exactly what it would see unpacked?

A batch passes when the untrained reference decoder (:mod:`streampack.decoder`) gives,
running the packed rows, the same logits on every loss-eligible cell, the same
token-summed loss and the same gradient for every parameter coordinate as running
each of its occurrences alone — within ``|a-b| <= 1e-10 + 1e-9*max(|a|,|b|)``.

What that proves about the batch: its segment starts and valid lengths keep every
query inside its own occurrence (C6), its targets are the inputs shifted by one inside
the range (C1) and its loss mask counts each real target once (C7). Positions are
compared with ``0..L-1`` directly (C4), since rotary attention cannot tell a constant
shift inside an isolated segment. The separate runs are rebuilt from the batch's own
input cells (plus each occurrence's last target) unless the caller passes the
``Examples`` the batch was packed from, in which case the tokens are checked too.

Two jobs live here, both on the decoder's internal API (``Cells``,
``Decoder.loss_and_logits`` and friends in :mod:`streampack.decoder`): ``audit``, the
runtime check of one batch that pack workers run, and ``compare_executions``, the
three-way comparison (separate, padded, packed) of the equivalence suite, which
:mod:`streampack.trace` formats for ``streampack trace``.

The decoder profiles accept short examples only (``max_positions`` 4 or 16), so longer
occurrences are cropped to a prefix *for the audit only*: each row is rebuilt from its
occurrences' first ``max_positions`` cells, laid side by side in the original order,
with the batch's own positions, targets, loss mask and segment starts (kept at the
same distance before their query) copied across. The report counts the cropped
occurrences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch import PAD_CELL, PackedBatch
from .decoder import Cells, Decoder, DecoderConfig, LossAndGrad, sum_parts
from .errors import InvalidArray
from .examples import Examples

_ABS_TOL = 1e-10
_REL_TOL = 1e-9


def _max_diff_and_failures(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Largest absolute difference and how many pairs break the tolerance.

    NaN anywhere counts as a failure: a NaN logit on an eligible cell is a bug.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise InvalidArray(f"cannot compare shapes {a.shape} and {b.shape}")
    if a.size == 0:
        return 0.0, 0
    diff = np.abs(a - b)
    bound = np.maximum(np.abs(a), np.abs(b))
    bound *= _REL_TOL
    bound += _ABS_TOL
    bad = int(np.count_nonzero(~(diff <= bound)))
    if not np.all(np.isfinite(diff)):
        return float("inf"), bad
    return float(diff.max()), bad


@dataclass
class Comparison:
    """One execution compared with another: counts, largest differences, failures."""

    logits: int = 0
    gradient_coordinates: int = 0
    max_logit_diff: float = 0.0
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    failures: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def comparisons(self) -> int:
        """Logits, the loss sum (one) and every gradient coordinate."""
        return self.logits + 1 + self.gradient_coordinates

    @property
    def passed(self) -> bool:
        return self.failures == 0

    def add_logits(self, a: np.ndarray, b: np.ndarray, what: str) -> None:
        largest, bad = _max_diff_and_failures(a, b)
        self.logits += int(np.asarray(a).size)
        self.max_logit_diff = max(self.max_logit_diff, largest)
        if bad:
            self.failures += bad
            self.notes.append(f"{what}: {bad} logits differ (max |diff| {largest:.3e})")

    def add_loss(self, a: LossAndGrad, b: LossAndGrad) -> None:
        if a.count != b.count:
            self.failures += 1
            self.notes.append(f"target counts differ: {a.count} vs {b.count}")
        largest, bad = _max_diff_and_failures(np.array(a.loss_sum), np.array(b.loss_sum))
        self.max_loss_diff = largest
        if bad:
            self.failures += 1
            self.notes.append(f"loss sums differ: {a.loss_sum!r} vs {b.loss_sum!r}")
        for name, value in a.grads.items():
            largest, bad = _max_diff_and_failures(value, b.grads[name])
            self.gradient_coordinates += int(value.size)
            self.max_grad_diff = max(self.max_grad_diff, largest)
            if bad:
                self.failures += bad
                self.notes.append(
                    f"gradient {name}: {bad} coordinates differ (max |diff| {largest:.3e})"
                )

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "logit_comparisons": self.logits,
            "gradient_comparisons": self.gradient_coordinates,
            "comparisons": self.comparisons,
            "max_logit_diff": self.max_logit_diff,
            "max_loss_diff": self.max_loss_diff,
            "max_grad_diff": self.max_grad_diff,
            "failures": self.failures,
        }


@dataclass(frozen=True)
class AuditReport:
    """Outcome of :func:`audit` for one batch.

    Attributes:
        passed: every comparison within tolerance and equal target counts.
        max_logit_diff / max_loss_diff / max_grad_diff: largest absolute differences.
        comparisons: logits + 1 loss sum + gradient coordinates compared.
        occurrences: occurrences audited (all of the batch's).
        cropped: occurrences longer than ``max_positions``, audited on a prefix only.
        max_positions: the profile's longest prediction length.
        vocab_size: vocabulary of the audit decoder (the compacted one by default).
        notes: what failed, first few items; empty when passed.
    """

    passed: bool
    max_logit_diff: float
    max_loss_diff: float
    max_grad_diff: float
    comparisons: int
    occurrences: int
    cropped: int
    max_positions: int
    vocab_size: int
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"notes": list(self.notes)}


# ---------------------------------------------------------------------------------------


def _occurrence_sequences(batch: Any, examples: Any = None) -> list[np.ndarray]:
    """Selected tokens of every occurrence: from ``examples`` or rebuilt from the cells."""
    sequences = []
    for rec in batch.occurrences:
        if examples is not None:
            sequences.append(np.asarray(examples.example_tokens(int(rec["ordinal"])), np.int64))
            continue
        row, start, stop = int(rec["row"]), int(rec["start"]), int(rec["stop"])
        inputs = np.asarray(batch.inputs[row, start:stop], np.int64)
        last = np.asarray(batch.targets[row, stop - 1 : stop], np.int64)
        sequences.append(np.concatenate([inputs, last]))
    return sequences


def _occurrence_eligibility(batch: Any, examples: Any = None) -> list[np.ndarray]:
    """Which pairs of every occurrence rule C5 makes loss-eligible, from the source:
    those whose target token ``examples``' mask marks, or all of them without a mask.
    (Without ``examples`` a batch is taken to be unmasked: only its examples know.)"""
    out = []
    for rec in batch.occurrences:
        pairs = int(rec["stop"] - rec["start"])
        mask = None if examples is None else examples.example_mask(int(rec["ordinal"]))
        out.append(np.ones(pairs, bool) if mask is None else np.asarray(mask[1:], bool))
    return out


def _cropped_cells(batch: Any, keep: np.ndarray) -> tuple[Cells, list[tuple[int, int, int]]]:
    """Rows rebuilt from each occurrence's first ``keep[j]`` cells, side by side.

    Returns the cells and, per occurrence, ``(row, new_start, kept)``. Everything but the
    column shift comes from the batch itself, so a wrong position, target, loss flag,
    segment start or valid length is still wrong here: a query keeps its distance to
    its segment start (clamped into the row), and a row's valid length ends at the
    first copied cell that lay at or beyond the batch's own valid length.
    """
    occ = batch.occurrences
    rows = batch.rows
    widths = np.zeros(rows, np.int64)
    np.add.at(widths, occ["row"].astype(np.int64), keep)
    cap = max(int(widths.max()) if rows else 0, 1)
    inputs = np.full((rows, cap), PAD_CELL, np.int64)
    targets = np.full((rows, cap), PAD_CELL, np.int64)
    positions = np.zeros((rows, cap), np.int64)
    starts = np.full((rows, cap), -1, np.int32)
    eligible = np.zeros((rows, cap), bool)
    old_column = np.full((rows, cap), np.iinfo(np.int64).max, np.int64)
    placed: list[tuple[int, int, int]] = []
    fill = np.zeros(rows, np.int64)
    for j in np.argsort(occ["start"].astype(np.int64) + occ["row"].astype(np.int64) * (1 << 32)):
        rec = occ[j]
        row, old = int(rec["row"]), int(rec["start"])
        new, n = int(fill[row]), int(keep[j])
        src, dst = slice(old, old + n), slice(new, new + n)
        inputs[row, dst] = batch.inputs[row, src]
        targets[row, dst] = batch.targets[row, src]
        positions[row, dst] = batch.positions[row, src]
        eligible[row, dst] = batch.loss_mask[row, src]
        shifted = batch.segment_starts[row, src].astype(np.int64) - old + new
        starts[row, dst] = np.clip(shifted, 0, np.arange(new, new + n))
        old_column[row, dst] = np.arange(old, old + n)
        fill[row] += n
        placed.append((int(j), row, new))
    order = {j: (row, new, int(keep[j])) for j, row, new in placed}
    cells = Cells(
        inputs=inputs,
        targets=targets,
        positions=positions,
        segment_starts=starts,
        valid_lengths=_kept_valid_lengths(old_column, batch.valid_lengths, fill),
        eligible=eligible,
    )
    return cells, [order[j] for j in range(len(occ))]


def _relabel(tokens: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """``seen[i]`` becomes ``i``; PAD_CELL stays PAD_CELL."""
    out = np.searchsorted(seen, tokens)
    return np.where(tokens == PAD_CELL, PAD_CELL, out)


def _alone_by_length(
    sequences: list[np.ndarray], eligibility: list[np.ndarray]
) -> list[tuple[list[int], Cells]]:
    """Separate execution, with equal-length occurrences stacked as rows of one call.

    Rows never interact (attention stays inside a row, everything else is per cell),
    and each row here is one occurrence from column 0 with no padding, so this is the
    same computation as one call per occurrence, with far fewer calls. Cell ``c`` of
    member ``i`` is eligible when ``eligibility[i][c]``; the eligible-cell logits are
    in row-major order, member by member.
    """
    groups: dict[int, list[int]] = {}
    for j, seq in enumerate(sequences):
        groups.setdefault(seq.size - 1, []).append(j)
    layouts = []
    for length, members in groups.items():
        stacked = np.stack([sequences[j] for j in members])
        rows = len(members)
        layouts.append(
            (
                members,
                Cells(
                    inputs=stacked[:, :-1].copy(),
                    targets=stacked[:, 1:].copy(),
                    positions=np.broadcast_to(np.arange(length), (rows, length)).copy(),
                    segment_starts=np.zeros((rows, length), np.int32),
                    valid_lengths=np.full(rows, length, np.int32),
                    eligible=np.stack([eligibility[j][:length] for j in members]),
                ),
            )
        )
    return layouts


def _position_notes(batch: Any) -> list[str]:
    """Occurrences whose positions do not restart at 0 (rule C4).

    Checked directly because the model cannot see it: rotary scores depend only on
    the distance between query and key, so positions shifted by a constant inside an
    isolated segment give the same logits.
    """
    notes = []
    for rec in batch.occurrences:
        row, start, stop = int(rec["row"]), int(rec["start"]), int(rec["stop"])
        found = np.asarray(batch.positions[row, start:stop])
        if not np.array_equal(found, np.arange(stop - start)):
            notes.append(
                f"occurrence {int(rec['ordinal'])}: positions {found[:8].tolist()} do not "
                f"restart at 0; expected 0..{stop - start - 1} (rule C4)"
            )
    return notes


def _kept_valid_lengths(
    old_column: np.ndarray, valid_lengths: np.ndarray, fill: np.ndarray
) -> np.ndarray:
    beyond = old_column >= np.asarray(valid_lengths, np.int64)[:, None]
    first_beyond = np.where(beyond.any(axis=1), beyond.argmax(axis=1), old_column.shape[1])
    return np.minimum(first_beyond, fill).astype(np.int32)


def audit(
    batch: PackedBatch,
    *,
    config: DecoderConfig | None = None,
    seed: int = 0,
    device: str = "cpu",
    examples: Examples | None = None,
    compact_vocabulary: bool = True,
) -> AuditReport:
    """Compare packed and separate execution of ``batch`` under the reference decoder.

    Args:
        batch: a :class:`~streampack.batch.PackedBatch`.
        config: decoder profile, :meth:`DecoderConfig.small` by default. Its vocabulary
            size is replaced (see ``compact_vocabulary``): the audit decoder is untrained
            and only has to read the batch's tokens.
        seed: parameter seed of the untrained decoder.
        device: ``"cpu"`` or ``"cuda"`` for the packed attention kernels.
        examples: optionally the ``Examples`` the batch was packed from (occurrence
            ordinals index it); then the separate runs read the source tokens, and
            their supervision mask: a separate run scores exactly the targets the mask
            marks (C5), and the packed batch must make those cells, and only those,
            loss-eligible. A masked batch needs its examples (without them every
            real target is expected to be eligible).
        compact_vocabulary: relabel the distinct tokens of the audited cells to
            ``0..U-1`` (in increasing order) and size the decoder's vocabulary ``U``.
            A relabeling is one-to-one, so no two different tokens become alike and
            the comparison proves the same; but the cost no longer grows with the
            binding's vocabulary (50,000 rows of logits per cell would dominate it).
            False: the decoder's vocabulary is the binding's.
    """
    config = config or DecoderConfig.small()
    vocab = int(batch.binding.vocab_size)
    occ = batch.occurrences
    if len(occ) == 0:
        return _report(
            Comparison(),
            0,
            0,
            config,
            0,
            notes=("no occurrences: nothing to compare",),
            comparisons=0,
        )
    lengths = (occ["stop"] - occ["start"]).astype(np.int64)
    keep = np.minimum(lengths, config.max_positions)
    cropped = int(np.count_nonzero(keep < lengths))
    cells, placement = _cropped_cells(batch, keep)
    sources = _occurrence_sequences(batch, examples)
    sequences = [seq[: int(k) + 1] for seq, k in zip(sources, keep, strict=True)]
    seen = np.unique(np.concatenate([cells.inputs.ravel(), cells.targets.ravel(), *sequences]))
    seen = seen[seen != PAD_CELL]
    outside = seen[(seen < 0) | (seen >= vocab)]
    if outside.size:
        failed = Comparison(failures=1)
        failed.max_logit_diff = failed.max_loss_diff = failed.max_grad_diff = float("inf")
        return _report(
            failed,
            len(occ),
            cropped,
            config,
            vocab,
            notes=(f"token {int(outside[0])} is outside the vocabulary [0, {vocab})",),
            comparisons=0,
        )
    if compact_vocabulary:
        cells.inputs = _relabel(cells.inputs, seen)
        cells.targets = _relabel(cells.targets, seen)
        sequences = [_relabel(seq, seen) for seq in sequences]
        vocab = int(seen.size)
    decoder = Decoder.init(dataclasses.replace(config, vocab_size=vocab), seed)
    eligibility = [e[: int(k)] for e, k in zip(_occurrence_eligibility(batch, examples), keep)]
    comparison = _compare_packed_with_alone(
        decoder, batch, cells, placement, sequences, eligibility, device
    )
    return _report(comparison, len(occ), cropped, config, vocab)


def _compare_packed_with_alone(
    decoder: Decoder,
    batch: PackedBatch,
    cells: Cells,
    placement: list[tuple[int, int, int]],
    sequences: list[np.ndarray],
    eligibility: list[np.ndarray],
    device: str,
) -> Comparison:
    """Positions (C4), then, occurrence by occurrence, which cells are loss-eligible
    (C5) and their logits; then the loss sums and every gradient coordinate (C7)."""
    occ = batch.occurrences
    comparison = Comparison()
    comparison.notes.extend(_position_notes(batch))
    comparison.failures += len(comparison.notes)
    # Logits stay in the eligible-cells-only form the forward pass makes ([N, V]):
    # no [rows, capacity, V] array is built, which matters for large vocabularies.
    packed, logits = decoder.loss_and_logits(cells, device=device)
    eligible_index = np.full(cells.shape, -1, np.int64)
    eligible_index[cells.eligible] = np.arange(packed.count)
    parts = []
    for members, alone in _alone_by_length(sequences, eligibility):
        part, logits_alone = decoder.loss_and_logits(alone)
        parts.append(part)
        first = 0  # where member i's eligible logits begin in logits_alone
        for j in members:
            row, new, n = placement[j]
            what = f"occurrence {int(occ['ordinal'][j])}"
            index = eligible_index[row, new : new + n]
            own = eligibility[j]
            count = int(own.sum())
            if not np.array_equal(index >= 0, own):
                comparison.failures += 1
                comparison.notes.append(
                    f"{what}: loss-eligible cells {np.flatnonzero(index >= 0).tolist()[:8]} "
                    f"but its targets are eligible at {np.flatnonzero(own).tolist()[:8]} "
                    "(rules C5, C7)"
                )
            else:
                comparison.add_logits(logits[index[own]], logits_alone[first : first + count], what)
            first += count
    comparison.add_loss(packed, sum_parts(parts))
    return comparison


def _report(
    comparison: Comparison,
    occurrences: int,
    cropped: int,
    config: DecoderConfig,
    vocab: int,
    notes: tuple[str, ...] | None = None,
    comparisons: int | None = None,
) -> AuditReport:
    return AuditReport(
        passed=comparison.passed,
        max_logit_diff=comparison.max_logit_diff,
        max_loss_diff=comparison.max_loss_diff,
        max_grad_diff=comparison.max_grad_diff,
        comparisons=comparison.comparisons if comparisons is None else comparisons,
        occurrences=int(occurrences),
        cropped=cropped,
        max_positions=config.max_positions,
        vocab_size=vocab,
        notes=tuple(comparison.notes[:8]) if notes is None else notes,
    )


# ---------------------------------------------------------------------------------------
# Full three-way comparison (the equivalence suite; streampack.trace formats it)
# ---------------------------------------------------------------------------------------


def select_examples(examples: Examples, ordinals: np.ndarray) -> Examples:
    """The examples at ``ordinals``, in that order, over the same token buffer."""
    ordinals = np.asarray(ordinals, dtype=np.int64)
    return Examples(
        tokens=examples.tokens,
        offsets=examples.offsets,
        doc=examples.doc[ordinals],
        start=examples.start[ordinals],
        stop=examples.stop[ordinals],
        source_id=examples.source_id[ordinals],
        example_id=examples.example_id[ordinals],
        mask=examples.mask,
        source=examples.source[ordinals],
        piece_start=examples.piece_start[ordinals],
    )


@dataclass
class Equivalence:
    """The comparisons against separate execution and the raw loss sums of every run.

    ``passed`` covers packed and padded execution only; the causal-prefix run, when
    asked for, is expected to fail.
    """

    packed_vs_separate: Comparison
    padded_vs_separate: Comparison
    causal_prefix_vs_separate: Comparison | None
    loss_sums: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.packed_vs_separate.passed and self.padded_vs_separate.passed


def compare_executions(
    decoder: Decoder,
    examples: Examples,
    batch: PackedBatch,
    *,
    device: str = "cpu",
    _with_causal_prefix: bool = False,
) -> Equivalence:
    """Packed vs separate and padded vs separate execution of one batch's occurrences.

    ``examples`` are the examples given to ``pack_examples`` (occurrence ordinals index
    them). Separate and padded runs read the examples directly, never the batch, so a
    packing mistake cannot cancel out. ``_with_causal_prefix`` adds a third, packed run
    whose key ranges are widened to the whole row prefix (an ordinary causal mask);
    it exists to show that this one breaks equivalence.
    """
    occ = batch.occurrences
    subset = select_examples(examples, occ["ordinal"])
    # With a supervision mask each separate run scores the targets the mask marks (C5);
    # its logits are NaN elsewhere, so only those cells are compared below.
    eligibility = _occurrence_eligibility(batch, examples)
    separate_cells = decoder.cells_separate(subset)
    for cells, own in zip(separate_cells, eligibility):
        cells.eligible = own[None, :].copy()
    alone = [decoder.evaluate(cells) for cells in separate_cells]
    separate_logits = [logits[0] for logits, _ in alone]
    separate = sum_parts([result for _, result in alone])
    packed_cells = decoder.cells_from_batch(batch)
    padded_cells = decoder.cells_padded(subset)
    for j, own in enumerate(eligibility):
        padded_cells.eligible[j, : own.size] = own
    runs = {
        "packed": (decoder.evaluate(packed_cells, device=device), True),
        "padded": (decoder.evaluate(padded_cells), False),
    }
    if _with_causal_prefix:
        widened = decoder.evaluate(packed_cells, device=device, causal_prefix=True)
        runs["packed_causal_prefix"] = (widened, True)

    comparisons: dict[str, Comparison] = {}
    for name, ((logits, result), packed_layout) in runs.items():
        comparison = Comparison()
        for j, rec in enumerate(occ):
            length = separate_logits[j].shape[0]
            if packed_layout:
                row, start = int(rec["row"]), int(rec["start"])
                mine = logits[row, start : start + length]
            else:
                mine = logits[j, :length]
            own = eligibility[j]
            comparison.add_logits(
                mine[own], separate_logits[j][own], f"occurrence {int(rec['ordinal'])}"
            )
            if not np.isnan(mine[~own]).all():  # a cell scored that the mask leaves out
                comparison.failures += 1
                comparison.notes.append(
                    f"occurrence {int(rec['ordinal'])}: cells outside its supervision mask "
                    "were scored (rule C5)"
                )
        comparison.add_loss(result, separate)
        comparisons[name] = comparison
    return Equivalence(
        packed_vs_separate=comparisons["packed"],
        padded_vs_separate=comparisons["padded"],
        causal_prefix_vs_separate=comparisons.get("packed_causal_prefix"),
        loss_sums={"separate": separate.loss_sum}
        | {name: result.loss_sum for name, ((_, result), _) in runs.items()},
    )
