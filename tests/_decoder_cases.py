"""Shared cases for the decoder, equivalence, isolation and audit tests."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import streampack as sp
from streampack.decoder import Decoder, DecoderConfig

BINDING = sp.Binding(266, "fixture-bos0-eos1", "worked-example", "train")
A, B, C = [0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]

#: Worked example, row 0: A in columns 0..2, B in 3..4, padding in 5. Row 1: C, padding.
A_COLUMNS = [0, 1, 2]
B_COLUMNS = [3, 4]
ROW0_PADDING = [5]

PROFILES = {"small": DecoderConfig.small(), "large": DecoderConfig.large()}


@pytest.fixture
def one_numba_thread():
    """Run the compiled kernels on one thread for the duration of a test.

    The suites below make thousands of kernel calls on arrays of a few hundred values,
    where waking a thread pool costs more than the work (several times more on a
    loaded machine). The kernels' results do not depend on the thread count; their
    own tests cover the threaded path, and the worked-example tests here keep it.
    """
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def worked_example() -> tuple[sp.Examples, sp.PackedBatch]:
    examples = sp.Examples.from_documents([A, B, C])
    config = sp.PackConfig(capacity=6, max_rows_per_batch=2)
    (batch,) = sp.pack_examples(examples, BINDING, config).batches
    return examples, batch


def worked_decoder() -> Decoder:
    return Decoder.init(DecoderConfig.large(), 42)


def random_case(
    seed: int, config: DecoderConfig, *, max_capacity: int = 32
) -> tuple[sp.Examples, sp.PackConfig]:
    """Random documents and ranges: interior ranges, whole documents and exact duplicates.

    Every example fits the profile (prediction length <= max_positions); the capacity
    is at least the longest example and at most ``min(max_capacity, 3 * max_positions)``
    (so rows hold one to several occurrences), the row limit 1..3.
    """
    rng = np.random.default_rng(seed)
    longest = config.max_positions
    documents = [
        rng.integers(0, config.vocab_size, size=int(rng.integers(2, longest + 4)))
        for _ in range(int(rng.integers(1, 5)))
    ]
    doc, start, stop = [], [], []
    for _ in range(int(rng.integers(1, 9))):
        if doc and rng.random() < 0.25:
            # The same document and range again: a second occurrence of one example.
            j = int(rng.integers(0, len(doc)))
            doc.append(doc[j])
            start.append(start[j])
            stop.append(stop[j])
            continue
        d = int(rng.integers(0, len(documents)))
        size = len(documents[d])
        pairs = int(rng.integers(1, min(longest, size - 1) + 1))
        first = int(rng.integers(0, size - pairs))
        doc.append(d)
        start.append(first)
        stop.append(first + pairs + 1)
    offsets = np.zeros(len(documents) + 1, np.int64)
    np.cumsum([len(d) for d in documents], out=offsets[1:])
    examples = sp.Examples(
        tokens=np.concatenate(documents),
        offsets=offsets,
        doc=np.array(doc),
        start=np.array(start),
        stop=np.array(stop),
    )
    widest = int(examples.prediction_lengths.max())
    capacity = int(rng.integers(widest, max(widest, min(max_capacity, 3 * longest)) + 1))
    rows = int(rng.integers(1, 4))
    return examples, sp.PackConfig(capacity=capacity, max_rows_per_batch=rows)
