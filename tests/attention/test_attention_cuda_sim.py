"""The CUDA attention kernels without a GPU: the simulator, and PTX for real GPUs.

* The scenario suite in ``tests/cudasim`` runs in a fresh pytest process with
  ``NUMBA_ENABLE_CUDASIM=1`` (the variable must be set before Numba is imported).
* Every kernel is compiled to PTX for compute capability 8.0 and 9.0, which type-checks
  it as the real CUDA target does; this needs NVVM (``numba-cuda[cu12]`` brings it).
"""

from __future__ import annotations

import os
import re
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


#: (kernel, dtype, compute capabilities) of the tiled kernels checked at head_dim 64
TILED_PTX = [
    ("forward", "float32", (8, 0)),
    ("forward", "float32", (9, 0)),
    ("dq", "float32", (8, 0)),
    ("dq", "float32", (9, 0)),
    ("dkdv", "float32", (8, 0)),
    ("dkdv", "float32", (9, 0)),
    ("forward_tf32", "float32", (8, 0)),
    ("forward_tf32", "float32", (9, 0)),
    ("forward", "float64", (9, 0)),
    ("dq", "float64", (9, 0)),
    ("dkdv", "float64", (9, 0)),
]
MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


def _toolkit_binary(name: str) -> str | None:
    """ptxas (``cuda-toolkit[nvcc]``, with numba-cuda[cu12]) or nvdisasm
    (``nvidia-cuda-nvdisasm``), both in the ``cuda`` extra; None when absent."""
    try:
        from cuda import pathfinder
    except ImportError:
        return None
    return pathfinder.find_nvidia_binary_utility(name)


def _assemble(ptx: str, cc: tuple[int, int], tmp_path: Path) -> tuple[str, Path]:
    """ptxas's report (registers, spills) and the cubin for ``sm_XY``."""
    source, cubin = tmp_path / "kernel.ptx", tmp_path / "kernel.cubin"
    source.write_text(ptx)
    ptxas = _toolkit_binary("ptxas")
    assert ptxas, "ptxas not found"
    arch = f"-arch=sm_{cc[0]}{cc[1]}"
    proc = subprocess.run(
        [ptxas, arch, "-v", str(source), "-o", str(cubin)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr, cubin


@pytest.mark.parametrize("kernel, dtype_name, cc", TILED_PTX)
def test_tiled_kernels_keep_their_tiles_in_registers(kernel, dtype_name, cc, tmp_path):
    """The tiled kernels' PTX and machine code: register tiles stay in registers (no
    ``.local`` arrays, no spills), float32 kernels do no float64 arithmetic, and the
    TF32 forward issues ``mma.sync`` (HMMA in SASS) where the exact kernels issue none.
    Registers per thread are printed (``pytest -s``) as ptxas reports them."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the simulator cannot compile PTX")
    reason = _nvvm_missing_reason()
    if reason:
        pytest.skip(reason)
    from streampack.kernels import attention_tiled

    ptx = attention_tiled.compile_ptx(kernel, dtype_name, 64, cc, None)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".local" not in ptx, "a register tile was left in local memory"
    if dtype_name == "float32":
        wide = [line for line in ptx.splitlines() if re.search(r"\.f64\b", line)]
        assert not wide, wide[:5]
    assert (MMA in ptx) == (kernel == "forward_tf32")
    if _toolkit_binary("ptxas") is None:
        pytest.skip("ptxas not installed (pip install 'streampack[cuda]'): PTX checked only")
    report, cubin = _assemble(ptx, cc, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    registers = re.search(r"Used (\d+) registers", report)
    assert registers, report
    print(f"{kernel} {dtype_name} sm_{cc[0]}{cc[1]}: {registers.group(1)} registers")
    nvdisasm = _toolkit_binary("nvdisasm")
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install 'streampack[cuda]'): no SASS check")
    sass = subprocess.run(
        [nvdisasm, str(cubin)], capture_output=True, text=True, timeout=300
    ).stdout
    assert re.search(r"\b(LDL|STL)\b", sass) is None, "local memory in the machine code"
    assert ("HMMA.1688.F32.TF32" in sass) == (kernel == "forward_tf32")
