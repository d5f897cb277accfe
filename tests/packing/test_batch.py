"""PackedBatch: block-causal permission (C6), padding (C5), layouts, stats, binding (C9)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from _packing_cases import BINDING, A, B, C

import streampack as sp


@pytest.fixture(scope="module")
def batch() -> sp.PackedBatch:
    examples = sp.Examples.from_documents([A, B, C])
    return sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=2)
    ).batches[0]


def test_second_segment_query_is_denied_every_key_of_the_first_c6(batch):
    for query in (3, 4):
        assert [batch.allowed_key(0, query, key) for key in range(3)] == [False] * 3


def test_bs_first_query_has_exactly_one_key_c6(batch):
    assert batch.key_range(0, 3) == (3, 4)
    assert batch.permission(0)[3].tolist() == [False, False, False, True, False, False]
    assert batch.key_range(0, 4) == (3, 5)


def test_padding_queries_and_keys_are_denied_although_they_share_segment_and_position_c5(batch):
    # Row 1 columns 4 and 5: both NO_SEGMENT and position 0, so only validity denies them.
    assert batch.segments[1, 4] == batch.segments[1, 5] == sp.NO_SEGMENT
    assert batch.positions[1, 4] == batch.positions[1, 5] == 0
    assert not batch.allowed_key(1, 5, 4) and not batch.allowed_key(1, 4, 4)
    assert not batch.allowed_key(1, 5, 0) and not batch.allowed_key(1, 3, 5)
    assert batch.key_range(1, 4) == batch.key_range(1, 5) == (0, 0)
    assert not batch.permission(1)[4:].any() and not batch.permission(1)[:, 4:].any()


def test_future_keys_are_denied_within_a_segment_c6(batch):
    assert batch.allowed_key(1, 2, 2) and not batch.allowed_key(1, 2, 3)


@pytest.mark.parametrize("coordinate", [(2, 0, 0), (-1, 0, 0), (0, 6, 0), (0, 0, 6)])
def test_coordinates_outside_the_batch_are_an_error(batch, coordinate):
    with pytest.raises(sp.InvalidCoordinate, match="outside"):
        batch.allowed_key(*coordinate)


def test_cu_seqlens_place_every_occurrence_in_the_flat_buffer(batch):
    layout = batch.cu_seqlens()
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert layout.cu_seqlens_padded.tolist() == [0, 3, 6, 12]
    assert layout.max_seqlen == 4
    assert layout.max_seqlen_padded == 6  # A 3, B 2 + 1 padding, C 4 + 2 padding
    assert layout.cu_seqlens.dtype == np.int32
    flat = batch.inputs.ravel()
    lengths = np.diff(layout.cu_seqlens)
    assert [flat[s : s + n].tolist() for s, n in zip(layout.cu_seqlens_padded, lengths)] == [
        [0, 99, 100],
        [0, 101],
        [0, 102, 103, 104],
    ]


def test_stats_count_cells_targets_and_edges(batch):
    assert batch.stats() == {
        "rows": 2,
        "capacity": 6,
        "cells": 12,
        "valid_cells": 9,
        "real_targets": 9,
        "supervised_targets": 9,
        "padding_cells": 3,
        "padding_fraction": 0.25,
        "occurrences": 3,
        "dense_score_positions": 72,
        "permitted_edges": 3 * 4 // 2 + 2 * 3 // 2 + 4 * 5 // 2,
        "valid_density": 9 / 12,
        "edge_density": 19 / 72,
        "policy": "next_fit",
    }


def test_check_binding_names_every_difference_c9(batch):
    batch.check_binding(BINDING)
    other = sp.Binding(32000, "fixture-bos0-eos1", "worked-example", "validation")
    with pytest.raises(
        sp.BindingMismatch, match=r"vocab_size: batch has 266, expected 32000; partition"
    ):
        batch.check_binding(other)


def test_digest_is_sha256_of_the_five_fields_in_order(batch):
    h = hashlib.sha256()
    for name in ("inputs", "targets", "segments", "positions", "loss_mask"):
        h.update(getattr(batch, name).tobytes())
    assert batch.digest() == h.hexdigest()


def test_filler_batch_is_all_padding():
    filler = sp.PackedBatch.filler_like(BINDING, rows=2, capacity=6)
    assert filler.filler and filler.occurrences.size == 0
    assert (filler.inputs == sp.PAD_CELL).all() and not filler.loss_mask.any()
    assert filler.valid_lengths.tolist() == [0, 0]
    assert filler.key_range(0, 0) == (0, 0)


def test_batch_arrays_are_contiguous_row_slices(batch):
    for name in sp.PackedBatch.ARRAY_FIELDS:
        assert getattr(batch, name).flags.c_contiguous, name


@pytest.mark.parametrize("rows, capacity", [(1, 5), (3, 7), (16, 2048)])
def test_expanded_arrays_are_aligned_disjoint_views_of_one_block(rows, capacity):
    block = np.full(sp.batch.expanded_nbytes(rows, capacity), 0xAB, np.uint8)
    arrays = sp.batch.expanded_arrays(rows, capacity, block)
    assert list(arrays) == list(sp.PackedBatch.ARRAY_FIELDS)
    for name, array in arrays.items():
        assert array.dtype == sp.batch.ARRAY_DTYPES[name]
        assert array.shape == ((rows,) if name == "valid_lengths" else (rows, capacity))
        assert array.flags.c_contiguous and array.flags.aligned and array.flags.writeable
        assert array.base is block
        array[...] = 0  # each field owns its bytes: together they clear the whole block
    assert not block.any()


def test_expand_into_a_block_writes_the_same_batch_as_fresh_memory():
    compact = sp.pack_compact(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    )[0]
    block = np.full(compact.expanded_nbytes + 8, 0x7F, np.uint8)  # stale bytes, room over
    reused, fresh = compact.expand(block), compact.expand()
    assert reused.inputs.base is block
    for name in sp.PackedBatch.ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(reused, name), getattr(fresh, name))


@pytest.mark.parametrize("seed", range(5))
def test_padded_max_seqlen_covers_every_padded_span(seed):
    # A kernel over the padded layout reads each occurrence's whole padded span
    # [padded[i], padded[i+1]); max_seqlen_padded must bound it (max_seqlen need not).
    rng = np.random.default_rng(seed)
    documents = [[1] * int(n) for n in rng.integers(2, 12, 30)]
    for batch in sp.pack_examples(
        sp.Examples.from_documents(documents),
        BINDING,
        sp.PackConfig(capacity=16, max_rows_per_batch=3),
    ).batches:
        layout = batch.cu_seqlens()
        spans = np.diff(layout.cu_seqlens_padded)
        assert layout.max_seqlen_padded == spans.max() >= layout.max_seqlen
        assert layout.max_seqlen == np.diff(layout.cu_seqlens).max()


def test_a_check_code_without_a_message_is_an_internal_error(monkeypatch):
    """The compiled check and the messages in CompactBatch.checked must agree; a code the
    table lacks is a streampack bug (InternalError), never a user-facing InvalidArray."""
    from streampack.kernels import pack_cpu

    compact = sp.pack_compact(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=8, max_rows_per_batch=2),
    )[0]
    monkeypatch.setattr(pack_cpu, "check_compact", lambda *args: (99, 0))
    with pytest.raises(sp.InternalError, match="code 99"):
        compact.checked(max_cells=1 << 20)
