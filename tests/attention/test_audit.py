"""audit(): the packed-vs-separate check workers run on sampled batches."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from _decoder_cases import BINDING, worked_example

import streampack as sp
from streampack.auditing import AuditReport, audit
from streampack.decoder import DecoderConfig


def _long_batch() -> tuple[sp.Examples, sp.PackedBatch]:
    """Occurrences of 3 to 20 pairs in rows of 40: most are longer than max_positions."""
    rng = np.random.default_rng(11)
    documents = [rng.integers(0, 266, size=int(n)) for n in rng.integers(4, 22, size=12)]
    examples = sp.Examples.from_documents(documents)
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=40, max_rows_per_batch=8)
    ).batches
    return examples, batch


def test_worked_example_passes_with_counts():
    _, batch = worked_example()
    report = audit(batch)
    assert isinstance(report, AuditReport)
    assert report.passed, report.notes
    assert report.occurrences == 3 and report.cropped == 0
    # Eight distinct tokens (0, 1, 99..104) relabeled 0..7: the decoder's vocabulary.
    assert report.vocab_size == 8
    assert report.comparisons == 9 * 8 + 1 + DecoderConfig.small(8).parameter_count()
    assert report.max_logit_diff <= 1e-12 and report.max_grad_diff <= 1e-12
    full = audit(batch, compact_vocabulary=False)
    assert full.passed and full.vocab_size == 266 and full.comparisons == 9 * 266 + 1 + 1188
    large = audit(batch, config=DecoderConfig.large(), seed=42, compact_vocabulary=False)
    assert large.passed and large.comparisons == 2394 + 1 + 3448


def test_long_occurrences_are_cropped_for_the_audit_only():
    examples, batch = _long_batch()
    lengths = batch.occurrences["stop"] - batch.occurrences["start"]
    report = audit(batch)
    assert report.passed, report.notes
    assert report.cropped == int(np.count_nonzero(lengths > 4)) > 0
    assert report.max_positions == 4
    kept = np.minimum(lengths, 4)
    vocab = report.vocab_size
    assert (
        report.comparisons
        == int(kept.sum()) * vocab + 1 + DecoderConfig.small(vocab).parameter_count()
    )
    assert audit(batch, examples=examples).passed
    assert audit(batch, compact_vocabulary=False).passed
    assert audit(batch, config=DecoderConfig.large(), seed=3).passed


def _corrupt(batch: sp.PackedBatch, field: str, edit) -> sp.PackedBatch:
    array = getattr(batch, field).copy()
    edit(array)
    return dataclasses.replace(batch, **{field: array})


def _global_positions(positions):
    positions[0, :5] = np.arange(5)  # B continues at 3, 4 instead of restarting (C4)


def _causal_starts(starts):
    starts[0, 3:5] = 0  # B's queries may see A (C6)


def _shifted_targets(targets):
    targets[0, 3] = targets[0, 4]  # B's first target is its second one (C1)


def _dropped_target(mask):
    mask[1, 2] = False  # one of C's targets left out of the loss (C7)


def _short_valid_length(lengths):
    lengths[0] = 4  # B's last query made inactive


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("positions", _global_positions),
        ("segment_starts", _causal_starts),
        ("targets", _shifted_targets),
        ("loss_mask", _dropped_target),
        ("valid_lengths", _short_valid_length),
    ],
)
def test_audit_catches_a_broken_batch(field, edit):
    _, batch = worked_example()
    broken = _corrupt(batch, field, edit)
    report = audit(broken)
    assert not report.passed
    assert report.notes


def test_audit_with_examples_catches_wrong_tokens():
    examples, batch = worked_example()
    # C's 103 replaced by 200 as input and as target: the cells agree with each other,
    # so only the source tokens can tell.
    swapped = _corrupt(batch, "inputs", lambda a: a.__setitem__((1, 2), 200))
    swapped = _corrupt(swapped, "targets", lambda a: a.__setitem__((1, 1), 200))
    assert audit(swapped).passed
    assert not audit(swapped, examples=examples).passed  # but not C's tokens


def test_filler_batch_has_nothing_to_compare():
    report = audit(sp.PackedBatch.filler_like(BINDING, rows=2, capacity=6))
    assert report.passed and report.comparisons == 0 and report.notes


def test_audit_uses_the_batch_vocabulary():
    examples = sp.Examples.from_documents([[0, 999, 4, 1], [0, 7, 1]])
    binding = sp.Binding(1000, "big", "receipt", "validation")
    (batch,) = sp.pack_examples(
        examples, binding, sp.PackConfig(capacity=6, max_rows_per_batch=1)
    ).batches
    report = audit(batch, compact_vocabulary=False)
    assert report.passed and report.vocab_size == 1000
    assert report.comparisons == 5 * 1000 + 1 + DecoderConfig.small(1000).parameter_count()
    assert audit(batch).vocab_size == 5  # 0, 1, 4, 7 and 999


def test_out_of_vocabulary_token_fails_the_audit():
    _, batch = worked_example()
    broken = _corrupt(batch, "inputs", lambda a: a.__setitem__((0, 1), 266))
    report = audit(broken)
    assert not report.passed
    assert "token 266 is outside the vocabulary [0, 266)" in report.notes[0]


def test_cropped_rows_keep_the_batch_own_mistakes():
    """A leak inside the audited prefix of a later occurrence still shows after the
    rows are rebuilt from the cropped occurrences."""
    _, batch = _long_batch()
    occ = batch.occurrences
    later = occ[(occ["row"] == 0) & (occ["start"] > 0)][0]
    query = int(later["start"]) + 1  # second query of that occurrence: inside the prefix
    broken = _corrupt(batch, "segment_starts", lambda a: a.__setitem__((0, query), 0))
    report = audit(broken)
    assert report.cropped > 0 and not report.passed
    assert any(f"occurrence {int(later['ordinal'])}:" in note for note in report.notes)


def test_report_is_plain_data():
    _, batch = worked_example()
    report = audit(batch).as_dict()
    assert json.loads(json.dumps(report)) == report
    assert set(report) >= {"passed", "max_logit_diff", "max_grad_diff", "comparisons"}


# -- supervision masks (rule C5): the objective counts only the marked targets ------------

WORKED_MASKS = [[0, 0, 1, 1], [1, 0, 1], [0, 1, 0, 1, 1]]


def _masked_worked() -> tuple[sp.Examples, sp.PackedBatch]:
    examples = sp.Examples.from_documents(
        [[0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]], masks=WORKED_MASKS
    )
    config = sp.PackConfig(capacity=6, max_rows_per_batch=2)
    return examples, sp.pack_examples(examples, BINDING, config).batches[0]


def test_a_masked_batch_passes_scoring_only_its_marked_targets():
    examples, batch = _masked_worked()
    report = audit(batch, examples=examples)
    assert report.passed, report.notes
    # 6 of the 9 real targets are marked: 6 logit rows of the 8 relabeled tokens.
    assert report.comparisons == 6 * 8 + 1 + DecoderConfig.small(8).parameter_count()


def test_a_batch_that_ignored_the_mask_fails_the_audit_c5():
    examples, _ = _masked_worked()
    (ignored,) = sp.pack_examples(
        dataclasses.replace(examples, mask=None),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    ).batches
    report = audit(ignored, examples=examples)
    assert not report.passed
    assert (
        "occurrence 0: loss-eligible cells [0, 1, 2] but its targets are eligible at [1, 2]"
        in report.notes[0]
    )
    assert any("target counts differ: 9 vs 6" in note for note in report.notes)


def test_a_masked_batch_with_long_occurrences_is_audited_on_the_marked_prefix():
    rng = np.random.default_rng(5)
    documents = [rng.integers(0, 266, size=int(n)) for n in rng.integers(4, 22, size=12)]
    masks = [(rng.random(len(d)) < 0.6).astype(np.uint8) for d in documents]
    examples = sp.Examples.from_documents(documents, masks=masks)
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=40, max_rows_per_batch=8)
    ).batches
    assert audit(batch, examples=examples).passed
    assert audit(batch, examples=examples, config=DecoderConfig.large(), seed=3).passed
    assert not audit(batch).passed  # without its examples a batch is taken as unmasked


def test_the_equivalence_suite_scores_only_the_marked_targets_of_a_masked_batch_c5():
    from streampack.auditing import compare_executions
    from streampack.decoder import Decoder

    examples, batch = _masked_worked()
    decoder = Decoder.init(DecoderConfig.large(), 0)
    result = compare_executions(decoder, examples, batch)
    assert result.passed, (result.packed_vs_separate.notes, result.padded_vs_separate.notes)
    assert result.packed_vs_separate.logits == 6 * 266  # the 6 marked targets only
    (ignored,) = sp.pack_examples(
        dataclasses.replace(examples, mask=None),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    ).batches
    wrong = compare_executions(decoder, examples, ignored)
    assert not wrong.packed_vs_separate.passed
    assert "were scored (rule C5)" in " ".join(wrong.packed_vs_separate.notes)
