"""Range-aware attention on a CUDA GPU: check against the CPU kernel, then time; prints JSON.

Needs a machine with an NVIDIA GPU and ``numba-cuda`` (extra ``cuda``). It
1. packs rows with ``pack_examples`` from documents of ``clip(lognormal(5, 1), 2, 2048)``
   tokens (8 rows x capacity 2048 x 4 heads x head_dim 64, float32, as
   ``benchmarks/attention.py``; ``--rows/--capacity/--head-dim`` shrink it, e.g. for a
   smoke run under ``NUMBA_ENABLE_CUDASIM=1``);
2. checks the CUDA forward and backward against the Numba CPU kernel, in float32 and in
   float64, on the full shape, and once more with PyTorch CUDA tensors as inputs when
   PyTorch with CUDA is installed (the ``__cuda_array_interface__`` path);
3. times forward and backward (kernel time after a warm-up, synchronised), beside
   PyTorch ``scaled_dot_product_attention`` with the equivalent dense boolean mask.

Without a GPU it prints a JSON error and exits with status 2. It runs in well under
five minutes (most of it is the first compilation of the kernels).

    python benchmarks/gpu_attention.py [--repeats 20] [--seed 0]
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/gpu_attention.py --rows 2 --capacity 16 \
        --head-dim 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

HEADS = 4


def fail(message: str) -> None:
    print(json.dumps({"error": message}, indent=2))
    sys.exit(2)


def packed_rows(seed: int, rows: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from streampack import Binding, Examples, PackConfig, pack_examples

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 1.0, size=4 * rows * capacity // 64 + 8), 2, capacity)
    docs = [rng.integers(2, 1000, size=int(n), dtype=np.int32) for n in lengths]
    config = PackConfig(capacity=capacity, max_rows_per_batch=rows)
    epoch = pack_examples(Examples.from_documents(docs), Binding(1000, "b", "b", "train"), config)
    batch = epoch.batches[0]
    permission = np.stack([batch.permission(r) for r in range(batch.rows)])
    return batch.segment_starts, batch.valid_lengths, permission


def max_rel_error(got: np.ndarray, want: np.ndarray) -> float:
    finite = np.isfinite(want)
    scale = max(float(np.abs(want[finite]).max(initial=0.0)), 1e-30)
    mismatch_inf = bool((np.isneginf(got) != np.isneginf(want)).any())
    err = float(np.abs(got[finite] - want[finite]).max(initial=0.0)) / scale
    return float("inf") if mismatch_inf else err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    rows, capacity, head_dim = args.rows, args.capacity, args.head_dim

    try:
        from numba import cuda
    except ImportError as exc:
        fail(f"numba-cuda is not installed ({exc}); pip install 'streampack[cuda]'")
    if not cuda.is_available():
        fail(
            "no CUDA GPU is available (numba.cuda.is_available() is False); run this on a "
            "machine with an NVIDIA GPU and driver"
        )

    from streampack.kernels.attention import range_attention, range_attention_backward

    starts, valid, permission = packed_rows(args.seed, rows, capacity)
    rows = starts.shape[0]
    edges = int(permission.sum())
    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")
    report: dict[str, Any] = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "shape": {"rows": rows, "heads": HEADS, "capacity": capacity, "head_dim": head_dim},
        "permitted_fraction": edges / (rows * capacity * capacity),
        "checks": {},
    }
    shape = (rows, HEADS, capacity, head_dim)
    ok = True
    for dtype, tol in ((np.float32, 1e-4), (np.float64, 1e-10)):
        rng = np.random.default_rng(args.seed + 1)
        q, k, v, g = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
        t0 = time.perf_counter()
        out, lse = range_attention(q, k, v, starts, valid, device="cuda")
        grads = range_attention_backward(q, k, v, out, lse, g, starts, valid, device="cuda")
        cuda.synchronize()
        first_call = time.perf_counter() - t0
        cpu_out, cpu_lse = range_attention(q, k, v, starts, valid)
        cpu_grads = range_attention_backward(q, k, v, cpu_out, cpu_lse, g, starts, valid)
        errors = {
            "out": max_rel_error(out.copy_to_host(), cpu_out),
            "lse": max_rel_error(lse.copy_to_host(), cpu_lse),
        }
        for name, a, b in zip(("dq", "dk", "dv"), grads, cpu_grads):
            errors[name] = max_rel_error(a.copy_to_host(), b)
        passed = all(e <= tol for e in errors.values())
        ok &= passed
        report["checks"][np.dtype(dtype).name] = {
            "max_relative_error_vs_cpu": errors,
            "tolerance": tol,
            "passed": passed,
            "first_call_s_including_compile": first_call,
        }

    rng = np.random.default_rng(args.seed + 1)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    dq_, dk_, dv_, dg_ = (cuda.to_device(x) for x in (q, k, v, g))
    d_starts, d_valid = cuda.to_device(starts), cuda.to_device(valid)

    def timed(fn: Any) -> float:
        fn()
        cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out, lse = range_attention(dq_, dk_, dv_, d_starts, d_valid, device="cuda")
    fwd = timed(lambda: range_attention(dq_, dk_, dv_, d_starts, d_valid, device="cuda"))
    bwd = timed(
        lambda: range_attention_backward(
            dq_, dk_, dv_, out, lse, dg_, d_starts, d_valid, device="cuda"
        )
    )
    report["kernel"] = {
        "forward_s": fwd,
        "backward_s": bwd,
        "forward_gflops_on_edges": 4 * head_dim * edges * HEADS / fwd / 1e9,
        "backward_gflops_on_edges": 10 * head_dim * edges * HEADS / bwd / 1e9,
        "note": "includes the host-side range check and key_end derivation per call",
    }
    report["torch_sdpa_dense_mask"] = torch_figures(
        q, k, v, g, starts, valid, permission, out, args.repeats
    )
    report["passed"] = ok
    print(json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


def torch_figures(q, k, v, g, starts, valid, permission, out, repeats) -> Any:
    """SDPA with the dense mask on the GPU, and our kernel fed PyTorch CUDA tensors."""
    try:
        import torch
    except ImportError:
        return "PyTorch not installed; omitted"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA support here; omitted"
    from streampack.kernels.attention import range_attention

    dev = torch.device("cuda")
    tq, tk, tv, tg = (torch.from_numpy(x).to(dev) for x in (q, k, v, g))
    mask = torch.from_numpy(permission).to(dev)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.no_grad():
        fwd = timed(lambda: sdpa(tq, tk, tv, attn_mask=mask))
    leaves = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]

    def step() -> None:
        o = sdpa(*leaves, attn_mask=mask)
        o.backward(tg)

    both = timed(step)
    ours, _ = range_attention(
        tq, tk, tv, torch.from_numpy(starts).to(dev), torch.from_numpy(valid).to(dev), device="cuda"
    )
    diff = float(np.abs(ours.copy_to_host() - out.copy_to_host()).max())
    return {
        "torch_version": torch.__version__,
        "forward_s": fwd,
        "forward_plus_backward_s": both,
        "backward_s": max(both - fwd, 0.0),
        "torch_tensor_inputs_max_abs_diff": diff,
    }


if __name__ == "__main__":
    main()
