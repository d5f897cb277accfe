"""``PackedBatch.to_megatron``: Megatron-Core's THD parameters, field by field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _packing_cases import BINDING, A, B, C

import streampack as sp

torch = pytest.importorskip(
    "torch", reason="the hf extra (PyTorch) is not installed: pip install 'streampack[hf]'"
)


@pytest.fixture(scope="module")
def batch() -> sp.PackedBatch:
    return sp.pack_examples(
        sp.Examples.from_documents([A, B, C]),
        BINDING,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    ).batches[0]


def test_worked_example_thd_parameters(batch):
    params = batch.to_megatron()
    assert params["qkv_format"] == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert params[name].tolist() == [0, 3, 5, 9] and params[name].dtype == torch.int32
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert params[name].tolist() == [0, 3, 6, 12] and params[name].dtype == torch.int32
    # The longest padded span is C with its two padding cells: 6, not C's 4 real cells.
    assert (params["max_seqlen_q"], params["max_seqlen_kv"]) == (6, 6)
    assert type(params["max_seqlen_q"]) is int


def test_padded_spans_hold_each_occurrence_then_only_padding(batch):
    params = batch.to_megatron()
    flat_inputs = batch.inputs.reshape(-1)
    flat_valid = batch.input_valid.reshape(-1)
    real = np.diff(params["cu_seqlens_q"].numpy())
    padded = params["cu_seqlens_q_padded"].numpy()
    for i, (start, stop) in enumerate(zip(padded[:-1], padded[1:])):
        assert flat_valid[start : start + real[i]].all()
        assert not flat_valid[start + real[i] : stop].any()
        assert flat_inputs[start] == 0  # every document here starts with BOS 0
    assert padded[-1] == batch.rows * batch.capacity


def test_splats_into_megatron_core_packed_seq_params(batch):
    packed_seq_params = pytest.importorskip(
        "megatron.core.packed_seq_params",
        reason="megatron-core is not installed (pip install megatron-core)",
    )
    params = packed_seq_params.PackedSeqParams(**batch.to_megatron())
    assert params.qkv_format == "thd" and params.max_seqlen_kv == 6
    assert {f.name for f in dataclasses.fields(params)} >= set(batch.to_megatron())
