"""Isolation: nothing of A (or padding, or the future) reaches B, at any layer or head.

The worked example's row 0 holds A in columns 0..2, B in 3..4 and padding in 5. The
tests hold B's inputs and a B-only objective fixed, perturb A, and check that B's
logits, its loss and every parameter gradient stay put while the derivatives flowing
into A's and the padding's activations are exactly zero. Each check is repeated with
the packed run's ranges widened to the whole causal prefix of the row (an ordinary
causal mask) and must then fail: the range guard, not luck, keeps the examples apart.

Last, the permitted edge inventory is the same whether visited query by query, tile
by tile over the dense grid, or the way the CPU kernel walks its blocks, for tiles of
width 2 and the kernels' real tile sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
from _decoder_cases import (
    A_COLUMNS,
    B_COLUMNS,
    BINDING,
    PROFILES,
    ROW0_PADDING,
    random_case,
    worked_decoder,
    worked_example,
)

import streampack as sp
from streampack.auditing import _max_diff_and_failures

NOT_B = A_COLUMNS + ROW0_PADDING


def _b_only_cells(decoder, batch, columns=B_COLUMNS):
    cells = decoder.cells_from_batch(batch)
    cells.eligible = np.zeros_like(cells.eligible)
    cells.eligible[0, columns] = True
    return cells


def _perturbed(cells, decoder, seed):
    """A's input tokens replaced and noise added to A's residual stream at every layer."""
    rng = np.random.default_rng(seed)
    changed = type(cells)(**vars(cells))
    changed.inputs = cells.inputs.copy()
    changed.inputs[0, A_COLUMNS] = rng.integers(2, 266, size=len(A_COLUMNS))
    perturb = {}
    for layer in range(decoder.config.layers + 1):
        delta = np.zeros(cells.inputs.shape + (decoder.config.width,))
        delta[0, A_COLUMNS] = rng.normal(0.0, 3.0, size=(len(A_COLUMNS), decoder.config.width))
        perturb[layer] = delta
    return changed, perturb


def _within(a, b) -> bool:
    return _max_diff_and_failures(a, b)[1] == 0


def _run(decoder, cells, **forward):
    loss, count, back, trace = decoder.loss_and_backward(cells, **forward)
    return loss, back, trace


@pytest.mark.parametrize("widen", [False, True], ids=["range_guard", "causal_prefix"])
def test_perturbing_a_leaves_b_untouched(widen):
    """Rule C6 seen from the model: B's results cannot depend on A."""
    decoder = worked_decoder()
    _, batch = worked_example()
    cells = _b_only_cells(decoder, batch)
    changed, perturb = _perturbed(cells, decoder, seed=1)
    base_loss, base_back, base_trace = _run(decoder, cells, causal_prefix=widen)
    loss, back, trace = _run(decoder, changed, causal_prefix=widen, perturb=perturb)

    b_logits_same = _within(trace.logits, base_trace.logits)
    loss_same = _within(np.array(loss), np.array(base_loss))
    grads_same = all(_within(back.grads[n], base_back.grads[n]) for n in back.grads)
    # Exact zeros: every residual stream (embedding output and each block's input) and
    # every attention input, in A's and the padding's columns, and all of row 1 (C).
    zero_into_others = all(
        not np.any(r[0, NOT_B]) and not np.any(r[1]) for r in back.residual
    ) and all(
        not np.any(grad[0, :, NOT_B]) and not np.any(grad[1])
        for layer in back.attention
        for grad in (layer["dk"], layer["dv"])
    )
    assert trace.logits.shape == (2, 266)
    assert np.any(back.residual[0][0, B_COLUMNS])  # B itself does receive gradient
    if not widen:
        assert b_logits_same and loss_same and grads_same and zero_into_others
    else:
        # An ordinary causal mask lets A into B: every one of these must break.
        assert not b_logits_same
        assert not loss_same
        assert not grads_same
        assert not zero_into_others


def test_b_first_query_sees_no_future_no_padding_no_a():
    """d(loss at B's first query) / d(activations) is exactly zero at columns 4 and 5
    (B's future, padding) and at A's columns, for every layer's residual and k, v."""
    decoder = worked_decoder()
    _, batch = worked_example()
    first = B_COLUMNS[0]
    cells = _b_only_cells(decoder, batch, columns=[first])
    _, back, _ = _run(decoder, cells)
    elsewhere = [c for c in range(6) if c != first]
    for residual in back.residual:
        assert not np.any(residual[0, elsewhere])
        assert np.any(residual[0, first])
    for layer in back.attention:
        for name in ("dq", "dk", "dv"):
            assert not np.any(layer[name][0, :, elsewhere]), name
    # With the prefix widened, A's columns start to receive gradient; the future and
    # padding still do not (that part is causality, which both masks keep).
    _, widened, _ = _run(decoder, cells, causal_prefix=True)
    assert any(np.any(r[0, A_COLUMNS]) for r in widened.residual)
    assert not any(np.any(r[0, [4, 5]]) for r in widened.residual)


