"""Packing (rules C1-C4, C8): one scenario suite for the compiled and reference packers,
each under both placement policies (next-fit, rule C2, and the opt-in bounded best-fit)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _packing_cases import BINDING, PACKERS, A, B, C, compiled_pack, random_packing_case
from hypothesis import given, settings
from hypothesis import strategies as st

import streampack as sp
from streampack.reference.packing import reference_pack

packers = pytest.mark.parametrize("pack", PACKERS.values(), ids=PACKERS.keys())
policies = pytest.mark.parametrize("policy", sp.PackConfig.POLICIES)


def with_policy(config: sp.PackConfig, policy: str, open_rows: int | None = None) -> sp.PackConfig:
    return dataclasses.replace(config, policy=policy, open_rows=open_rows)


def rows_of(batches, field):
    return [row for batch in batches for row in getattr(batch, field).tolist()]


@packers
def test_worked_example_rows_c1_c2_c4(pack):
    batches = pack(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    )
    assert len(batches) == 1
    assert rows_of(batches, "inputs") == [[0, 99, 100, 0, 101, -1], [0, 102, 103, 104, -1, -1]]
    assert rows_of(batches, "targets") == [[99, 100, 1, 101, 1, -1], [102, 103, 104, 1, -1, -1]]
    assert rows_of(batches, "segments") == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert rows_of(batches, "positions") == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert rows_of(batches, "segment_starts") == [[0, 0, 0, 3, 3, -1], [0, 0, 0, 0, -1, -1]]
    for field in ("input_valid", "target_valid", "loss_mask"):
        assert rows_of(batches, field) == [[True] * 5 + [False], [True] * 4 + [False] * 2]
    assert batches[0].valid_lengths.tolist() == [5, 4]


@packers
def test_last_pair_of_a_predicts_its_own_eos_not_bs_bos_c1(pack):
    batch = pack(
        sp.Examples.from_documents([A, B]), BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=1)
    )[0]
    assert batch.inputs[0, 2] == 100 and batch.targets[0, 2] == 1  # A's EOS
    assert batch.inputs[0, 3] == 0  # B's BOS is an input of B, never a target of A
    assert 0 not in batch.targets[0, :3].tolist()


@packers
def test_interior_range_adds_no_bos_or_eos_c1(pack):
    examples = sp.Examples.from_documents([[0, 5, 6, 7, 8, 1]], ranges=[(1, 4)])
    batch = pack(examples, BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1))[0]
    assert batch.inputs[0].tolist() == [5, 6, -1, -1]
    assert batch.targets[0].tolist() == [6, 7, -1, -1]


@packers
def test_two_uses_of_one_document_and_range_get_distinct_segments_c3(pack):
    examples = sp.Examples(
        tokens=[0, 101, 1],
        offsets=[0, 3],
        doc=[0, 0],
        start=[0, 0],
        stop=[3, 3],
        source_id=[7, 7],
        example_id=[9, 9],
    )
    batch = pack(examples, BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1))[0]
    assert batch.segments[0].tolist() == [0, 0, 1, 1]
    assert batch.positions[0].tolist() == [0, 1, 0, 1]
    assert batch.occurrences["segment"].tolist() == [0, 1]
    assert batch.occurrences["example_id"].tolist() == [9, 9]
    assert not batch.allowed_key(0, 2, 0) and not batch.allowed_key(0, 2, 1)


@packers
def test_exact_fill_makes_no_empty_row_c2(pack):
    # 3 + 3 pairs fill capacity 6 exactly; the next example opens row 1, nothing more.
    examples = sp.Examples.from_documents([[1, 2, 3, 4]] * 2 + [[5, 6]])
    batches = pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=4))
    assert [b.rows for b in batches] == [2]
    assert batches[0].valid_lengths.tolist() == [6, 1]
    exact = pack(
        sp.Examples.from_documents([[1, 2, 3, 4]] * 2),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=4),
    )
    assert [b.rows for b in exact] == [1]


@packers
def test_next_fit_never_revisits_a_row_but_best_fit_fills_the_gap_c2(pack):
    # 4 pairs, then 4 (new row), then 1: next-fit puts it in row 1, not the gap in row 0;
    # best-fit finds rows 0 and 1 both leaving 2 cells and takes row 0 (opened first).
    examples = sp.Examples.from_documents([[1] * 5, [2] * 5, [3, 3]])
    batch = pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=4))[0]
    if pack.policy == "next_fit":
        assert batch.occurrences["row"].tolist() == [0, 1, 1]
        assert batch.occurrences["ordinal"].tolist() == [0, 1, 2]
        assert batch.valid_lengths.tolist() == [4, 5]
    else:  # records row by row, left to right: row 0 holds ordinals 0 and 2
        assert batch.occurrences["row"].tolist() == [0, 0, 1]
        assert batch.occurrences["ordinal"].tolist() == [0, 2, 1]
        assert batch.segments.tolist() == [[0] * 4 + [2, -1], [1] * 4 + [-1, -1]]
        assert batch.valid_lengths.tolist() == [5, 4]


@packers
def test_last_batch_keeps_its_smaller_row_count_c2(pack):
    examples = sp.Examples.from_documents([[1, 2, 3]] * 5)
    batches = pack(examples, BINDING, sp.PackConfig(capacity=2, max_rows_per_batch=2))
    assert [b.rows for b in batches] == [2, 2, 1]
    assert [b.occurrences["row"].tolist() for b in batches] == [[0, 1], [0, 1], [0]]
    assert [b.occurrences["ordinal"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]


@packers
def test_oversized_example_is_an_error_naming_it_c2(pack):
    examples = sp.Examples.from_documents(
        [[1, 2], [1, 2, 3, 4, 5, 6, 7, 8]], source_ids=[10, 11], example_ids=[20, 21]
    )
    with pytest.raises(sp.OversizedExample, match=r"example 1 \(source_id 11, example_id 21\)"):
        pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=1))


def test_oversized_message_says_how_to_fix():
    examples = sp.Examples.from_documents([[1] * 9])
    with pytest.raises(sp.OversizedExample, match=r"8 prediction pairs.*capacity=6.*at least 8"):
        compiled_pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=1))


def test_out_of_vocabulary_token_is_named_and_nothing_is_returned():
    examples = sp.Examples.from_documents([[0, 1, 2], [0, 266, 1]])
    with pytest.raises(sp.InvalidExample, match=r"example 1 .*token 266 at position 1.*0\.\.265"):
        sp.pack_examples(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=1))


def test_out_of_vocabulary_token_outside_every_range_is_never_read():
    examples = sp.Examples.from_documents([[0, 5, 6, 999]], ranges=[(0, 3)])
    epoch = sp.pack_examples(examples, BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1))
    assert epoch.batches[0].targets[0].tolist() == [5, 6, -1, -1]


def test_empty_examples_give_an_empty_epoch():
    epoch = sp.pack_examples(
        sp.Examples.from_documents([]), BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1)
    )
    assert (epoch.batches, epoch.row_count, epoch.occurrence_count) == ([], 0, 0)


def test_max_cells_refuses_a_batch_before_allocating_c8():
    config = sp.PackConfig(capacity=4, max_rows_per_batch=3, max_cells=8)
    examples = sp.Examples.from_documents([[1, 2, 3, 4, 5]] * 3)
    with pytest.raises(sp.CapacityError, match=r"3 rows x capacity 4 = 12 cells but max_cells=8"):
        sp.pack_examples(examples, BINDING, config)
    # Two rows fit under the same limit.
    assert (
        sp.pack_examples(
            sp.Examples.from_documents([[1, 2, 3, 4, 5]] * 2), BINDING, config
        ).row_count
        == 2
    )


def test_metadata_budget_refuses_with_both_numbers_c8():
    examples = sp.Examples.from_documents([[1, 2, 3]] * 100)
    needed = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=64, max_rows_per_batch=2)
    ).metadata_peak
    with pytest.raises(
        sp.MetadataBudgetError, match=rf"needs {needed} bytes but max_metadata_bytes={needed - 1}"
    ):
        sp.pack_examples(
            examples,
            BINDING,
            sp.PackConfig(capacity=64, max_rows_per_batch=2, max_metadata_bytes=needed - 1),
        )
    sp.pack_examples(
        examples,
        BINDING,
        sp.PackConfig(capacity=64, max_rows_per_batch=2, max_metadata_bytes=needed),
    )


def test_budget_is_checked_before_a_huge_allocation_c8():
    # 2**40 cells would need terabytes: the budget check must refuse before np.empty.
    examples = sp.Examples.from_documents([[1, 2]] * 4)
    config = sp.PackConfig(capacity=2**30, max_rows_per_batch=1, max_metadata_bytes=1 << 30)
    with pytest.raises(sp.MetadataBudgetError, match="max_metadata_bytes=1073741824"):
        sp.pack_examples(examples, BINDING, config)


def test_segment_ids_are_global_occurrence_ordinals_across_batches_c3():
    examples = sp.Examples.from_documents([[1, 2, 3]] * 4)
    batches = compiled_pack(examples, BINDING, sp.PackConfig(capacity=2, max_rows_per_batch=2))
    assert [b.segments[:, 0].tolist() for b in batches] == [[0, 1], [2, 3]]


# -- properties over random inputs ----------------------------------------------------


@policies
@settings(max_examples=150, deadline=None)
@given(random_packing_case(), st.integers(1, 4))
def test_compiled_packer_equals_reference_and_keeps_every_pair(policy, case, open_rows):
    examples, binding, config = case
    config = with_policy(config, policy, open_rows if policy == "best_fit" else None)
    got = compiled_pack(examples, binding, config)
    want = reference_pack(examples, binding, config)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for field in sp.PackedBatch.ARRAY_FIELDS:
            np.testing.assert_array_equal(getattr(g, field), getattr(w, field), err_msg=field)
        np.testing.assert_array_equal(g.occurrences, w.occurrences)
    seen = []
    for batch in got:
        for record in batch.occurrences:
            r, c0, c1 = int(record["row"]), int(record["start"]), int(record["stop"])
            selected = examples.example_tokens(int(record["ordinal"]))
            # C1: inputs and targets are exactly the pairs of the selected range.
            assert batch.inputs[r, c0:c1].tolist() == selected[:-1].tolist()
            assert batch.targets[r, c0:c1].tolist() == selected[1:].tolist()
            # C4: positions restart at 0 for every occurrence.
            assert batch.positions[r, c0:c1].tolist() == list(range(c1 - c0))
            assert set(batch.segments[r, c0:c1].tolist()) == {int(record["segment"])}
            seen.append(int(record["segment"]))
        assert (batch.valid_lengths <= batch.capacity).all()
        assert batch.rows <= config.max_rows_per_batch
        # Records run row by row, left to right, and segments increase along a row.
        order = list(zip(batch.occurrences["row"].tolist(), batch.occurrences["start"].tolist()))
        assert order == sorted(order)
        for r in range(batch.rows):
            row_segments = batch.occurrences["segment"][batch.occurrences["row"] == r]
            assert (np.diff(row_segments) > 0).all()
    # C3: one segment per supplied example, unique; next-fit keeps supplied order.
    assert sorted(seen) == list(range(len(examples)))
    if policy == "next_fit":
        assert seen == list(range(len(examples)))


@policies
@settings(max_examples=60, deadline=None)
@given(random_packing_case())
def test_allowed_key_key_range_and_permission_agree_everywhere_c6(policy, case):
    examples, binding, config = case
    for batch in compiled_pack(examples, binding, with_policy(config, policy)):
        for r in range(batch.rows):
            dense = batch.permission(r)
            for q in range(batch.capacity):
                lo, hi = batch.key_range(r, q)
                from_range = np.zeros(batch.capacity, bool)
                from_range[lo:hi] = True
                from_rule = [batch.allowed_key(r, q, k) for k in range(batch.capacity)]
                assert dense[q].tolist() == from_rule == from_range.tolist()


@packers
def test_padding_may_not_fill_the_middle_of_a_row(pack):
    # Both policies leave padding only at row tails, which is what makes ranges exact.
    examples = sp.Examples.from_documents([[1] * 4, [2] * 6, [3] * 2])
    batch = pack(examples, BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=4))[0]
    for r in range(batch.rows):
        valid = batch.input_valid[r]
        assert valid[: batch.valid_lengths[r]].all() and not valid[batch.valid_lengths[r] :].any()


def test_occurrence_count_must_fit_int32_segment_ids_c3(monkeypatch):
    # 2**31 real examples would need tens of GB; lower the limit to exercise the check.
    import streampack.packing as packing

    monkeypatch.setattr(packing, "_MAX_OCCURRENCES", 2)
    examples = sp.Examples.from_documents([[1, 2]] * 3)
    with pytest.raises(sp.InvalidExample, match=r"3 examples in one call; segment IDs are int32"):
        sp.pack_examples(examples, BINDING, sp.PackConfig(capacity=4, max_rows_per_batch=1))


# -- compact batches: the same batches as plans -----------------------------------------


@policies
@settings(max_examples=100, deadline=None)
@given(random_packing_case())
def test_compact_batches_expand_to_exactly_the_packed_batches(policy, case):
    examples, binding, config = case
    config = with_policy(config, policy)
    packed = compiled_pack(examples, binding, config)
    compact = sp.pack_compact(examples, binding, config)
    assert len(compact) == len(packed)
    for c, p in zip(compact, packed):
        expanded = c.checked(max_cells=config.max_cells).expand()
        for field in sp.PackedBatch.ARRAY_FIELDS:
            np.testing.assert_array_equal(getattr(expanded, field), getattr(p, field), field)
        np.testing.assert_array_equal(expanded.occurrences, p.occurrences)
        assert expanded.digest() == p.digest()


@policies
@settings(max_examples=100, deadline=None)
@given(random_packing_case())
def test_plans_from_ranges_alone_are_the_plans_of_pack_compact(policy, case):
    """A pack worker plans a window without its tokens (they stay with the producer):
    the ranges alone give the same records and batch sizes, under either policy, the
    examples' sources and piece starts included."""
    examples, binding, config = case
    config = with_policy(config, policy)
    count = len(examples)
    examples = dataclasses.replace(
        examples, source=np.arange(count) % 3, piece_start=np.arange(count) * 1000
    )
    occurrences, sizes = sp.packing.plan_compact(examples, binding, config)
    lengths = examples.offsets[examples.doc + 1] - examples.offsets[examples.doc]
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # example i selects from document i
    got, got_sizes = sp.packing.plan_ranges(
        offsets,
        examples.start,
        examples.stop,
        examples.source_id,
        examples.example_id,
        config,
        source=examples.source,
        piece_start=examples.piece_start,
    )
    np.testing.assert_array_equal(got_sizes, sizes)
    assert got.tobytes() == occurrences.tobytes()
    ordinal = occurrences["ordinal"]
    np.testing.assert_array_equal(occurrences["source"], ordinal % 3)
    np.testing.assert_array_equal(
        occurrences["range_start"], examples.start[ordinal] + ordinal * 1000
    )


