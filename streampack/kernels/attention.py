"""Range-aware attention for packed rows: validation and dispatch to the CPU or CUDA kernels.

Rule C6: in row ``r``, query ``q < valid_lengths[r]`` attends keys
``[segment_starts[r, q], q + 1)``; every other query is inactive — it skips softmax,
its output is 0, its ``lse`` is ``-inf`` and it contributes to no gradient. No dense
mask is built: the work grows with the permitted edges (for next-fit rows, the sum over
segments of ``l (l + 1) / 2``), not with ``capacity**2``.

Arrays are ``[rows, heads, capacity, head_dim]``, float32 or float64, and the results
follow the input dtype; ``segment_starts`` is ``[rows, capacity]`` and ``valid_lengths``
``[rows]`` — the arrays :class:`streampack.PackedBatch` carries. Everything is checked
here, before any kernel runs, so a kernel never reads outside its arrays:

* on the CPU, inputs are converted with ``np.ascontiguousarray`` (a copy only when they
  are not already C-contiguous) and results are numpy arrays;
* with ``device="cuda"``, inputs may be numpy arrays (copied to the device) or any
  object exposing ``__cuda_array_interface__`` (PyTorch CUDA tensors, Numba device
  arrays), which must then be C-contiguous; results are Numba device arrays, never
  copied back to the host. The range arrays are small and are checked on the host
  (copied there first if they live on the device); the ``lse`` finiteness check of the
  backward runs only for host arrays.

The CPU forward does its block products with its own register-blocked micro-kernels
(generated LLVM IR); the CPU backward uses ``np.dot`` inside Numba, which calls the BLAS
that SciPy ships; SciPy is therefore a dependency of this module.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InvalidArray, InvalidConfig

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_DEVICES = ("cpu", "cuda")
#: CUDA kernels: one thread per query (the default), or FlashAttention-2 style tiles.
_KERNELS = ("per_query", "tiled")
_PRECISIONS = ("exact", "tf32")


def _is_device_array(x: Any) -> bool:
    """CUDA memory: the CUDA array interface, or a Numba device array (whose simulator
    stand-in has ``copy_to_host`` but no interface)."""
    try:
        has_interface = hasattr(x, "__cuda_array_interface__")
    except Exception as exc:  # noqa: BLE001 - e.g. a PyTorch tensor that requires grad
        raise InvalidArray(
            f"a {type(x).__name__} refused to expose its CUDA memory ({exc}); "
            "accepted: plain device arrays (for PyTorch, pass tensor.detach())"
        ) from exc
    return has_interface or (hasattr(x, "copy_to_host") and hasattr(x, "is_c_contiguous"))


def _host_float(name: str, x: Any) -> np.ndarray:
    if _is_device_array(x):
        raise InvalidArray(
            f"{name} is a CUDA array; device='cpu' takes host arrays. "
            "Pass device='cuda' or copy it to the host first."
        )
    try:
        arr = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - anything numpy cannot read is a bad array
        raise InvalidArray(f"{name} cannot be read as an array: {exc}") from exc
    return arr


def _check_float(
    name: str, shape: tuple[int, ...], dtype: Any, want: tuple[int, ...], want_dtype: np.dtype
) -> None:
    if tuple(shape) != tuple(want):
        raise InvalidArray(f"{name} has shape {tuple(shape)}; accepted: {tuple(want)} to match q")
    if np.dtype(dtype) != want_dtype:
        raise InvalidArray(f"{name} has dtype {np.dtype(dtype)}; accepted: {want_dtype} as q")


def _check_q(shape: tuple[int, ...], dtype: Any) -> None:
    if len(shape) != 4:
        raise InvalidArray(
            f"q has {len(shape)} dimensions (shape {tuple(shape)}); "
            "accepted: 4, [rows, heads, capacity, head_dim]"
        )
    if np.dtype(dtype) not in _FLOAT_DTYPES:
        raise InvalidArray(f"q has dtype {np.dtype(dtype)}; accepted: float32 or float64")
    if shape[3] < 1:
        raise InvalidArray(f"q has head_dim {shape[3]}; accepted: at least 1")


def _check_ranges(
    segment_starts: Any, valid_lengths: Any, rows: int, capacity: int
) -> tuple[np.ndarray, np.ndarray]:
    """Check the range arrays on the host; return them as C-contiguous int32."""
    starts = np.asarray(segment_starts)
    valid = np.asarray(valid_lengths)
    for name, arr, want in (
        ("segment_starts", starts, (rows, capacity)),
        ("valid_lengths", valid, (rows,)),
    ):
        if arr.dtype.kind not in "iu":
            raise InvalidArray(f"{name} has dtype {arr.dtype}; accepted: an integer dtype (int32)")
        if arr.shape != want:
            raise InvalidArray(
                f"{name} has shape {arr.shape}; accepted: {want} for q of "
                f"{rows} rows and capacity {capacity}"
            )
    bad = np.flatnonzero((valid < 0) | (valid > capacity))
    if bad.size:
        r = int(bad[0])
        raise InvalidArray(
            f"valid_lengths[{r}] = {int(valid[r])}; accepted: 0..{capacity} (the capacity)"
        )
    cols = np.arange(capacity)
    active = cols[None, :] < valid[:, None]
    wrong = active & ((starts < 0) | (starts > cols[None, :]))
    if wrong.any():
        r, c = (int(i) for i in np.argwhere(wrong)[0])
        raise InvalidArray(
            f"segment_starts[{r}, {c}] = {int(starts[r, c])} for an active query "
            f"(valid_lengths[{r}] = {int(valid[r])}); accepted: 0..{c}, "
            "a segment starts at or before its query"
        )
    return (
        np.ascontiguousarray(starts, dtype=np.int32),
        np.ascontiguousarray(valid, dtype=np.int32),
    )


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        value = float(scale)
    except (TypeError, ValueError) as exc:
        raise InvalidConfig(f"scale = {scale!r}; accepted: a finite float or None") from exc
    if not math.isfinite(value):
        raise InvalidConfig(f"scale = {value}; accepted: a finite float or None")
    return value


def _check_device(device: str) -> None:
    if device not in _DEVICES:
        raise InvalidConfig(f"device = {device!r}; accepted: 'cpu' or 'cuda'")


def _check_kernel(device: str, kernel: str, precision: str, dtype: np.dtype) -> None:
    """``kernel`` and ``precision`` choose among the CUDA kernels; check the pair."""
    if kernel not in _KERNELS:
        raise InvalidConfig(f"kernel = {kernel!r}; accepted: 'per_query' or 'tiled'")
    if precision not in _PRECISIONS:
        raise InvalidConfig(f"precision = {precision!r}; accepted: 'exact' or 'tf32'")
    if kernel == "tiled" and device != "cuda":
        raise InvalidConfig(
            "kernel = 'tiled' selects a CUDA kernel; accepted with device='cuda' "
            "(the CPU kernels take kernel='per_query', the default)"
        )
    if precision == "tf32" and (kernel != "tiled" or dtype != np.dtype(np.float32)):
        raise InvalidConfig(
            f"precision = 'tf32' with kernel = {kernel!r} and {dtype} inputs; accepted: "
            "device='cuda', kernel='tiled' and float32 inputs (the tensor-core forward)"
        )


def _shape_dtype(name: str, x: Any, device: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a host or device array without copying it."""
    if device == "cpu" or not _is_device_array(x):
        arr = _host_float(name, x)
        return tuple(arr.shape), arr.dtype
    if hasattr(x, "__cuda_array_interface__"):
        iface = x.__cuda_array_interface__
        return tuple(int(n) for n in iface["shape"]), np.dtype(iface["typestr"])
    return tuple(int(n) for n in x.shape), np.dtype(x.dtype)


