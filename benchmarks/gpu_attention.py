"""Range-aware attention on a CUDA GPU: every kernel checked against float64, then timed
side by side in one run; prints JSON.

Needs a machine with an NVIDIA GPU and ``numba-cuda`` (extra ``cuda``). It
1. packs rows with ``pack_examples`` from documents of ``clip(lognormal(5, 1), 2, 2048)``
   tokens (8 rows x capacity 2048 x 4 heads x head_dim 64, as ``benchmarks/attention.py``;
   ``--rows/--capacity/--head-dim`` shrink it, e.g. for a smoke run under
   ``NUMBA_ENABLE_CUDASIM=1``);
2. checks each CUDA variant against the float64 CPU kernel on the full shape: the
   default kernel (``per_query``) and ``kernel="tiled"`` in float32 and float64, and the
   TF32 forward (``precision="tf32"``, whose backward is the exact tiled one); once more
   with PyTorch CUDA tensors as inputs when PyTorch with CUDA is installed;
3. times each variant's forward and backward (wall time of the call after a warm-up,
   synchronised, median of ``--repeats``; it includes the host-side range checks), beside
   PyTorch ``scaled_dot_product_attention`` with the equivalent dense boolean mask and,
   where PyTorch has it, a compiled FlexAttention with the same document mask in TF32
   mode (``torch.compile(flex_attention)``, ``create_block_mask`` from the ranges);
4. reads the tiled kernels' machine code (``inspect_sass()``: HMMA instructions in the
   TF32 forward, no local memory) and their registers per thread.

Ratios are against the default kernel's float32 time in the same run
(``speedup_vs_per_query``) and against SDPA with the dense mask. Without a GPU it prints
a JSON error and exits with status 2; it exits with 1 when a check fails.

    python benchmarks/gpu_attention.py [--repeats 20] [--seed 0] [--out FILE]
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/gpu_attention.py --rows 1 --capacity 16 \
        --head-dim 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HEADS = 4
#: (name, options, float64 too, tolerance of float32 against the float64 CPU kernel)
VARIANTS = [
    ("per_query", {}, True, 1e-4),
    ("tiled", {"kernel": "tiled"}, True, 1e-4),
    ("tiled_tf32", {"kernel": "tiled", "precision": "tf32"}, False, 2e-2),
]
FLOAT64_TOLERANCE = 1e-10
#: Dense float32 peaks (FMA on CUDA cores, TF32 tensor cores), FLOP/s, by device name.
PEAKS = {"H200": (66.9e12, 494.7e12), "H100": (66.9e12, 494.7e12), "A100": (19.5e12, 156e12)}


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


def median_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", help="also write the JSON report to this file")
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
    device = name.decode() if isinstance(name, bytes) else str(name)
    report: dict[str, Any] = {
        "device": device,
        "versions": versions(),
        "shape": {"rows": rows, "heads": HEADS, "capacity": capacity, "head_dim": head_dim},
        "permitted_fraction": edges / (rows * capacity * capacity),
        "checks": {},
        "kernels": {},
    }
    shape = (rows, HEADS, capacity, head_dim)
    rng = np.random.default_rng(args.seed + 1)
    # float32-representable inputs, so that the float64 reference measures each kernel's
    # arithmetic and not the rounding of its inputs
    q64, k64, v64, g64 = (
        rng.standard_normal(shape).astype(np.float32).astype(np.float64) for _ in range(4)
    )
    ref_out, ref_lse = range_attention(q64, k64, v64, starts, valid)
    ref_grads = range_attention_backward(q64, k64, v64, ref_out, ref_lse, g64, starts, valid)
    reference = {"out": ref_out, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1]}
    reference["dv"] = ref_grads[2]

    ok = True
    for variant, options, with_float64, tol32 in VARIANTS:
        backward_options = {"kernel": options.get("kernel", "per_query")}
        for dtype, tol in ((np.float32, tol32), (np.float64, FLOAT64_TOLERANCE)):
            if dtype == np.float64 and not with_float64:
                continue
            q, k, v, g = (x.astype(dtype) for x in (q64, k64, v64, g64))
            t0 = time.perf_counter()
            out, lse = range_attention(q, k, v, starts, valid, device="cuda", **options)
            grads = range_attention_backward(
                q, k, v, out, lse, g, starts, valid, device="cuda", **backward_options
            )
            cuda.synchronize()
            first_call = time.perf_counter() - t0
            got = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
            errors = {n: max_rel_error(x.copy_to_host(), reference[n]) for n, x in got.items()}
            passed = all(e <= tol for e in errors.values())
            ok &= passed
            report["checks"][f"{variant}_{np.dtype(dtype).name}"] = {
                "max_relative_error_vs_cpu_float64": errors,
                "tolerance": tol,
                "passed": passed,
                "first_call_s_including_compile": first_call,
            }

    # timing, float32 (and float64 where the variant has it), device arrays in
    timings: dict[str, Any] = {}
    for variant, options, with_float64, _ in VARIANTS:
        for dtype in (np.float32, np.float64) if with_float64 else (np.float32,):
            inputs = [x.astype(dtype) for x in (q64, k64, v64, g64)]
            fwd, bwd = time_variant(inputs, starts, valid, options, args.repeats)
            timings[f"{variant}_{np.dtype(dtype).name}"] = {
                "forward_s": fwd,
                "backward_s": bwd,
                "forward_gflops_on_edges": 4 * head_dim * edges * HEADS / fwd / 1e9,
                "backward_gflops_on_edges": 10 * head_dim * edges * HEADS / bwd / 1e9,
            }
    base = timings["per_query_float32"]
    for entry in timings.values():
        entry["forward_speedup_vs_per_query"] = base["forward_s"] / entry["forward_s"]
        entry["backward_speedup_vs_per_query"] = base["backward_s"] / entry["backward_s"]
    peaks = next((p for key, p in PEAKS.items() if key in device), None)
    if peaks:
        for key, entry in timings.items():
            peak = peaks[1] if key == "tiled_tf32_float32" else peaks[0]
            entry["forward_fraction_of_peak"] = entry["forward_gflops_on_edges"] * 1e9 / peak
            entry["backward_fraction_of_peak"] = entry["backward_gflops_on_edges"] * 1e9 / peaks[0]
    report["kernels"] = timings
    report["timing_note"] = (
        "wall time of one call, synchronised, median of --repeats; includes the host-side "
        "range checks and (tiled) the tile bounds; backward of tiled_tf32 is the exact one"
    )
    report["sass"] = sass_checks(head_dim)
    report["torch"] = torch_figures(q64, k64, v64, g64, starts, valid, permission, args.repeats)
    if isinstance(report["torch"], dict):
        sdpa = report["torch"].get("sdpa_dense_mask", {})
        for entry in timings.values():
            if sdpa.get("forward_s"):
                entry["forward_speedup_vs_sdpa_dense"] = sdpa["forward_s"] / entry["forward_s"]
                entry["backward_speedup_vs_sdpa_dense"] = sdpa["backward_s"] / entry["backward_s"]
        flex = report["torch"].get("flex_attention_tf32", {})
        if isinstance(flex, dict) and flex.get("forward_s"):
            tf32 = timings["tiled_tf32_float32"]
            tf32["forward_fraction_of_flex_tf32"] = flex["forward_s"] / tf32["forward_s"]
    report["passed"] = ok and report["sass"].get("passed", True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    sys.exit(0 if report["passed"] else 1)


def time_variant(
    inputs: list[np.ndarray],
    starts: np.ndarray,
    valid: np.ndarray,
    options: dict[str, str],
    repeats: int,
) -> tuple[float, float]:
    """Median forward and backward times of one variant on device-resident inputs."""
    from numba import cuda

    from streampack.kernels.attention import range_attention, range_attention_backward

    q, k, v, g = (cuda.to_device(x) for x in inputs)
    d_starts, d_valid = cuda.to_device(starts), cuda.to_device(valid)
    backward_options = {"kernel": options.get("kernel", "per_query")}

    def forward() -> Any:
        return range_attention(q, k, v, d_starts, d_valid, device="cuda", **options)

    out, lse = forward()

    def backward() -> Any:
        return range_attention_backward(
            q, k, v, out, lse, g, d_starts, d_valid, device="cuda", **backward_options
        )

    return (
        median_time(forward, repeats, cuda.synchronize),
        median_time(backward, repeats, cuda.synchronize),
    )


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("numpy", "numba", "numba-cuda", "torch", "triton", "nvidia-cuda-nvdisasm"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def sass_checks(head_dim: int) -> dict[str, Any]:
    """Machine code of the tiled kernels this run compiled (float32, default tiles)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return {"note": "the simulator has no machine code"}
    from streampack.kernels import attention_tiled as tiled

    checks: dict[str, Any] = {}
    passed = True
    for kernel in tiled.KERNELS:
        rows, cols = tiled.tiles_for(kernel, head_dim, 4)
        dispatcher = tiled._kernel(kernel, "float32", head_dim, rows, cols)
        try:
            sass = "\n".join(dispatcher.inspect_sass().values())
            regs = dispatcher.get_regs_per_thread()
            local = dispatcher.get_local_mem_per_thread()
        except Exception as exc:  # noqa: BLE001 - nvdisasm missing etc.: report it
            checks[kernel] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if isinstance(regs, dict):
            regs, local = max(regs.values()), max(local.values())
        hmma = len(re.findall(r"\bHMMA\b", sass))
        spills = len(re.findall(r"\b(LDL|STL)\b", sass))
        good = spills == 0 and local == 0 and (hmma > 0) == (kernel == "forward_tf32")
        passed &= good
        checks[kernel] = {
            "tiles": [rows, cols],
            "registers_per_thread": regs,
            "local_bytes_per_thread": local,
            "hmma_instructions": hmma,
            "local_memory_instructions": spills,
            "passed": good,
        }
    checks["passed"] = passed
    return checks