@pytest.mark.parametrize(
    ("offsets", "start", "stop", "error", "message"),
    [
        ([0, 5, 9], [0, 1], [5, 5], sp.InvalidExample, r"example 1 .*range \[1, 5\) lies outside"),
        ([0, 5, 9], [0, 3], [5, 4], sp.InvalidExample, "at least 2"),
        ([0, 5, 20], [0, 0], [5, 15], sp.OversizedExample, "14 prediction pairs"),
        ([0, 5], [0, 0], [5, 5], sp.InvalidExample, "2 ranges need 3 offsets"),
        ([0, 5, 3], [0, 0], [5, 2], sp.InvalidExample, "offsets decrease"),
        ([[0, 5, 9]], [0, 0], [5, 4], sp.InvalidExample, "one-dimensional"),
    ],
)
def test_plans_from_ranges_refuse_bad_ranges_by_name(offsets, start, stop, error, message):
    ids = np.array([10, 11])
    with pytest.raises(error, match=message):
        sp.packing.plan_ranges(
            np.array(offsets),
            np.array(start),
            np.array(stop),
            ids,
            ids,
            sp.PackConfig(capacity=8, max_rows_per_batch=2),
        )


def _worked_compact() -> sp.CompactBatch:
    (compact,) = sp.pack_compact(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    )
    return compact