def _check_lse(lse: np.ndarray, valid: np.ndarray) -> None:
    """The saved ``lse`` must be finite for every active query (it divides the softmax)."""
    active = np.arange(lse.shape[2])[None, None, :] < valid[:, None, None]
    bad = active & ~np.isfinite(lse)
    if bad.any():
        r, h, c = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidArray(
            f"lse[{r}, {h}, {c}] = {lse[r, h, c]} for an active query; accepted: a finite "
            "value, as range_attention returns for the same inputs"
        )


def _validate(
    floats: dict[str, Any],
    lse: Any,
    segment_starts: Any,
    valid_lengths: Any,
    device: str,
) -> tuple[tuple[int, ...], np.dtype, np.ndarray, np.ndarray]:
    """Check every array; return ``(shape, dtype, starts, valid)``."""
    _check_device(device)
    shape, dtype = _shape_dtype("q", floats["q"], device)
    _check_q(shape, dtype)
    for name, x in floats.items():
        if name == "q":
            continue
        other_shape, other_dtype = _shape_dtype(name, x, device)
        _check_float(name, other_shape, other_dtype, shape, dtype)
    rows, heads, capacity, _ = shape
    if lse is not None:
        lse_shape, lse_dtype = _shape_dtype("lse", lse, device)
        if lse_shape != (rows, heads, capacity):
            raise InvalidArray(
                f"lse has shape {lse_shape}; accepted: {(rows, heads, capacity)} "
                "(rows, heads, capacity of q)"
            )
        if np.dtype(lse_dtype) != dtype:
            raise InvalidArray(f"lse has dtype {np.dtype(lse_dtype)}; accepted: {dtype} as q")
    starts = _to_host(segment_starts)
    valid = _to_host(valid_lengths)
    starts, valid = _check_ranges(starts, valid, rows, capacity)
    return shape, dtype, starts, valid