def torch_figures(q64, k64, v64, g64, starts, valid, permission, repeats) -> Any:
    """SDPA with the dense mask, FlexAttention with the document mask (TF32), and our
    default kernel fed PyTorch CUDA tensors."""
    try:
        import torch
    except ImportError:
        return "PyTorch not installed; omitted"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA support here; omitted"
    from streampack.kernels.attention import range_attention

    dev = torch.device("cuda")
    tq, tk, tv, tg = (torch.from_numpy(x.astype(np.float32)).to(dev) for x in (q64, k64, v64, g64))
    figures: dict[str, Any] = {"torch_version": torch.__version__}

    def both(attend: Callable[..., Any]) -> dict[str, float]:
        with torch.no_grad():
            fwd = median_time(lambda: attend(tq, tk, tv), repeats, torch.cuda.synchronize)
        leaves = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]

        def step() -> None:
            attend(*leaves).backward(tg)

        total = median_time(step, repeats, torch.cuda.synchronize)
        return {"forward_s": fwd, "forward_plus_backward_s": total, "backward_s": total - fwd}

    mask = torch.from_numpy(permission).to(dev)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    figures["sdpa_dense_mask"] = both(lambda a, b, c: sdpa(a, b, c, attn_mask=mask))
    figures["flex_attention_tf32"] = flex_figures(torch, both, starts, valid, tq)

    ours, _ = range_attention(
        tq, tk, tv, torch.from_numpy(starts).to(dev), torch.from_numpy(valid).to(dev), device="cuda"
    )
    host, _ = range_attention(
        *(x.astype(np.float32) for x in (q64, k64, v64)), starts, valid, device="cuda"
    )
    diff = float(np.abs(ours.copy_to_host() - host.copy_to_host()).max())
    figures["torch_tensor_inputs_max_abs_diff"] = diff
    return figures


def flex_figures(torch: Any, both: Callable[..., Any], starts, valid, tq) -> Any:
    """Compiled FlexAttention with the same ranges as a block mask, float32 inputs with
    TF32 matrix products (restored afterwards)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return f"FlexAttention not available ({exc}); omitted"
    dev = tq.device
    t_starts = torch.from_numpy(starts.astype(np.int64)).to(dev)
    t_valid = torch.from_numpy(valid.astype(np.int64)).to(dev)
    rows, _, capacity, _ = tq.shape

    def document(b, h, q_idx, kv_idx):
        return (q_idx < t_valid[b]) & (kv_idx >= t_starts[b, q_idx]) & (kv_idx <= q_idx)

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        block_mask = create_block_mask(document, rows, None, capacity, capacity, device=dev)
        compiled = torch.compile(flex_attention)
        figures = both(lambda a, b, c: compiled(a, b, c, block_mask=block_mask))
        figures["block_mask_sparsity_percent"] = float(block_mask.sparsity())
        return figures
    except Exception as exc:  # noqa: BLE001 - a compiler failure is reported, not fatal
        return f"FlexAttention failed: {type(exc).__name__}: {exc}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


if __name__ == "__main__":
    main()
