"""The reference decoder on its own: shapes, parameter inventory, errors, gradients."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _decoder_cases import (
    BINDING,
    one_numba_thread,  # noqa: F401 (a fixture)
    worked_decoder,
    worked_example,
)

import streampack as sp
from streampack.decoder import Decoder, DecoderConfig
from streampack.loss import token_loss


def test_parameter_counts_are_pinned():
    assert DecoderConfig.large().parameter_count() == 3448
    assert DecoderConfig.small().parameter_count() == 1188
    params = Decoder.init(DecoderConfig.large(), 42).parameters()
    assert sum(p.size for p in params.values()) == 3448
    assert list(params)[:3] == ["embedding", "layers.0.attn_norm", "layers.0.wq"]
    assert list(params)[-1] == "final_norm"
    assert params["layers.1.w_down"].shape == (16, 8)
    assert all(p.dtype == np.float64 for p in params.values())


def test_profiles_match_the_design():
    small, large = DecoderConfig.small(), DecoderConfig.large()
    assert (small.width, small.heads, small.ff_width, small.layers, small.max_positions) == (
        4,
        2,
        4,
        1,
        4,
    )
    assert (large.width, large.heads, large.ff_width, large.layers, large.max_positions) == (
        8,
        2,
        16,
        2,
        16,
    )
    assert small.vocab_size == large.vocab_size == 266


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"width": 0}, "width must be a positive integer, got 0"),
        ({"heads": 3}, "width=8 is not a multiple of heads=3"),
        ({"width": 6, "heads": 2}, "head_dim=3 .* is odd"),
        ({"layers": True}, "layers must be a positive integer, got True"),
    ],
)
def test_config_rejects_bad_fields(change, match):
    with pytest.raises(sp.InvalidConfig, match=match):
        dataclasses.replace(DecoderConfig.large(), **change)


def test_init_is_seeded_and_from_parameters_round_trips():
    config = DecoderConfig.small()
    a, b, c = Decoder.init(config, 7), Decoder.init(config, 7), Decoder.init(config, 8)
    for name, value in a.parameters().items():
        np.testing.assert_array_equal(value, b.parameters()[name])
    assert not np.array_equal(a.parameters()["embedding"], c.parameters()["embedding"])
    examples, batch = worked_example()
    rebuilt = Decoder.from_parameters(config, a.parameters())
    np.testing.assert_array_equal(rebuilt.forward_packed(batch), a.forward_packed(batch))


def test_from_parameters_names_what_is_wrong():
    config = DecoderConfig.small()
    params = Decoder.init(config, 0).parameters()
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(sp.InvalidConfig, match=r"missing \['final_norm'\]"):
        Decoder.from_parameters(config, missing)
    wrong_shape = r"'layers.0.wq' has shape \(4, 3\); accepted: \(4, 4\)"
    with pytest.raises(sp.InvalidConfig, match=wrong_shape):
        Decoder.from_parameters(config, params | {"layers.0.wq": np.zeros((4, 3))})
    with pytest.raises(sp.InvalidConfig, match="'embedding' holds non-finite"):
        bad = params["embedding"].copy()
        bad[3, 1] = np.nan
        Decoder.from_parameters(config, params | {"embedding": bad})


def test_packed_logits_are_nan_exactly_off_the_loss_mask():
    examples, batch = worked_example()
    logits = worked_decoder().forward_packed(batch)
    assert logits.shape == (2, 6, 266)
    nan_cells = np.isnan(logits).all(axis=2)
    np.testing.assert_array_equal(nan_cells, ~batch.loss_mask)
    assert np.isfinite(logits[batch.loss_mask]).all()


def test_packed_loss_sum_matches_the_library_loss():
    """The decoder's own NLL agrees with ``token_loss``, which skips the NaN cells."""
    examples, batch = worked_example()
    decoder = worked_decoder()
    result = decoder.loss_and_grad_packed(batch)
    library = token_loss(decoder.forward_packed(batch), batch)
    assert result.count == library.count == 9
    assert result.loss_sum == pytest.approx(library.sum, rel=1e-12)


def test_separate_and_padded_shapes():
    examples, _ = worked_example()
    decoder = worked_decoder()
    separate = decoder.forward_separate(examples)
    assert [s.shape for s in separate] == [(3, 266), (2, 266), (4, 266)]
    padded = decoder.forward_padded(examples)
    assert padded.shape == (3, 4, 266)
    assert np.isnan(padded[1, 2:]).all() and np.isnan(padded[0, 3:]).all()
    assert np.isfinite(padded[2]).all()


