"""The CUDA attention kernels without a GPU: the simulator, and PTX for real GPUs.

* The scenario suite in ``tests/cudasim`` runs in a fresh pytest process with
  ``NUMBA_ENABLE_CUDASIM=1`` (the variable must be set before Numba is imported).
* Every kernel is compiled to PTX for compute capability 8.0 and 9.0, which type-checks
  it as the real CUDA target does; this needs NVVM (``numba-cuda[cu12]`` brings it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_kernels_pass_the_scenario_suite_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cudasim"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail


def _nvvm_missing_reason() -> str | None:
    from numba import cuda, float32

    def probe(a):
        a[0] = 1.0

    try:
        cuda.compile_ptx(probe, (float32[::1],), cc=(8, 0))
    except Exception as exc:  # noqa: BLE001 - any failure here means no toolkit
        return (
            f"NVVM/NVRTC not installed ({type(exc).__name__}: {exc}); "
            "pip install 'numba-cuda[cu12]'"
        )
    return None


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_every_kernel_compiles_to_ptx(cc, dtype_name):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator cannot compile PTX")
    reason = _nvvm_missing_reason()
    if reason:
        pytest.skip(reason)
    from streampack.kernels import attention_cuda

    for dim in (64,):
        ptx = attention_cuda.compile_ptx(dtype_name, dim, cc)
        assert set(ptx) == {"forward", "dq", "dkdv"}
        target = f".target sm_{cc[0]}{cc[1]}"
        for name, text in ptx.items():
            assert target in text, name
            assert ".entry" in text or ".visible .entry" in text, name
