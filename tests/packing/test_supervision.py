"""Supervision masks (rule C5): a pair is loss-eligible exactly when its target is valid
and the mask marks the target token. One scenario suite for the compiled and reference
packers under both policies; properties over random masked inputs; a mask changes
``loss_mask`` and nothing else, and an unmasked batch is byte-identical to before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _packing_cases import (
    BINDING,
    MASK_A,
    MASK_B,
    MASK_C,
    MASKED_LOSS_ROWS,
    PACKERS,
    A,
    B,
    C,
    compiled_pack,
    random_packing_case,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack as sp
from streampack.reference.packing import reference_pack

packers = pytest.mark.parametrize("pack", PACKERS.values(), ids=PACKERS.keys())
policies = pytest.mark.parametrize("policy", sp.PackConfig.POLICIES)
WORKED_CONFIG = sp.PackConfig(capacity=6, max_rows_per_batch=2)
OTHER_FIELDS = [name for name in sp.PackedBatch.ARRAY_FIELDS if name != "loss_mask"]


def worked(masked: bool = True) -> sp.Examples:
    masks = [MASK_A, MASK_B, MASK_C] if masked else None
    return sp.Examples.from_documents([A, B, C], masks=masks)


@packers
def test_worked_example_trains_only_the_marked_targets_c5(pack):
    (batch,) = pack(worked(), BINDING, WORKED_CONFIG)
    assert batch.loss_mask.tolist() == MASKED_LOSS_ROWS
    # Validity is the validity of the unmasked batch: the mask only narrows the loss.
    valid = [[True] * 5 + [False], [True] * 4 + [False] * 2]
    assert batch.target_valid.tolist() == valid and batch.input_valid.tolist() == valid
    assert batch.stats()["real_targets"] == 9 and batch.stats()["supervised_targets"] == 6


@packers
def test_a_mask_changes_loss_mask_and_nothing_else_c5_c6(pack):
    (masked,) = pack(worked(), BINDING, WORKED_CONFIG)
    (plain,) = pack(worked(masked=False), BINDING, WORKED_CONFIG)
    for name in OTHER_FIELDS:
        np.testing.assert_array_equal(getattr(masked, name), getattr(plain, name), name)
    assert masked.occurrences.tobytes() == plain.occurrences.tobytes()
    for r in range(masked.rows):  # permission (C6) ignores the mask
        np.testing.assert_array_equal(masked.permission(r), plain.permission(r))


@packers
def test_an_interior_range_reads_the_mask_of_its_own_targets_only_c1_c5(pack):
    # Range [1, 4) of [0, 5, 6, 7, 8, 1]: pairs (5->6), (6->7). The mask of 5 (the
    # range's first token) and of everything outside the range is never read.
    tokens = [0, 5, 6, 7, 8, 1]
    for first in (0, 1):
        mask = [1, first, 0, 1, 1, 1]
        examples = sp.Examples.from_documents([tokens], ranges=[(1, 4)], masks=[mask])
        (batch,) = pack(examples, BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1))
        assert batch.loss_mask[0].tolist() == [False, True, False, False]


@packers
def test_an_all_zero_mask_packs_with_no_eligible_target(pack):
    examples = sp.Examples.from_documents([A, B], masks=[[0] * 4, [0] * 3])
    (batch,) = pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=1))
    assert not batch.loss_mask.any() and batch.target_valid.sum() == 5


def test_unmasked_batches_keep_their_pinned_digests():
    """Digests of the worked documents packed twice over, computed before masks existed
    (commit 69d2882): a corpus without a mask must give byte-identical batches."""
    examples = sp.Examples.from_documents([A, B, C, A, C, B])
    want = [
        "68bd6c66b8a8bd4b24751930568ff0077cb42c6997a1fd3567e85a1a8882495c",
        "9494d68e356a7cc73443f7d9cab22e7f3fefbf1d11086b2f62a26f2b15443ad9",
    ]
    for pack in PACKERS.values():
        assert [b.digest() for b in pack(examples, BINDING, WORKED_CONFIG)] == want
    compact = sp.pack_compact(examples, BINDING, WORKED_CONFIG)
    assert [c.mask for c in compact] == [None, None]
    assert [c.expand().digest() for c in compact] == want


# -- properties over random masked inputs ---------------------------------------------


def eligible_by_rule(examples: sp.Examples, batch: sp.PackedBatch) -> np.ndarray:
    """C5 written out: the cell of pair j of an occurrence is eligible when the mask
    marks the token that pair predicts, t[start + j + 1] of its document."""
    want = np.zeros_like(batch.loss_mask)
    for record in batch.occurrences:
        i, r = int(record["ordinal"]), int(record["row"])
        base = int(examples.offsets[examples.doc[i]]) + int(examples.start[i])
        for j in range(int(record["stop"] - record["start"])):
            want[r, int(record["start"]) + j] = examples.mask[base + j + 1] == 1
    return want


@policies
@settings(max_examples=150, deadline=None)
@given(random_packing_case(with_mask=True), st.integers(1, 4))
def test_eligible_cells_are_the_valid_targets_whose_token_is_marked(policy, case, open_rows):
    examples, binding, config = case
    config = dataclasses.replace(
        config, policy=policy, open_rows=open_rows if policy == "best_fit" else None
    )
    got = compiled_pack(examples, binding, config)
    want = reference_pack(examples, binding, config)
    plain = compiled_pack(dataclasses.replace(examples, mask=None), binding, config)
    compact = sp.pack_compact(examples, binding, config)
    assert len(got) == len(want) == len(plain) == len(compact)
    for g, w, p, c in zip(got, want, plain, compact):
        for name in sp.PackedBatch.ARRAY_FIELDS:  # kernel == reference, every field
            np.testing.assert_array_equal(getattr(g, name), getattr(w, name), name)
        np.testing.assert_array_equal(g.occurrences, w.occurrences)
        np.testing.assert_array_equal(g.loss_mask, eligible_by_rule(examples, g))
        assert not (g.loss_mask & ~g.target_valid).any()
        for name in OTHER_FIELDS:  # the mask changes loss_mask only
            np.testing.assert_array_equal(getattr(g, name), getattr(p, name), name)
        np.testing.assert_array_equal(g.occurrences, p.occurrences)
        expanded = c.checked(max_cells=config.max_cells).expand()
        for name in sp.PackedBatch.ARRAY_FIELDS:  # the compact path, mask travelling
            np.testing.assert_array_equal(getattr(expanded, name), getattr(g, name), name)
        assert c.supervised_targets == int(g.loss_mask.sum())
        assert c.mask.tolist() == [
            m
            for record in c.occurrences
            for m in examples.example_mask(int(record["ordinal"])).tolist()
        ]


# -- what a mask may be ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([1, 0, 1], r"mask has shape \(3,\) but tokens has 4 entries; give one 0/1 value"),
        ([0, 1, 2, 1], r"mask\[2\] = 2; accepted: 0 or 1"),
        ([0, -1, 1, 1], r"mask\[1\] = -1; accepted: 0 or 1"),
        (
            np.array([0.0, 1.0, 1.0, 1.0]),
            "mask must hold bool or integer 0/1 values, got dtype float64",
        ),
        ([[0, 1, 1, 1]], r"mask has shape \(1, 4\)"),
    ],
)
def test_a_bad_mask_is_refused_once_naming_the_value(mask, message):
    with pytest.raises(sp.InvalidExample, match=message):
        sp.Examples(tokens=A, offsets=[0, 4], doc=[0], start=[0], stop=[4], mask=mask)


def test_a_mask_is_stored_as_uint8_whatever_0_1_type_it_came_in():
    for values in ([0, 0, 1, 1], np.array([False, False, True, True]), np.array(MASK_A, np.int64)):
        examples = sp.Examples(tokens=A, offsets=[0, 4], doc=[0], start=[0], stop=[4], mask=values)
        assert examples.mask.dtype == np.uint8 and examples.mask.tolist() == MASK_A
    with pytest.raises(sp.InvalidExample, match="masks has 1 entries for 2 documents"):
        sp.Examples.from_documents([A, B], masks=[MASK_A])
    with pytest.raises(sp.InvalidExample, match=r"document 1: mask has shape \(2,\) but the "):
        sp.Examples.from_documents([A, B], masks=[MASK_A, [0, 1]])


def worked_compact() -> sp.CompactBatch:
    (compact,) = sp.pack_compact(worked(), BINDING, WORKED_CONFIG)
    return compact


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (np.ones(11, np.uint8), "mask has 11 values for 12 tokens"),
        (np.ones(12, np.int32), "mask dtype int32 shape"),
        (np.full(12, 2, np.uint8), r"mask\[0\] = 2; accepted: 0 or 1"),
        (np.ones((1, 12), np.uint8), r"mask dtype uint8 shape \(1, 12\); expected 1-D"),
    ],
)
def test_a_compact_batch_from_elsewhere_with_a_bad_mask_is_refused(mask, message):
    batch = dataclasses.replace(worked_compact(), mask=mask)
    with pytest.raises(sp.InvalidArray, match=message):
        batch.checked(max_cells=12)


def test_a_filler_carries_no_mask():
    filler = sp.CompactBatch.filler_like(BINDING, rows=2, capacity=6)
    with pytest.raises(sp.InvalidArray, match="no occurrences, no tokens and no mask"):
        dataclasses.replace(filler, mask=np.zeros(0, np.uint8)).checked(max_cells=12)


def test_compact_batches_carry_one_mask_byte_per_token_and_budget_it_c8():
    compact = worked_compact()
    assert compact.mask.tolist() == MASK_A + MASK_B + MASK_C
    plain = sp.pack_compact(worked(masked=False), BINDING, WORKED_CONFIG)[0]
    assert compact.nbytes == plain.nbytes + 12
    examples = sp.Examples.from_documents([[1, 2, 3]] * 100, masks=[[0, 1, 1]] * 100)
    config = sp.PackConfig(capacity=64, max_rows_per_batch=2)
    _, unmasked_peak = sp.packing._plan(
        dataclasses.replace(examples, mask=None), BINDING, config, compact=True
    )
    _, peak = sp.packing._plan(examples, BINDING, config, compact=True)
    assert peak == unmasked_peak + 300  # one byte for each of the 300 selected tokens
    tight = dataclasses.replace(config, max_metadata_bytes=peak - 1)
    assert len(sp.pack_compact(dataclasses.replace(examples, mask=None), BINDING, tight)) == 2
    with pytest.raises(sp.MetadataBudgetError, match=f"needs {peak} bytes"):
        sp.pack_compact(examples, BINDING, tight)