def test_worked_example_loss_sums_are_pinned():
    examples, batch = worked_example()
    decoder = worked_decoder()
    sums = [
        decoder.loss_and_grad_separate(examples).loss_sum,
        decoder.loss_and_grad_padded(examples).loss_sum,
        decoder.loss_and_grad_packed(batch).loss_sum,
    ]
    assert sums == pytest.approx([57.736658] * 3, abs=5e-7)


def test_examples_longer_than_max_positions_are_named():
    decoder = Decoder.init(DecoderConfig.small(), 0)
    examples = sp.Examples.from_documents([[5, 6, 7], [1, 2, 3, 4, 5, 6]], example_ids=[10, 11])
    for run in (decoder.forward_separate, decoder.forward_padded, decoder.loss_and_grad_separate):
        too_long = r"example 1 .*example_id 11.* length 5.*max_positions=4"
        with pytest.raises(sp.InvalidExample, match=too_long):
            run(examples)
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=8, max_rows_per_batch=2)
    ).batches
    with pytest.raises(sp.InvalidExample, match=r"occurrence 1 \(example_id 11\).* length 5"):
        decoder.forward_packed(batch)


def test_vocabulary_mismatch_is_a_binding_error():
    _, batch = worked_example()
    decoder = Decoder.init(dataclasses.replace(DecoderConfig.small(), vocab_size=300), 0)
    with pytest.raises(sp.BindingMismatch, match="batch vocabulary size 266 .* vocab_size=300"):
        decoder.forward_packed(batch)
    out_of_vocab = sp.Examples.from_documents([[0, 270, 1]])
    with pytest.raises(sp.InvalidExample, match="token 270, outside the decoder vocabulary"):
        Decoder.init(DecoderConfig.small(), 0).forward_separate(out_of_vocab)


def _loss(decoder: Decoder, params: dict[str, np.ndarray], batch: sp.PackedBatch) -> float:
    """Forward only: the library's token loss over the decoder's packed logits."""
    logits = Decoder.from_parameters(decoder.config, params).forward_packed(batch)
    return token_loss(logits, batch).sum


def _finite_difference_check(decoder: Decoder, batch: sp.PackedBatch, pick) -> int:
    analytic = decoder.loss_and_grad_packed(batch).grads
    params = decoder.parameters()
    step = 1e-5
    checked = 0
    for name, value in params.items():
        for index in pick(name, value):
            up = params | {name: value.copy()}
            up[name][index] += step
            down = params | {name: value.copy()}
            down[name][index] -= step
            numeric = (_loss(decoder, up, batch) - _loss(decoder, down, batch)) / (2 * step)
            exact = analytic[name][index]
            assert abs(numeric - exact) <= 1e-6 + 1e-5 * abs(exact), (name, index, numeric, exact)
            checked += 1
    return checked


def _two_example_batch(config: DecoderConfig) -> sp.PackedBatch:
    """Two examples sharing row 0, a third alone in row 1 with padding after it."""
    examples = sp.Examples.from_documents([[3, 9, 17, 4], [8, 2, 250], [11, 12, 13, 14, 15]])
    capacity = 5
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=capacity, max_rows_per_batch=2)
    ).batches
    assert batch.occurrences["row"].tolist() == [0, 0, 1]
    return batch


@pytest.mark.usefixtures("one_numba_thread")
def test_finite_differences_small_profile():
    """Every coordinate but the embedding rows of tokens the batch never reads, of which
    a seeded sample of 12 stands in (they meet the loss through the tied output only)."""
    decoder = Decoder.init(DecoderConfig.small(), 3)
    batch = _two_example_batch(decoder.config)
    read = set(batch.inputs[batch.input_valid].tolist())
    unread = sorted(set(range(266)) - read)
    sample = set(np.random.default_rng(1).choice(unread, size=12, replace=False).tolist())

    def pick(name, value):
        every = list(np.ndindex(value.shape))
        if name != "embedding":
            return every
        return [i for i in every if i[0] in read or i[0] in sample]

    checked = _finite_difference_check(decoder, batch, pick)
    assert checked == 1188 - (266 - len(read) - 12) * 4


@pytest.mark.usefixtures("one_numba_thread")
def test_finite_differences_large_profile_sampled():
    """Two layers: the residual path through both blocks, on a sample of coordinates."""
    decoder = Decoder.init(DecoderConfig.large(), 5)
    batch = _two_example_batch(decoder.config)
    rng = np.random.default_rng(0)

    def pick(name, value):
        everything = list(np.ndindex(value.shape))
        chosen = rng.choice(len(everything), size=min(6, len(everything)), replace=False)
        return [everything[i] for i in chosen]

    assert _finite_difference_check(decoder, batch, pick) == 6 * 20