def test_compact_batch_carries_selected_tokens_in_order():
    compact = _worked_compact()
    assert compact.tokens.tolist() == A + B + C
    assert compact.nbytes == 12 * 4 + 3 * sp.OCCURRENCE_DTYPE.itemsize


def _tampered(field: str, index: int, value: int) -> sp.CompactBatch:
    compact = _worked_compact()
    occurrences = compact.occurrences.copy()
    occurrences[field][index] = value
    return sp.CompactBatch(
        tokens=compact.tokens,
        occurrences=occurrences,
        rows=compact.rows,
        capacity=compact.capacity,
        binding=compact.binding,
    )


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (lambda: _tampered("start", 1, 2), "start where the last ended"),
        (lambda: _tampered("stop", 2, 7), "columns out of range"),
        (lambda: _tampered("row", 2, 2), "no gap"),
        (lambda: _tampered("ordinal", 1, 0), "increase along each row"),
        (lambda: _tampered("segment", 1, 0), "segment must equal the ordinal"),
        (lambda: _tampered("range_stop", 0, 9), "range length"),
        (
            lambda: sp.CompactBatch(
                tokens=np.array([0, 999] + B + C, np.int32),
                occurrences=_worked_compact().occurrences[:2],
                rows=1,
                capacity=6,
                binding=BINDING,
            ),
            "token count",
        ),
        (
            lambda: sp.CompactBatch(
                tokens=np.array([0, 999, 100, 1] + B + C, np.int32),
                occurrences=_worked_compact().occurrences,
                rows=2,
                capacity=6,
                binding=BINDING,
            ),
            "outside the vocabulary",
        ),
        (
            lambda: sp.CompactBatch(
                tokens=_worked_compact().tokens,
                occurrences=_worked_compact().occurrences,
                rows=2,
                capacity=10**9,
                binding=BINDING,
            ),
            "rows x capacity <= 1000",
        ),
    ],
)
def test_a_compact_batch_from_elsewhere_is_checked_before_it_is_expanded(batch, message):
    with pytest.raises(sp.InvalidArray, match=message):
        batch().checked(max_cells=1000)


