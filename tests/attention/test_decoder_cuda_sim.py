"""The decoder on ``device="cuda"`` equals the CPU path, under the Numba CUDA simulator.

The simulator has to be switched on before Numba is imported, so the comparison runs
in a fresh interpreter with ``NUMBA_ENABLE_CUDASIM=1``. Small profile, a few seeds:
the simulator runs one OS thread per CUDA thread, so this is about agreement of the
two kernel paths inside the decoder (logits, loss sum, every gradient coordinate),
not about speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json

from _cudasim import prepare_simulator

prepare_simulator()

import numpy as np
import streampack as sp
from _decoder_cases import random_case, worked_example
from streampack.auditing import _max_diff_and_failures, audit
from streampack.decoder import Decoder, DecoderConfig

config = DecoderConfig.small()
results = []
for seed in (0, 1, 2):
    examples, pack_config = random_case(seed, config)
    binding = sp.Binding(config.vocab_size, "random", f"seed-{seed}", "train")
    batch = sp.pack_examples(examples, binding, pack_config).batches[0]
    decoder = Decoder.init(config, seed)
    gpu = decoder.loss_and_grad_packed(batch, device="cuda")
    cpu = decoder.loss_and_grad_packed(batch, device="cpu")
    gpu_logits = decoder.forward_packed(batch, device="cuda")
    cpu_logits = decoder.forward_packed(batch, device="cpu")
    same_nan = bool(np.array_equal(np.isnan(gpu_logits), np.isnan(cpu_logits)))
    eligible = batch.loss_mask
    checks = [_max_diff_and_failures(gpu_logits[eligible], cpu_logits[eligible])]
    checks.append(_max_diff_and_failures(np.array(gpu.loss_sum), np.array(cpu.loss_sum)))
    checks += [_max_diff_and_failures(gpu.grads[n], cpu.grads[n]) for n in cpu.grads]
    results.append({
        "seed": seed,
        "occurrences": int(len(batch.occurrences)),
        "rows": batch.rows,
        "same_nan_cells": same_nan,
        "counts_equal": gpu.count == cpu.count,
        "failures": sum(bad for _, bad in checks),
        "max_diff": max(diff for diff, _ in checks),
        "values": int(eligible.sum()) * config.vocab_size + 1 + config.parameter_count(),
    })
_, batch = worked_example()
report = audit(batch, device="cuda")
print(json.dumps({"seeds": results, "audit_passed": report.passed}))
"""


def test_cuda_path_equals_cpu_path_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n[cuda simulator] {summary}")
    assert summary["audit_passed"]
    assert len(summary["seeds"]) == 3
    for seed in summary["seeds"]:
        assert seed["same_nan_cells"] and seed["counts_equal"], seed
        assert seed["failures"] == 0, seed
        assert seed["values"] > 1000
