"""Token-weighted objective and the constructed-logit probe (rule C7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _packing_cases import BINDING, A, B, C

import streampack as sp

LN2 = math.log(2)


@pytest.fixture(scope="module")
def batch() -> sp.PackedBatch:
    return sp.pack_examples(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    ).batches[0]


def probe(batch):
    q = np.where(batch.segments == 1, 0.25, 0.5)
    return sp.probe_logits(batch, q)


def test_probe_gives_eleven_ln2_over_nine_targets_c7(batch):
    result = sp.token_loss(probe(batch), batch)
    assert result.count == 9
    assert result.sum == pytest.approx(11 * LN2, abs=1e-12)
    assert result.mean == pytest.approx(11 / 9 * LN2, abs=1e-12)
    assert round(result.mean, 6) == 0.847180


def test_wrong_weightings_differ_from_the_token_mean(batch):
    logits = probe(batch)
    assert sp.row_mean(logits, batch) == pytest.approx(6 / 5 * LN2, abs=1e-12)
    assert sp.document_mean(logits, batch) == pytest.approx(4 / 3 * LN2, abs=1e-12)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_ineligible_cells_cannot_leak_into_loss_or_gradient_c7(batch, poison):
    clean = probe(batch)
    dirty = clean.copy()
    dirty[~batch.loss_mask] = poison
    assert sp.token_loss(dirty, batch) == sp.token_loss(clean, batch)
    grad = sp.loss_gradient(dirty, batch)
    np.testing.assert_array_equal(grad, sp.loss_gradient(clean, batch))
    assert np.isfinite(grad).all() and (grad[~batch.loss_mask] == 0).all()


def test_gradient_is_p_minus_onehot_over_n_c7(batch):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 266))
    grad = sp.loss_gradient(logits, batch)
    cell = (0, 3)
    p = np.exp(logits[cell] - logits[cell].max())
    p /= p.sum()
    p[batch.targets[cell]] -= 1
    np.testing.assert_allclose(grad[cell], p / 9, rtol=1e-12, atol=1e-15)


def test_gradient_matches_finite_differences(batch):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 6, 266))
    grad = sp.loss_gradient(logits, batch)
    h = 1e-6
    for cell in [(0, 0, 99), (0, 4, 1), (1, 2, 5), (1, 3, 1), (0, 5, 7)]:
        up, down = logits.copy(), logits.copy()
        up[cell] += h
        down[cell] -= h
        numeric = (sp.token_loss(up, batch).mean - sp.token_loss(down, batch).mean) / (2 * h)
        assert grad[cell] == pytest.approx(numeric, abs=1e-8)


def test_zero_eligible_targets_is_an_error_c7():
    filler = sp.PackedBatch.filler_like(BINDING, rows=1, capacity=4)
    with pytest.raises(sp.EmptyObjective, match="0 loss-eligible targets"):
        sp.token_loss(np.zeros((1, 4, 266)), filler)


def test_logits_of_the_wrong_shape_are_named(batch):
    with pytest.raises(sp.InvalidArray, match=r"shape \(2, 6, 10\).*\(2, 6, 266\)"):
        sp.token_loss(np.zeros((2, 6, 10)), batch)


@pytest.mark.parametrize("q", [0.0, 1.0, 1.5])
def test_probe_rejects_probabilities_outside_zero_one(batch, q):
    with pytest.raises(sp.InvalidArray, match="accepted: 0 < q < 1"):
        sp.probe_logits(batch, q)