def _to_host(x: Any) -> Any:
    """Small integer arrays are checked on the host; copy them there when on the device."""
    if hasattr(x, "__cuda_array_interface__"):
        from numba import cuda

        return cuda.as_cuda_array(x).copy_to_host()
    if _is_device_array(x):
        return x.copy_to_host()
    return x


def _flat(x: Any, rows_heads_cap: int, dim: int) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(rows_heads_cap, dim)


def range_attention(
    q: Any,
    k: Any,
    v: Any,
    segment_starts: Any,
    valid_lengths: Any,
    *,
    scale: float | None = None,
    device: str = "cpu",
    kernel: str = "per_query",
    precision: str = "exact",
    _tiles: tuple[int, int] | None = None,
) -> tuple[Any, Any]:
    """Block-causal softmax attention over packed rows; returns ``(out, lse)``.

    Args:
        q, k, v: ``[rows, heads, capacity, head_dim]``, all float32 or all float64.
        segment_starts: int ``[rows, capacity]``; for an active query, the first key
            column it may use (``0 <= start <= q``). Ignored for inactive queries.
        valid_lengths: int ``[rows]`` in ``[0, capacity]``; queries at or past it are
            inactive (next-fit leaves padding only at each row's tail).
        scale: multiplies the scores; ``1 / sqrt(head_dim)`` when None.
        device: ``"cpu"`` (Numba, parallel over threads) or ``"cuda"``.
        kernel: with ``device="cuda"``, ``"per_query"`` (one thread per query, the
            default) or ``"tiled"`` (FlashAttention-2 style register and shared-memory
            tiles, :mod:`~streampack.kernels.attention_tiled`).
        precision: ``"exact"`` (products in the input dtype) or ``"tf32"`` (with
            ``kernel="tiled"`` and float32: the products on TF32 tensor cores, about
            1e-3 relative error, softmax in float32).
        _tiles: ``(query tile, key tile)`` sizes instead of the kernels' constants; for
            tests that need tile edges on small shapes. Results do not depend on them
            beyond rounding.

    Returns:
        ``out`` like ``q`` (0 on inactive queries) and ``lse = log(sum(exp(scores)))``
        ``[rows, heads, capacity]`` in the same dtype (``-inf`` on inactive queries),
        which :func:`range_attention_backward` needs.

    Raises:
        InvalidArray: a shape, dtype or range value is wrong (the message names the
            array, the index and the value).
        InvalidConfig: ``scale``, ``device``, ``kernel`` or ``precision`` is not
            accepted.
    """
    floats = {"q": q, "k": k, "v": v}
    shape, dtype, starts, valid = _validate(floats, None, segment_starts, valid_lengths, device)
    _check_kernel(device, kernel, precision, dtype)
    rows, heads, capacity, dim = shape
    scale_value = _resolve_scale(scale, dim)
    if device == "cuda":
        from . import attention_cuda

        return attention_cuda.forward(
            q, k, v, starts, valid, scale_value, _tiles, kernel=kernel, precision=precision
        )
    from . import attention_cpu as cpu
    from . import attention_plan as plan_kernels

    n = rows * heads * capacity
    qf, kf, vf = (_flat(_host_float(name, x), n, dim) for name, x in floats.items())
    # the kernel writes every row of out (zeros for inactive queries), in parallel;
    # np.zeros would first clear the whole array on the calling thread
    out = np.empty((n, dim), dtype)
    lse = np.full((rows * heads, capacity), -np.inf, dtype)
    if n:
        import numba

        tile_q, tile_k = _tiles or (cpu.TILE_Q, cpu.FORWARD_TILE_K)
        plan = plan_kernels.plan_forward(starts, valid, heads, tile_q, numba.get_num_threads())
        # scale in the array dtype: a float64 scale would drag float32 arithmetic
        # (and the exp) to float64
        typed_scale = dtype.type(scale_value)
        # numba's Dispatcher.__call__ is typed without the kernel's own parameters.
        cpu.forward(  # type: ignore[call-arg]
            qf, kf, vf, starts, valid, typed_scale, tile_q, tile_k, *plan, out, lse
        )
    return out.reshape(shape), lse.reshape(rows, heads, capacity)


