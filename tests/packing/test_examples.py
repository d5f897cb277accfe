"""Bindings and columnar examples: every bad input is named (C1, C9)."""

from __future__ import annotations

import numpy as np
import pytest

import streampack as sp


def test_from_documents_concatenates_and_defaults_to_whole_documents():
    examples = sp.Examples.from_documents([[0, 1, 2], np.array([3, 4], np.uint16)])
    assert examples.tokens.tolist() == [0, 1, 2, 3, 4] and examples.tokens.dtype == np.int32
    assert examples.offsets.tolist() == [0, 3, 5]
    assert examples.start.tolist() == [0, 0] and examples.stop.tolist() == [3, 2]
    assert examples.prediction_lengths.tolist() == [2, 1]
    assert examples.example_tokens(1).tolist() == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ranges=[(0, 1)]), r"example 0 \(source_id 0, example_id 0\).*1 token.*at least 2"),
        (dict(ranges=[(2, 5)]), r"range \[2, 5\) lies outside its document of 3 tokens"),
        (dict(ranges=[(-1, 2)]), r"accepted: 0 <= start <= stop <= 3"),
    ],
)
def test_bad_ranges_are_named(kwargs, message):
    with pytest.raises(sp.InvalidExample, match=message):
        sp.Examples.from_documents([[0, 1, 2]], **kwargs)


def test_one_token_document_is_rejected_c1():
    with pytest.raises(sp.InvalidExample, match=r"example 1 .*has 1 token"):
        sp.Examples.from_documents([[0, 1], [5]])


def test_non_integer_tokens_are_rejected():
    with pytest.raises(sp.InvalidExample, match="document 0 must be a 1-D sequence of integers"):
        sp.Examples.from_documents([[0.5, 1.0]])
    with pytest.raises(sp.InvalidExample, match="tokens must hold integers, got dtype float64"):
        sp.Examples(tokens=np.array([0.0, 1.0]), offsets=[0, 2], doc=[0], start=[0], stop=[2])


def test_tokens_that_do_not_fit_int32_are_rejected():
    with pytest.raises(sp.InvalidExample, match="outside int32 range"):
        sp.Examples(
            tokens=np.array([0, 2**31], np.uint32), offsets=[0, 2], doc=[0], start=[0], stop=[2]
        )


def test_columns_must_agree_in_length():
    with pytest.raises(sp.InvalidExample, match="stop has 2 entries but doc has 1"):
        sp.Examples(tokens=[0, 1], offsets=[0, 2], doc=[0], start=[0], stop=[2, 2])


def test_unknown_document_is_named():
    with pytest.raises(sp.InvalidExample, match=r"doc=3 does not exist; accepted: 0\.\.0"):
        sp.Examples(tokens=[0, 1], offsets=[0, 2], doc=[3], start=[0], stop=[2])


def test_offsets_must_cover_the_tokens():
    with pytest.raises(sp.InvalidExample, match="last offset must equal len"):
        sp.Examples(tokens=[0, 1, 2], offsets=[0, 2], doc=[0], start=[0], stop=[2])
    with pytest.raises(sp.InvalidExample, match="offsets decrease at document 1: 4 -> 3"):
        sp.Examples(tokens=[0, 1, 2], offsets=[0, 4, 3], doc=[0], start=[0], stop=[2])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(partition="dev"), r"partition='dev'.*train, validation, test"),
        (dict(vocab_size=0), r"vocab_size=0 is out of range"),
        (dict(tokenizer=""), r"tokenizer must be a non-empty string"),
    ],
)
def test_binding_fields_are_checked_c9(kwargs, message):
    fields = dict(vocab_size=266, tokenizer="t", split_receipt="s", partition="train") | kwargs
    with pytest.raises(sp.InvalidConfig, match=message):
        sp.Binding(**fields)
