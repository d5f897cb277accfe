"""PackConfig is checked once, in __post_init__, and every message names the field."""

from __future__ import annotations

import dataclasses

import pytest

import streampack as sp


def test_max_cells_defaults_to_a_full_batch():
    assert sp.PackConfig(capacity=8, max_rows_per_batch=4).max_cells == 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(capacity=0, max_rows_per_batch=1), r"capacity must be a positive integer, got 0"),
        (dict(capacity=4, max_rows_per_batch=-2), r"max_rows_per_batch must be a positive"),
        (
            dict(capacity=4, max_rows_per_batch=1, max_cells=3),
            r"max_cells=3 is smaller than one row \(capacity=4\); accepted: max_cells >= 4",
        ),
        (dict(capacity=2**31, max_rows_per_batch=1), r"capacity=2147483648 is too large"),
        (dict(capacity=4, max_rows_per_batch=1, max_metadata_bytes=0), r"max_metadata_bytes"),
        (dict(capacity=True, max_rows_per_batch=1), r"capacity must be a positive integer"),
    ],
)
def test_bad_fields_are_named(kwargs, message):
    with pytest.raises(sp.InvalidConfig, match=message):
        sp.PackConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = sp.PackConfig(capacity=4, max_rows_per_batch=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.capacity = 5
    with pytest.raises(TypeError):
        sp.PackConfig(4, 1)
