"""The mixture schedule: smooth weighted round-robin, epoch lengths, per-source orders.

Every fast function is compared with a plain-Python reference written here: the
round-robin stepped one pick at a time, and an epoch walked pick by pick.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streampack.corpus.long_documents import split_ranges
from streampack.corpus.order import MixtureOrder, source_permutation
from streampack.corpus.schedule import Schedule, integer_weights
from streampack.errors import InvalidConfig


def reference_picks(weights, steps):
    """Smooth weighted round-robin, one step at a time, integer weights."""
    credit = [0] * len(weights)
    out = []
    for _ in range(steps):
        credit = [c + w for c, w in zip(credit, weights)]
        pick = max(range(len(weights)), key=lambda k: (credit[k], -k))
        credit[pick] -= sum(weights)
        out.append(pick)
    return out


def reference_epoch(weights, sizes, stopping, shuffle=False, seed=0, epoch=0):
    """Walk an epoch pick by pick: (source, document) per step."""
    reduced = integer_weights(weights)
    taken = [0] * len(sizes)
    exhausted = [False] * len(sizes)
    out = []
    for source in reference_picks(reduced, 10 * sum(sizes) * sum(reduced) + 10):
        n = taken[source]
        if n and n % sizes[source] == 0 or sizes[source] == 0:
            exhausted[source] = True
            if stopping == "first_exhausted" or all(exhausted):
                return out
        cycle, within = divmod(n, sizes[source])
        order = (
            source_permutation(sizes[source], seed, epoch, source, cycle)
            if shuffle
            else np.arange(sizes[source])
        )
        out.append((source, int(order[within])))
        taken[source] += 1
    raise AssertionError("the reference epoch did not end")


def epoch_order(schedule, sizes, stopping, *, shuffle, seed, epoch):
    """A whole epoch of ``MixtureOrder`` as ``(source, document within it)`` arrays."""
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    order = MixtureOrder(schedule, sizes, stopping, first, shuffle=shuffle, seed=seed, epoch=epoch)
    ids = order[0 : len(order)]
    source = np.searchsorted(first, ids, side="right") - 1
    return source, ids - first[source]


def test_three_to_one_repeats_a_a_b_a():
    schedule = Schedule.of([3, 1])
    assert schedule.pattern.tolist() == [0, 0, 1, 0]
    source, pick = schedule.picks(0, 9)
    assert source.tolist() == [0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert pick.tolist() == [0, 1, 0, 2, 3, 4, 1, 5, 6]


@pytest.mark.parametrize(
    ("weights", "ratios"),
    [
        ([3, 1], (3, 1)),
        ([0.75, 0.25], (3, 1)),
        ([0.7, 0.3], (7, 3)),
        ([0.1, 0.2], (1, 2)),
        ([2, 4, 6], (1, 2, 3)),
        ([5], (1,)),
    ],
)
def test_weights_become_the_exact_decimal_ratios(weights, ratios):
    assert integer_weights(weights) == ratios


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([], "at least one source"),
        ([1, 0], "source 1: weight 0 must be a positive"),
        ([1, -2.5], "weight -2.5"),
        ([1, float("nan")], "weight nan"),
        ([True], "weight True"),
        ([1, "2"], "weight '2'"),
        ([0.123457, 1], "period of 1123457 steps; at most 1048576"),
    ],
)
def test_bad_weights_are_refused_naming_them(weights, match):
    with pytest.raises(InvalidConfig, match=match):
        integer_weights(weights)


weights_st = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, lo=st.integers(0, 50), span=st.integers(0, 60))
def test_picks_are_the_step_by_step_round_robin(weights, lo, span):
    schedule = Schedule.of(weights)
    want = reference_picks(schedule.weights, lo + span)
    source, pick = schedule.picks(lo, lo + span)
    assert source.tolist() == want[lo:]
    assert pick.tolist() == [want[:t].count(want[t]) for t in range(lo, lo + span)]
    for t in range(lo, lo + span):
        assert schedule.step_of_pick(want[t], want[:t].count(want[t])) == t


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, steps=st.integers(1, 200))
def test_every_prefix_holds_each_source_within_one_of_its_share(weights, steps):
    schedule = Schedule.of(weights)
    source, _ = schedule.picks(0, steps)
    total = sum(schedule.weights)
    for k, w in enumerate(schedule.weights):
        counts = np.cumsum(source == k)
        share = np.arange(1, steps + 1) * w / total
        assert np.all(np.abs(counts - share) < 1)


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    stopping=st.sampled_from(["first_exhausted", "all_exhausted"]),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 2),
)
def test_epoch_order_is_the_pick_by_pick_walk(data, stopping, shuffle, seed, epoch):
    weights = data.draw(weights_st)
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=len(weights), max_size=len(weights)))
    source, document = epoch_order(
        Schedule.of(weights), sizes, stopping, shuffle=shuffle, seed=seed, epoch=epoch
    )
    want = reference_epoch(weights, sizes, stopping, shuffle, seed, epoch)
    assert list(zip(source.tolist(), document.tolist())) == want
    per_source = [document[source == k].tolist() for k in range(len(sizes))]
    if stopping == "first_exhausted":  # nothing repeats; one source is used up
        assert all(len(set(d)) == len(d) for d in per_source)
        assert any(len(d) == n for d, n in zip(per_source, sizes))
    else:  # every document of every source appears
        assert all(set(d) == set(range(n)) for d, n in zip(per_source, sizes))


def test_three_to_one_epochs_over_sources_of_30_and_20_documents():
    """A 3:1 mixture: first_exhausted stops when A (30) runs out, after 10 of B;
    all_exhausted runs until B's 20 are all seen, cycling A."""
    schedule = Schedule.of([3, 1])
    assert schedule.epoch_length([30, 20], "first_exhausted") == 40
    assert schedule.epoch_length([30, 20], "all_exhausted") == 82
    source, _ = epoch_order(schedule, [30, 20], "first_exhausted", shuffle=True, seed=1, epoch=0)
    assert np.bincount(source).tolist() == [30, 10]
    source, document = epoch_order(
        schedule, [30, 20], "all_exhausted", shuffle=True, seed=1, epoch=0
    )
    assert np.bincount(source).tolist() == [62, 20]


