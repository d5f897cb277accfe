"""A plain-Python next-fit packer: slow, obviously right, and the oracle for the kernels.

It walks examples one by one and writes cells one by one, straight from rules C1-C5,
sharing nothing with the compiled path but the output types.
"""

from __future__ import annotations

import numpy as np

from ..batch import NO_SEGMENT, OCCURRENCE_DTYPE, PAD_CELL, PackedBatch
from ..config import PackConfig
from ..errors import OversizedExample
from ..examples import Binding, Examples


def reference_pack(examples: Examples, binding: Binding, config: PackConfig) -> list[PackedBatch]:
    """The batches ``pack_examples`` must produce, built cell by cell."""
    examples.check_vocabulary(binding.vocab_size)
    # rows[r] is a list of (ordinal, inputs, targets) in placement order.
    rows: list[list[tuple[int, list[int], list[int]]]] = []
    used = config.capacity  # forces a first row
    for i in range(len(examples)):
        selected = [int(t) for t in examples.example_tokens(i)]
        inputs, targets = selected[:-1], selected[1:]
        if len(inputs) > config.capacity:
            raise OversizedExample(f"{examples.describe(i)} has {len(inputs)} pairs")
        if len(inputs) > config.capacity - used:
            rows.append([])
            used = 0
        rows[-1].append((i, inputs, targets))
        used += len(inputs)

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
            for ordinal, inputs, targets in row:
                for j, (x, y) in enumerate(zip(inputs, targets)):
                    fields["inputs"][r, column + j] = x
                    fields["targets"][r, column + j] = y
                    fields["segments"][r, column + j] = ordinal
                    fields["positions"][r, column + j] = j
                    fields["input_valid"][r, column + j] = True
                    fields["target_valid"][r, column + j] = True
                    fields["loss_mask"][r, column + j] = True
                    fields["segment_starts"][r, column + j] = column
                records.append(
                    (
                        ordinal, r, column, column + len(inputs), ordinal,
                        examples.source_id[ordinal], examples.example_id[ordinal],
                        examples.start[ordinal], examples.stop[ordinal], examples.doc[ordinal],
                    )
                )
                column += len(inputs)
            fields["valid_lengths"][r] = column
        batches.append(
            PackedBatch(  # (mypy matches a ** dict against every parameter: see batch.py)
                **fields,  # type: ignore[arg-type]
                occurrences=np.array(records, dtype=OCCURRENCE_DTYPE), binding=binding
            )
        )
    return batches