def test_compact_filler_expands_to_an_all_padding_batch():
    filler = sp.CompactBatch.filler_like(BINDING, rows=2, capacity=6).checked(max_cells=12)
    expanded = filler.expand()
    assert (
        expanded.filler and expanded.digest() == sp.PackedBatch.filler_like(BINDING, 2, 6).digest()
    )


def test_compact_packing_keeps_the_budget_but_needs_far_less_of_it_c8():
    examples = sp.Examples.from_documents([[1, 2, 3]] * 100)
    config = sp.PackConfig(capacity=64, max_rows_per_batch=2)
    full = sp.pack_examples(examples, BINDING, config).metadata_peak
    tight = sp.PackConfig(capacity=64, max_rows_per_batch=2, max_metadata_bytes=full - 1)
    with pytest.raises(sp.MetadataBudgetError):
        sp.pack_examples(examples, BINDING, tight)
    assert len(sp.pack_compact(examples, BINDING, tight)) == 2  # 4 bytes a token, not 23 a cell
    with pytest.raises(sp.MetadataBudgetError, match="max_metadata_bytes=1000"):
        sp.pack_compact(
            examples,
            BINDING,
            sp.PackConfig(capacity=64, max_rows_per_batch=2, max_metadata_bytes=1000),
        )


# -- the opt-in best-fit policy ----------------------------------------------------------