def test_orders_depend_on_seed_and_epoch_only():
    schedule = Schedule.of([2, 1])
    a = epoch_order(schedule, [10, 10], "first_exhausted", shuffle=True, seed=5, epoch=1)
    b = epoch_order(schedule, [10, 10], "first_exhausted", shuffle=True, seed=5, epoch=1)
    c = epoch_order(schedule, [10, 10], "first_exhausted", shuffle=True, seed=5, epoch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize(
    ("start", "stop", "limit", "pieces", "cut"),
    [
        ([0], [10], 4, [(0, 0, 4), (0, 4, 8), (0, 8, 10)], [2]),  # the docstring's picture
        ([0], [9], 4, [(0, 0, 4), (0, 4, 8)], [2]),  # a last single token: no range, one pair
        ([0], [12], 4, [(0, 0, 4), (0, 4, 8), (0, 8, 12)], [2]),  # exact: two cuts
        ([0, 3], [4, 11], 4, [(0, 0, 4), (1, 3, 7), (1, 7, 11)], [0, 1]),
        ([2], [2], 4, [], [0]),
    ],
)
def test_split_ranges_cuts_consecutive_ranges_of_at_most_limit(start, stop, limit, pieces, cut):
    owner, lo, hi, pairs_cut = split_ranges(np.array(start), np.array(stop), limit)
    assert list(zip(owner.tolist(), lo.tolist(), hi.tolist())) == pieces
    assert pairs_cut.tolist() == cut


@settings(max_examples=100, deadline=None)
@given(span=st.integers(0, 60), start=st.integers(0, 5), limit=st.integers(2, 9))
def test_split_keeps_every_pair_but_one_per_cut(span, start, limit):
    owner, lo, hi, pairs_cut = split_ranges(np.array([start]), np.array([start + span]), limit)
    kept = {(t, t + 1) for a, b in zip(lo.tolist(), hi.tolist()) for t in range(a, b - 1)}
    every = {(t, t + 1) for t in range(start, start + span - 1)}
    assert kept <= every and np.all(hi - lo <= limit) and np.all(hi - lo >= 2)
    assert len(every - kept) == pairs_cut[0] == max(0, -(-span // limit) - 1)
    assert np.all(lo[1:] == hi[:-1])  # consecutive