def range_attention_backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    d_out: Any,
    segment_starts: Any,
    valid_lengths: Any,
    *,
    scale: float | None = None,
    device: str = "cpu",
    kernel: str = "per_query",
    _tiles: tuple[int, int] | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients ``(dq, dk, dv)`` of ``sum(out * d_out)`` for :func:`range_attention`.

    ``out`` and ``lse`` are what :func:`range_attention` returned for the same inputs
    and ``scale``; probabilities are recomputed from ``lse``, never stored. Inactive
    queries get ``dq = 0`` and padding keys get exactly zero ``dk`` and ``dv``.
    ``kernel`` is as for :func:`range_attention`; the backward's products are always in
    the input dtype (the backward of a ``precision="tf32"`` forward is exact).

    Raises:
        InvalidArray: as :func:`range_attention`, and for an ``lse`` of the wrong
            shape or dtype or one that is not finite on an active query.
        InvalidConfig: ``scale``, ``device`` or ``kernel`` is not accepted.
    """
    floats = {"q": q, "k": k, "v": v, "out": out, "d_out": d_out}
    shape, dtype, starts, valid = _validate(floats, lse, segment_starts, valid_lengths, device)
    _check_kernel(device, kernel, "exact", dtype)
    rows, heads, capacity, dim = shape
    scale_value = _resolve_scale(scale, dim)
    if device == "cuda":
        from . import attention_cuda

        return attention_cuda.backward(
            q, k, v, out, lse, d_out, starts, valid, scale_value, _tiles, kernel=kernel
        )
    from . import attention_cpu as cpu
    from . import attention_plan as plan_kernels

    n = rows * heads * capacity
    qf, kf, vf, of, gf = (_flat(_host_float(name, x), n, dim) for name, x in floats.items())
    lse_host = np.ascontiguousarray(_host_float("lse", lse)).reshape(rows * heads, capacity)
    _check_lse(lse_host.reshape(rows, heads, capacity), valid)
    dq = np.zeros((n, dim), dtype)
    dk = np.zeros((n, dim), dtype)
    dv = np.zeros((n, dim), dtype)
    if n:
        import numba

        tile_q, tile_k = _tiles or (cpu.TILE_Q, cpu.key_tile(dim))
        key_end = np.empty((rows, capacity), np.int32)
        plan_kernels.key_query_end(starts, valid, key_end)
        plan = plan_kernels.plan_backward(starts, valid, heads, tile_q, numba.get_num_threads())
        cpu.backward(  # type: ignore[call-arg]  # (as cpu.forward above)
            qf,
            kf,
            vf,
            of,
            lse_host,
            gf,
            starts,
            valid,
            key_end,
            dtype.type(scale_value),
            tile_q,
            tile_k,
            *plan,
            dq,
            dk,
            dv,
        )
    return dq.reshape(shape), dk.reshape(shape), dv.reshape(shape)
