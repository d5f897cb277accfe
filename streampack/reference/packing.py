"""A plain-Python packer (next-fit and bounded best-fit): slow, obviously right, and
the oracle for the kernels.

It walks examples one by one and writes cells one by one, straight from rules C1-C5
(supervision masks included) and the placement rules of ``streampack.packing``'s
docstring, sharing nothing with the compiled path but the output types.
"""

from __future__ import annotations

import numpy as np

from ..batch import NO_SEGMENT, OCCURRENCE_DTYPE, PAD_CELL, PackedBatch
from ..config import PackConfig
from ..errors import OversizedExample
from ..examples import Binding, Examples

#: A placed example: (ordinal, inputs, targets, whether each target is loss-eligible).
Placed = tuple[int, list[int], list[int], list[bool]]


def _next_fit(pairs: list[Placed], capacity: int) -> list[list[Placed]]:
    rows: list[list[Placed]] = []
    used = capacity  # forces a first row
    for placed in pairs:
        if len(placed[1]) > capacity - used:
            rows.append([])
            used = 0
        rows[-1].append(placed)
        used += len(placed[1])
    return rows


def _best_fit(pairs: list[Placed], capacity: int, open_rows: int) -> list[list[Placed]]:
    rows: list[list[Placed]] = []  # in opening order
    open_: list[int] = []  # indices into rows of the open ones, in opening order

    def room(r: int) -> int:
        return capacity - sum(len(inputs) for _, inputs, _, _ in rows[r])

    for placed in pairs:
        length = len(placed[1])
        fitting = [r for r in open_ if room(r) >= length]
        if fitting:
            target = min(fitting, key=lambda r: (room(r), open_.index(r)))
        else:
            if len(open_) == open_rows:
                open_.remove(min(open_, key=lambda r: (room(r), open_.index(r))))
            rows.append([])
            target = len(rows) - 1
            open_.append(target)
        rows[target].append(placed)
        if room(target) == 0:
            open_.remove(target)
    return rows


def reference_pack(examples: Examples, binding: Binding, config: PackConfig) -> list[PackedBatch]:
    """The batches ``pack_examples`` must produce, built cell by cell."""
    examples.check_vocabulary(binding.vocab_size)
    pairs: list[Placed] = []
    for i in range(len(examples)):
        selected = [int(t) for t in examples.example_tokens(i)]
        inputs, targets = selected[:-1], selected[1:]
        if len(inputs) > config.capacity:
            raise OversizedExample(f"{examples.describe(i)} has {len(inputs)} pairs")
        # C5: the pair (t[j], t[j+1]) is eligible when the mask marks its target t[j+1].
        mask = examples.example_mask(i)
        eligible = [True] * len(targets) if mask is None else [m == 1 for m in mask[1:].tolist()]
        pairs.append((i, inputs, targets, eligible))
    if config.policy == "best_fit":
        rows = _best_fit(pairs, config.capacity, config.open_row_limit)
    else:
        rows = _next_fit(pairs, config.capacity)

    batches = []
    for first in range(0, len(rows), config.max_rows_per_batch):
        batch_rows = rows[first : first + config.max_rows_per_batch]
        shape = (len(batch_rows), config.capacity)
        fields = {
            "inputs": np.full(shape, PAD_CELL, np.int32),
            "targets": np.full(shape, PAD_CELL, np.int32),
            "segments": np.full(shape, NO_SEGMENT, np.int32),
            "positions": np.zeros(shape, np.int32),
            "input_valid": np.zeros(shape, bool),
            "target_valid": np.zeros(shape, bool),
            "loss_mask": np.zeros(shape, bool),
            "segment_starts": np.full(shape, -1, np.int32),
            "valid_lengths": np.zeros(len(batch_rows), np.int32),
        }
        records = []
        for r, row in enumerate(batch_rows):
            column = 0
            for ordinal, inputs, targets, eligible in row:
                for j, (x, y, e) in enumerate(zip(inputs, targets, eligible)):
                    fields["inputs"][r, column + j] = x
                    fields["targets"][r, column + j] = y
                    fields["segments"][r, column + j] = ordinal
                    fields["positions"][r, column + j] = j
                    fields["input_valid"][r, column + j] = True
                    fields["target_valid"][r, column + j] = True
                    fields["loss_mask"][r, column + j] = e
                    fields["segment_starts"][r, column + j] = column
                records.append(
                    (
                        ordinal,
                        r,
                        column,
                        column + len(inputs),
                        ordinal,
                        examples.source[ordinal],
                        examples.source_id[ordinal],
                        examples.example_id[ordinal],
                        examples.start[ordinal] + examples.piece_start[ordinal],
                        examples.stop[ordinal] + examples.piece_start[ordinal],
                    )
                )
                column += len(inputs)
            fields["valid_lengths"][r] = column
        batches.append(
            PackedBatch(  # (mypy matches a ** dict against every parameter: see batch.py)
                **fields,  # type: ignore[arg-type]
                occurrences=np.array(records, dtype=OCCURRENCE_DTYPE),
                binding=binding,
                policy=config.policy,
            )
        )
    return batches