IMPLEMENTATIONS = {"compiled": compiled_pack, "reference": reference_pack}
implementations = pytest.mark.parametrize(
    "pack", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys()
)


def pairs(*lengths: int) -> sp.Examples:
    """Examples of these prediction lengths (documents one token longer)."""
    return sp.Examples.from_documents([[i + 1] * (n + 1) for i, n in enumerate(lengths)])


@implementations
def test_best_fit_docstring_picture(pack):
    config = sp.PackConfig(capacity=6, max_rows_per_batch=4, policy="best_fit", open_rows=2)
    (batch,) = pack(pairs(4, 4, 2, 1), BINDING, config)
    assert batch.segments.tolist() == [[0, 0, 0, 0, 2, 2], [1, 1, 1, 1, 3, -1]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0]]
    assert batch.segment_starts.tolist() == [[0, 0, 0, 0, 4, 4], [0, 0, 0, 0, 4, -1]]
    next_fit = pack(pairs(4, 4, 2, 1), BINDING, sp.PackConfig(capacity=6, max_rows_per_batch=4))
    assert next_fit[0].rows == 3


@implementations
@pytest.mark.parametrize(
    ("open_rows", "rows"),
    [
        # A(6) B(7) C(5) D(3) E(3), capacity 10. With 2 open rows, C fits neither, so the
        # fullest (B's, 3 left) closes and C opens row 2; D takes row 0 (4 left beats 5);
        # E goes to row 2, since B's row, where it would fit exactly, is closed.
        (2, [[0, 3], [1], [2, 4]]),
        # With 3 open rows nothing closes early: D fills B's row exactly (3 left beats 4
        # and 5), and E takes row 0.
        (3, [[0, 4], [1, 3], [2]]),
    ],
)
def test_best_fit_closes_the_fullest_row_at_the_open_row_bound(pack, open_rows, rows):
    config = sp.PackConfig(
        capacity=10, max_rows_per_batch=8, policy="best_fit", open_rows=open_rows
    )
    (batch,) = pack(pairs(6, 7, 5, 3, 3), BINDING, config)
    occ = batch.occurrences
    assert [occ["ordinal"][occ["row"] == r].tolist() for r in range(batch.rows)] == rows