@pytest.mark.parametrize("layer", [0, 1])
def test_every_layer_and_head_keeps_the_boundary(layer):
    """Per attention call: with the guard, B's keys and values are the only ones a B-only
    objective reaches, head by head; widening this one layer alone already leaks."""
    decoder = worked_decoder()
    assert decoder.config.layers == 2
    _, batch = worked_example()
    cells = _b_only_cells(decoder, batch)
    changed, perturb = _perturbed(cells, decoder, seed=2)
    base_loss, back, base_trace = _run(decoder, cells)
    for head in range(decoder.config.heads):
        for name in ("dq", "dk", "dv"):
            grad = back.attention[layer][name]
            assert not np.any(grad[0, head, NOT_B]), (layer, head, name)
            assert np.any(grad[0, head, B_COLUMNS]), (layer, head, name)
    # B's attention output at this layer is unchanged by A's perturbation, per head.
    _, _, trace = _run(decoder, changed, perturb=perturb)
    for head in range(decoder.config.heads):
        assert _within(
            trace.layers[layer]["out"][0, head, B_COLUMNS],
            base_trace.layers[layer]["out"][0, head, B_COLUMNS],
        )
    _, leaky_back, leaky = _run(decoder, cells, causal_prefix=frozenset({layer}))
    assert not _within(leaky.logits, base_trace.logits)
    assert any(
        np.any(leaky_back.attention[layer][name][0, head, A_COLUMNS])
        for head in range(decoder.config.heads)
        for name in ("dk", "dv")
    )


# ---------------------------------------------------------------------------------------
# Tile traversal: the order of visiting edges does not change which edges exist
# ---------------------------------------------------------------------------------------


def _query_inventory(batch):
    """Every permitted (row, query, key), query by query, by the full rule (C6)."""
    return [
        (r, q, k)
        for r in range(batch.rows)
        for q in range(batch.capacity)
        for k in range(batch.capacity)
        if batch.allowed_key(r, q, k)
    ]


def _grid_inventory(batch, tile_q, tile_k):
    """The same rule visited tile by tile over the dense [capacity, capacity] grid."""
    cap = batch.capacity
    return [
        (r, q, k)
        for r in range(batch.rows)
        for q0 in range(0, cap, tile_q)
        for k0 in range(0, cap, tile_k)
        for q in range(q0, min(q0 + tile_q, cap))
        for k in range(k0, min(k0 + tile_k, cap))
        if batch.allowed_key(r, q, k)
    ]


def _cpu_kernel_inventory(batch, tile_q, tile_k):
    """The CPU kernel's own traversal: query tiles cut into blocks at segment starts by
    its compiled ``_next_block``, keys ``[lowest, b)`` in chunks of ``tile_k``, and the
    per-element window ``[lo, hi)`` its softmax loop reads."""
    from streampack.kernels.attention_plan import next_block as _next_block

    starts = np.ascontiguousarray(batch.segment_starts, np.int32)
    valid = batch.valid_lengths
    edges = []
    for r in range(batch.rows):
        for q0 in range(0, batch.capacity, tile_q):
            q1 = min(q0 + tile_q, int(valid[r]))
            a = q0
            while a < q1:
                b, lowest = _next_block(starts[r], a, q1, tile_q)
                for k0 in range(lowest, b, tile_k):
                    nk = min(k0 + tile_k, b) - k0
                    for q in range(a, b):
                        lo, hi = max(starts[r, q] - k0, 0), min(q - k0 + 1, nk)
                        edges += [(r, q, k0 + j) for j in range(lo, hi)]
                a = b
    return edges


def _wide_batch():
    """Rows of 150 with segments up to 70 long: real 64-query tiles cross segment starts."""
    rng = np.random.default_rng(5)
    documents = [rng.integers(0, 266, size=int(n)) for n in rng.integers(2, 72, size=12)]
    examples = sp.Examples.from_documents(documents)
    config = sp.PackConfig(capacity=150, max_rows_per_batch=8)
    return sp.pack_examples(examples, BINDING, config).batches[0]


def _traversal_batches():
    batches = [worked_example()[1], _wide_batch()]
    for profile in PROFILES.values():
        for seed in range(5):
            examples, pack_config = random_case(seed, profile)
            binding = sp.Binding(profile.vocab_size, "random", f"seed-{seed}", "train")
            batches += sp.pack_examples(examples, binding, pack_config).batches
    return batches


def test_tile_traversal_visits_the_same_edges_as_query_order():
    from streampack.kernels import attention_cpu, attention_cuda

    tilings = {(2, 2), (3, 2)}
    for head_dim in {p.head_dim for p in PROFILES.values()}:
        tilings.add((attention_cpu.TILE_Q, attention_cpu.key_tile(head_dim)))
        tilings.add((attention_cuda.TILE_Q, attention_cuda.key_tile(head_dim, 8)))
    for batch in _traversal_batches():
        by_query = _query_inventory(batch)
        assert len(by_query) == batch.stats()["permitted_edges"]
        for tile_q, tile_k in sorted(tilings):
            assert sorted(_grid_inventory(batch, tile_q, tile_k)) == by_query
            by_kernel = _cpu_kernel_inventory(batch, tile_q, tile_k)
            assert len(by_kernel) == len(set(by_kernel)), "an edge was visited twice"
            assert sorted(by_kernel) == by_query, (tile_q, tile_k)
