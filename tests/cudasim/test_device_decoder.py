"""The audit on a real GPU: packed execution on the CUDA kernels equals separate execution.

Collected only with ``STREAMPACK_CUDA_DEVICE=1`` (``make test-gpu``), where the kernels
are compiled for the machine's GPU; under the simulator ``tests/attention/test_decoder_cuda_sim.py``
runs the same comparison in a fresh interpreter.
"""

from __future__ import annotations

import pytest
from _decoder_cases import random_case, worked_example

import streampack as sp
from streampack.decoder import DecoderConfig


@pytest.mark.parametrize("profile", ["small", "large"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_audit_passes_on_the_gpu(profile, seed):
    config = getattr(DecoderConfig, profile)()
    examples, pack_config = random_case(seed, config)
    binding = sp.Binding(config.vocab_size, "random", f"seed-{seed}", "train")
    batch = sp.pack_examples(examples, binding, pack_config).batches[0]
    report = sp.audit(batch, config=config, device="cuda", examples=examples)
    assert report.passed, report


def test_worked_example_audit_passes_on_the_gpu():
    _, batch = worked_example()
    assert sp.audit(batch, device="cuda").passed