@implementations
def test_best_fit_batches_cut_rows_in_opening_order_c2(pack):
    # Row 0 is still open when rows 1 and 2 open; batches take rows 0-1, then 2.
    config = sp.PackConfig(capacity=10, max_rows_per_batch=2, policy="best_fit", open_rows=3)
    batches = pack(pairs(6, 7, 8, 4, 3), BINDING, config)
    assert [b.rows for b in batches] == [2, 1]
    assert [b.occurrences["ordinal"].tolist() for b in batches] == [[0, 3, 1, 4], [2]]
    assert [b.valid_lengths.tolist() for b in batches] == [[10, 10], [8]]


@settings(max_examples=80, deadline=None)
@given(random_packing_case())
def test_best_fit_with_one_open_row_is_next_fit_c2(case):
    examples, binding, config = case
    want = compiled_pack(examples, binding, config)
    for pack in IMPLEMENTATIONS.values():
        got = pack(examples, binding, with_policy(config, "best_fit", 1))
        assert [b.digest() for b in got] == [b.digest() for b in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.occurrences, w.occurrences)


def test_best_fit_fills_more_of_the_benchmark_mix_than_next_fit():
    # The benchmark's length mix, capacity 2048, a few thousand documents.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.0, 3000), 2, 2049).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    examples = sp.Examples(
        tokens=np.ones(int(offsets[-1]), np.int32),
        offsets=offsets,
        doc=np.arange(3000),
        start=np.zeros(3000, np.int64),
        stop=lengths,
    )
    fill = {}
    for policy, open_rows in (("next_fit", None), ("best_fit", 64)):
        config = sp.PackConfig(
            capacity=2048, max_rows_per_batch=16, policy=policy, open_rows=open_rows
        )
        epoch = sp.pack_examples(examples, BINDING, config)
        fill[policy] = (lengths - 1).sum() / (epoch.row_count * 2048)
    assert fill["next_fit"] < 0.9 and fill["best_fit"] > 0.97


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"policy": "first_fit"}, r"policy='first_fit'; accepted: 'next_fit', 'best_fit'"),
        ({"open_rows": 4}, r"open_rows=4 with policy='next_fit'.*accepted: open_rows=1"),
        ({"policy": "best_fit", "open_rows": 0}, "open_rows must be a positive integer, got 0"),
        (
            {"policy": "best_fit", "open_rows": 5000},
            r"open_rows=5000 is too large; accepted: 1..4096",
        ),
    ],
)
def test_policy_settings_are_checked_once_with_what_is_accepted(fields, message):
    with pytest.raises(sp.InvalidConfig, match=message):
        sp.PackConfig(capacity=8, max_rows_per_batch=2, **fields)


def test_best_fit_defaults_to_16_open_rows_and_next_fit_to_one():
    assert sp.PackConfig(capacity=8, max_rows_per_batch=2, policy="best_fit").open_rows == 16
    assert sp.PackConfig(capacity=8, max_rows_per_batch=2).open_rows == 1
