"""packed = separate = padded: logits, loss and every parameter gradient (rules C1-C7).

For each decoder profile and 100 fixed seeds, random examples (whole documents,
interior ranges, repeated occurrences of one example) are packed with a random
capacity and row limit; every batch is then run separately, padded and packed and
compared value by value with ``|a-b| <= 1e-10 + 1e-9*max(|a|,|b|)``. Run with ``-s``
to see the number of comparisons and the largest differences.
"""

from __future__ import annotations

import numpy as np
import pytest
from _decoder_cases import (
    PROFILES,
    one_numba_thread,  # noqa: F401 (a fixture)
    random_case,
    worked_decoder,
    worked_example,
)

import streampack as sp
from streampack.auditing import compare_executions
from streampack.decoder import Decoder
from streampack.trace import decoder_trace

SEEDS = range(100)


def _leak_is_visible(batch: sp.PackedBatch) -> bool:
    """Some row holds two occurrences with different inputs.

    Two repeats of one single-pair example in a row are the exception: widening the
    second one's range only adds a copy of its own key and value, which leaves its
    softmax unchanged, so no mask could be told apart there.
    """
    for row in range(batch.rows):
        mine = batch.occurrences[batch.occurrences["row"] == row]
        contents = {tuple(batch.inputs[row, o["start"] : o["stop"]].tolist()) for o in mine}
        if len(contents) > 1:
            return True
    return False


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.usefixtures("one_numba_thread")
def test_packed_separate_padded_agree_over_100_seeds(profile):
    config = PROFILES[profile]
    totals = {"batches": 0, "occurrences": 0, "logits": 0, "losses": 0, "gradients": 0}
    largest = {"logits": 0.0, "loss": 0.0, "gradients": 0.0}
    coverage = {"repeated": 0, "interior": 0, "multi_batch": 0, "leak_detected": 0}
    for seed in SEEDS:
        examples, pack_config = random_case(seed, config)
        decoder = Decoder.init(config, seed)
        binding = sp.Binding(config.vocab_size, "random", f"seed-{seed}", "train")
        batches = sp.pack_examples(examples, binding, pack_config).batches
        pairs = set(zip(examples.doc.tolist(), examples.start.tolist(), examples.stop.tolist()))
        coverage["repeated"] += len(pairs) < len(examples)
        lengths = examples.offsets[examples.doc + 1] - examples.offsets[examples.doc]
        coverage["interior"] += bool(np.any((examples.start > 0) | (examples.stop < lengths)))
        coverage["multi_batch"] += len(batches) > 1
        for batch in batches:
            leak_visible = _leak_is_visible(batch)
            result = compare_executions(decoder, examples, batch, _with_causal_prefix=leak_visible)
            for comparison in (result.packed_vs_separate, result.padded_vs_separate):
                assert comparison.passed, (profile, seed, comparison.notes)
                totals["logits"] += comparison.logits
                totals["losses"] += 1
                totals["gradients"] += comparison.gradient_coordinates
                largest["logits"] = max(largest["logits"], comparison.max_logit_diff)
                largest["loss"] = max(largest["loss"], comparison.max_loss_diff)
                largest["gradients"] = max(largest["gradients"], comparison.max_grad_diff)
            totals["batches"] += 1
            totals["occurrences"] += len(batch.occurrences)
            if leak_visible:
                # The guard is load-bearing: an ordinary causal mask must break this batch.
                assert not result.causal_prefix_vs_separate.passed, (profile, seed)
                coverage["leak_detected"] += 1
    print(
        f"\n[{profile}] {len(SEEDS)} seeds, {totals['batches']} batches, "
        f"{totals['occurrences']} occurrences: {totals['logits']} logit, "
        f"{totals['losses']} loss and {totals['gradients']} gradient comparisons; "
        f"max |diff| logits {largest['logits']:.3e}, loss {largest['loss']:.3e}, "
        f"gradients {largest['gradients']:.3e}; widened ranges broke "
        f"{coverage['leak_detected']} shared-row batches"
    )
    # The random cases really exercise what they claim to.
    assert coverage["repeated"] >= 10
    assert coverage["interior"] >= 50
    assert coverage["multi_batch"] >= 10
    assert coverage["leak_detected"] >= 30


def test_worked_example_three_way_counts():
    examples, batch = worked_example()
    result = compare_executions(worked_decoder(), examples, batch)
    assert result.passed
    sums = result.loss_sums
    assert sums["separate"] == pytest.approx(57.736658, abs=5e-7)
    assert abs(sums["packed"] - sums["separate"]) <= 1e-10 + 1e-9 * abs(sums["separate"])
    assert abs(sums["padded"] - sums["separate"]) <= 1e-10 + 1e-9 * abs(sums["separate"])
    for comparison in (result.packed_vs_separate, result.padded_vs_separate):
        assert comparison.logits == 9 * 266 == 2394
        assert comparison.gradient_coordinates == 3448
    print(
        f"\n[worked example] loss sums {sums}; max |diff| packed: "
        f"{result.packed_vs_separate.max_logit_diff:.3e} logits, "
        f"{result.packed_vs_separate.max_grad_diff:.3e} gradients"
    )


def test_worked_example_breaks_under_a_causal_mask():
    examples, batch = worked_example()
    result = compare_executions(worked_decoder(), examples, batch, _with_causal_prefix=True)
    assert result.passed
    leaky = result.causal_prefix_vs_separate
    assert not leaky.passed
    assert leaky.logits == 2394  # only B's logits move: A comes first in its row, C is alone
    assert any(note.startswith("occurrence 1:") for note in leaky.notes)
    assert not any(note.startswith(("occurrence 0:", "occurrence 2:")) for note in leaky.notes)
    sums = result.loss_sums
    assert sums["packed_causal_prefix"] != pytest.approx(sums["separate"], abs=1e-6)


def test_decoder_trace_section():
    examples, batch = worked_example()
    section = decoder_trace(examples, batch)
    assert section["passed"] is True
    assert section["profile"]["parameters"] == 3448
    assert section["profile"]["seed"] == 42
    assert section["loss_sums"] == {"separate": 57.736658, "padded": 57.736658, "packed": 57.736658}
    assert section["targets"] == 9
    assert section["comparisons"] == {
        "logits_per_comparison": 2394,
        "gradient_coordinates_per_comparison": 3448,
        "logits_total": 4788,
        "gradient_coordinates_total": 6896,
    }
    for diffs in section["max_abs_diff"].values():
        assert diffs == {"logits": 0.0, "loss": 0.0, "gradients": 0.0}  # rounded to 1e-12
    assert section["attention_counts"] == {
        "cells": 12,
        "valid_cells": 9,
        "dense_score_positions_per_head": 72,
        "permitted_edges": 19,
        "valid_density": 0.75,
        "edge_density": 0.263889,
    }
