"""Range-aware attention on CUDA: ``numba.cuda`` kernels, forward and backward.

Pure kernels over device arrays plus thin launchers; :mod:`streampack.kernels.attention`
validates everything first (ranges on the host) and calls :func:`forward` /
:func:`backward`. Query ``q < valid[r]`` of row ``r`` may use keys
``[starts[r, q], q]`` (rule C6).

Forward — one block per ``(row * heads + head, query tile)``, one thread per query::

    keys  lo ......................... hi        lo = smallest start of the tile's
          [ tile ][ tile ][ tile ]                   active queries
                                                hi = the tile's last active query + 1
    each key tile is staged in shared memory (K and V rows, loaded together by the
    block); every thread scores the keys of its own range in the tile, rescales its
    running sum and output accumulator once if the tile raised its running max
    (online softmax), adds the tile's weighted values, and at the end writes
    ``out = acc / sum`` and ``lse = max + log(sum)``.

Key tiles outside ``[lo, hi)`` are never loaded. Accumulators are float32 for float32
inputs (float64 for float64 ones, so a float64 caller keeps its precision).

Backward — probabilities are recomputed from the saved ``lse``:

* ``dq`` kernel, one thread per query, the same key loop as the forward:
  ``p = exp(s - lse)``, ``dp = dO . v``, ``ds = p (dp - D)``, ``dq += scale ds k``,
  with ``D = dO . out`` computed by the thread and saved for the next kernel;
* ``dk``/``dv`` kernel, one thread per key, over the queries that may see the block's
  keys, ``[first key, key_end)``, where ``key_end`` (one past the last query whose range
  reaches a key, derived on the host from ``starts`` and ``valid``) bounds the loop;
  query rows, ``dO`` rows, ``lse``, ``D`` and starts are staged in shared memory.

Every cell is written by exactly one thread: no atomics, and results do not depend on
scheduling. Tile sizes are module constants; tests under the CUDA simulator pass
smaller ones. These are the default kernels (``kernel="per_query"``); ``kernel="tiled"``
hands the same device views to :mod:`~streampack.kernels.attention_tiled`.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, int64

from .attention_plan import key_query_end

#: Queries per block (threads per block in the forward and dq kernels).
TILE_Q = 64
#: Shared-memory budget for one staged tile pair, in bytes (static limit is 48 KiB).
SHARED_BYTES = 32 * 1024


def key_tile(head_dim: int, itemsize: int) -> int:
    """Keys per staged tile: two ``[tile, head_dim]`` arrays fit in ``SHARED_BYTES``."""
    return int(max(1, min(64, SHARED_BYTES // (2 * head_dim * itemsize))))


def _sources(dtype_name: str, dim: int, tile_q: int, tile_k: int) -> dict[str, Any]:
    """The three kernels as plain Python functions, specialised by closure constants."""
    acc_t = float32 if dtype_name == "float32" else float64
    neg_inf = -math.inf

    def forward_kernel(q, k, v, starts, valid, heads, scale, out, lse):
        rh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        r = rh // heads
        capacity = starts.shape[1]
        base = rh * capacity
        qi = cuda.blockIdx.y * tile_q + t
        n_valid = valid[r]
        active = qi < n_valid
        sk = cuda.shared.array((tile_k, dim), acc_t)
        sv = cuda.shared.array((tile_k, dim), acc_t)
        lows = cuda.shared.array(tile_q, int32)
        bounds = cuda.shared.array(2, int32)
        low = capacity
        if active:
            low = starts[r, qi]
        lows[t] = low
        cuda.syncthreads()
        if t == 0:
            smallest = capacity
            for i in range(tile_q):
                smallest = min(smallest, lows[i])
            bounds[0] = smallest
            bounds[1] = min(cuda.blockIdx.y * tile_q + tile_q, n_valid)
        cuda.syncthreads()
        k_lo = bounds[0]
        k_hi = bounds[1]
        qrow = cuda.local.array(dim, acc_t)
        acc = cuda.local.array(dim, acc_t)
        scores = cuda.local.array(tile_k, acc_t)
        for d in range(dim):
            qrow[d] = q[base + qi, d] * scale if active else 0.0
            acc[d] = 0.0
        row_max = acc_t(neg_inf)
        row_sum = acc_t(0.0)
        for k0 in range(k_lo, k_hi, tile_k):
            for j in range(t, tile_k, tile_q):
                if k0 + j < k_hi:
                    for d in range(dim):
                        sk[j, d] = k[base + k0 + j, d]
                        sv[j, d] = v[base + k0 + j, d]
            cuda.syncthreads()
            if active:
                j_lo = max(low - k0, 0)
                j_hi = min(qi - k0 + 1, tile_k)
                # scores of the tile first, so the accumulator is rescaled once per tile
                tile_max = row_max
                for j in range(j_lo, j_hi):
                    s = acc_t(0.0)
                    for d in range(dim):
                        s += qrow[d] * sk[j, d]
                    scores[j] = s
                    tile_max = max(tile_max, s)
                if j_hi > j_lo and tile_max > row_max:
                    alpha = math.exp(row_max - tile_max)
                    row_sum *= alpha
                    for d in range(dim):
                        acc[d] *= alpha
                    row_max = tile_max
                for j in range(j_lo, j_hi):
                    p = math.exp(scores[j] - row_max)
                    row_sum += p
                    for d in range(dim):
                        acc[d] += p * sv[j, d]
            cuda.syncthreads()
        if qi < capacity:
            if active:
                inv = 1.0 / row_sum
                for d in range(dim):
                    out[base + qi, d] = acc[d] * inv
                lse[rh, qi] = row_max + math.log(row_sum)
            else:
                for d in range(dim):
                    out[base + qi, d] = 0.0
                lse[rh, qi] = neg_inf

    def dq_kernel(q, k, v, out, lse, d_out, starts, valid, heads, scale, dq, delta):
        rh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        r = rh // heads
        capacity = starts.shape[1]
        base = rh * capacity
        qi = cuda.blockIdx.y * tile_q + t
        n_valid = valid[r]
        active = qi < n_valid
        sk = cuda.shared.array((tile_k, dim), acc_t)
        sv = cuda.shared.array((tile_k, dim), acc_t)
        lows = cuda.shared.array(tile_q, int32)
        bounds = cuda.shared.array(2, int32)
        low = capacity
        if active:
            low = starts[r, qi]
        lows[t] = low
        cuda.syncthreads()
        if t == 0:
            smallest = capacity
            for i in range(tile_q):
                smallest = min(smallest, lows[i])
            bounds[0] = smallest
            bounds[1] = min(cuda.blockIdx.y * tile_q + tile_q, n_valid)
        cuda.syncthreads()
        k_lo = bounds[0]
        k_hi = bounds[1]
        qrow = cuda.local.array(dim, acc_t)
        grow = cuda.local.array(dim, acc_t)
        acc = cuda.local.array(dim, acc_t)
        dlt = acc_t(0.0)
        shift = acc_t(0.0)
        for d in range(dim):
            acc[d] = 0.0
            qrow[d] = 0.0
            grow[d] = 0.0
            if active:
                qrow[d] = q[base + qi, d]
                grow[d] = d_out[base + qi, d]
                dlt += grow[d] * out[base + qi, d]
        if active:
            shift = lse[rh, qi]
        for k0 in range(k_lo, k_hi, tile_k):
            for j in range(t, tile_k, tile_q):
                if k0 + j < k_hi:
                    for d in range(dim):
                        sk[j, d] = k[base + k0 + j, d]
                        sv[j, d] = v[base + k0 + j, d]
            cuda.syncthreads()
            if active:
                j_lo = max(low - k0, 0)
                j_hi = min(qi - k0 + 1, tile_k)
                for j in range(j_lo, j_hi):
                    s = acc_t(0.0)
                    dp = acc_t(0.0)
                    for d in range(dim):
                        s += qrow[d] * sk[j, d]
                        dp += grow[d] * sv[j, d]
                    p = math.exp(s * scale - shift)
                    ds = p * (dp - dlt) * scale
                    for d in range(dim):
                        acc[d] += ds * sk[j, d]
            cuda.syncthreads()
        if qi < capacity:
            for d in range(dim):
                dq[base + qi, d] = acc[d]
            delta[rh, qi] = dlt

    def dkdv_kernel(q, k, v, lse, d_out, delta, starts, valid, key_end, heads, scale, dk, dv):
        rh = cuda.blockIdx.x
        t = cuda.threadIdx.x
        r = rh // heads
        capacity = starts.shape[1]
        base = rh * capacity
        k0 = cuda.blockIdx.y * tile_k
        kj = k0 + t
        n_valid = valid[r]
        active = kj < n_valid
        sq = cuda.shared.array((tile_k, dim), acc_t)
        sg = cuda.shared.array((tile_k, dim), acc_t)
        s_lse = cuda.shared.array(tile_k, acc_t)
        s_delta = cuda.shared.array(tile_k, acc_t)
        s_low = cuda.shared.array(tile_k, int32)
        ends = cuda.shared.array(tile_k, int32)
        bounds = cuda.shared.array(1, int32)
        ends[t] = key_end[r, kj] if active else 0
        cuda.syncthreads()
        if t == 0:
            largest = 0
            for i in range(tile_k):
                largest = max(largest, ends[i])
            bounds[0] = largest
        cuda.syncthreads()
        q_hi = bounds[0]
        krow = cuda.local.array(dim, acc_t)
        vrow = cuda.local.array(dim, acc_t)
        dk_acc = cuda.local.array(dim, acc_t)
        dv_acc = cuda.local.array(dim, acc_t)
        for d in range(dim):
            dk_acc[d] = 0.0
            dv_acc[d] = 0.0
            krow[d] = k[base + kj, d] if active else 0.0
            vrow[d] = v[base + kj, d] if active else 0.0
        for a0 in range(k0, q_hi, tile_k):
            # q_hi <= n_valid: every staged query is active
            for i in range(t, tile_k, tile_k):
                if a0 + i < q_hi:
                    for d in range(dim):
                        sq[i, d] = q[base + a0 + i, d]
                        sg[i, d] = d_out[base + a0 + i, d]
                    s_lse[i] = lse[rh, a0 + i]
                    s_delta[i] = delta[rh, a0 + i]
                    s_low[i] = starts[r, a0 + i]
            cuda.syncthreads()
            if active:
                for i in range(min(tile_k, q_hi - a0)):
                    qi = a0 + i
                    if s_low[i] <= kj and kj <= qi:
                        s = acc_t(0.0)
                        dp = acc_t(0.0)
                        for d in range(dim):
                            s += sq[i, d] * krow[d]
                            dp += sg[i, d] * vrow[d]
                        p = math.exp(s * scale - s_lse[i])
                        ds = p * (dp - s_delta[i]) * scale
                        for d in range(dim):
                            dv_acc[d] += p * sg[i, d]
                            dk_acc[d] += ds * sq[i, d]
            cuda.syncthreads()
        if kj < capacity:
            for d in range(dim):
                dk[base + kj, d] = dk_acc[d]
                dv[base + kj, d] = dv_acc[d]

    return {"forward": forward_kernel, "dq": dq_kernel, "dkdv": dkdv_kernel}


def signatures(dtype_name: str) -> dict[str, tuple]:
    """Explicit argument types of each kernel (2-D C-contiguous views), for ``compile_ptx``."""
    f = float32 if dtype_name == "float32" else float64
    mat = f[:, ::1]
    starts = int32[:, ::1]
    vec = int32[::1]
    return {
        "forward": (mat, mat, mat, starts, vec, int64, f, mat, mat),
        "dq": (mat, mat, mat, mat, mat, mat, starts, vec, int64, f, mat, mat),
        "dkdv": (mat, mat, mat, mat, mat, mat, starts, vec, starts, int64, f, mat, mat),
    }


@cache
def _kernels(dtype_name: str, dim: int, tile_q: int, tile_k: int) -> dict[str, Any]:
    return {name: cuda.jit(fn) for name, fn in _sources(dtype_name, dim, tile_q, tile_k).items()}


def compile_ptx(
    dtype_name: str, dim: int, cc: tuple[int, int], tiles: tuple[int, int] | None = None
) -> dict[str, str]:
    """PTX of every kernel for compute capability ``cc`` (no GPU needed, only NVVM)."""
    itemsize = np.dtype(dtype_name).itemsize
    tile_q, tile_k = tiles or (TILE_Q, key_tile(dim, itemsize))
    sigs = signatures(dtype_name)
    return {
        name: cuda.compile_ptx(fn, sigs[name], cc=cc)[0]
        for name, fn in _sources(dtype_name, dim, tile_q, tile_k).items()
    }


def _device_2d(name: str, x: Any, rows: int, cols: int) -> Any:
    """A C-contiguous 2-D device view of ``x`` (copied to the device if it is on the host)."""
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "copy_to_host"):
        arr = cuda.as_cuda_array(x) if hasattr(x, "__cuda_array_interface__") else x
        if not arr.is_c_contiguous():
            from ..errors import InvalidArray

            raise InvalidArray(
                f"{name} is a non-contiguous CUDA array (strides {arr.strides}); accepted: "
                "C-contiguous device arrays (call .contiguous() first) or host arrays"
            )
    else:
        arr = cuda.to_device(np.ascontiguousarray(x))
    return arr.reshape(rows, cols)


def _plan(shape: tuple[int, ...], dtype: np.dtype, tiles: tuple[int, int] | None):
    rows, heads, capacity, dim = shape
    tile_q, tile_k = tiles or (TILE_Q, key_tile(dim, dtype.itemsize))
    return rows, heads, capacity, dim, tile_q, tile_k


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(x, "__cuda_array_interface__"):
        iface = x.__cuda_array_interface__
        return tuple(iface["shape"]), np.dtype(iface["typestr"])
    if hasattr(x, "copy_to_host"):
        return tuple(x.shape), np.dtype(x.dtype)
    arr = np.asarray(x)
    return arr.shape, arr.dtype


def forward(
    q: Any,
    k: Any,
    v: Any,
    starts: np.ndarray,
    valid: np.ndarray,
    scale: float,
    tiles: tuple[int, int] | None = None,
    *,
    kernel: str = "per_query",
    precision: str = "exact",
) -> tuple[Any, Any]:
    """Launch the forward kernel (``kernel="tiled"``: :mod:`.attention_tiled`'s);
    returns device arrays ``(out, lse)``."""
    shape, dtype = _shape_dtype(q)
    rows, heads, capacity, dim, tile_q, tile_k = _plan(shape, dtype, tiles)
    n = rows * heads * capacity
    if kernel == "tiled":
        from . import attention_tiled

        views = {name: _device_2d(name, x, n, dim) for name, x in (("q", q), ("k", k), ("v", v))}
        return attention_tiled.forward(views, shape, dtype, starts, valid, scale, precision, tiles)
    out = cuda.device_array(shape, dtype)
    lse = cuda.device_array((rows, heads, capacity), dtype)
    if n == 0:
        return out, lse
    kern = _kernels(dtype.name, dim, tile_q, tile_k)["forward"]
    grid = (rows * heads, (capacity + tile_q - 1) // tile_q)
    kern[grid, tile_q](
        _device_2d("q", q, n, dim),
        _device_2d("k", k, n, dim),
        _device_2d("v", v, n, dim),
        cuda.to_device(starts),
        cuda.to_device(valid),
        heads,
        dtype.type(scale),
        out.reshape(n, dim),
        lse.reshape(rows * heads, capacity),
    )
    return out, lse


def backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    d_out: Any,
    starts: np.ndarray,
    valid: np.ndarray,
    scale: float,
    tiles: tuple[int, int] | None = None,
    *,
    kernel: str = "per_query",
) -> tuple[Any, Any, Any]:
    """Launch the dq kernel then the dk/dv kernel (``kernel="tiled"``:
    :mod:`.attention_tiled`'s); returns device arrays ``(dq, dk, dv)``."""
    shape, dtype = _shape_dtype(q)
    rows, heads, capacity, dim, tile_q, tile_k = _plan(shape, dtype, tiles)
    n = rows * heads * capacity
    if kernel == "tiled":
        from . import attention_tiled

        named = (("q", q), ("k", k), ("v", v), ("out", out), ("d_out", d_out))
        views = {name: _device_2d(name, x, n, dim) for name, x in named}
        views["lse"] = _device_2d("lse", lse, rows * heads, capacity)
        return attention_tiled.backward(views, shape, dtype, starts, valid, scale, tiles)
    dq = cuda.device_array(shape, dtype)
    dk = cuda.device_array(shape, dtype)
    dv = cuda.device_array(shape, dtype)
    if n == 0:
        return dq, dk, dv
    key_end = np.empty((rows, capacity), np.int32)
    key_query_end(starts, valid, key_end)
    kernels = _kernels(dtype.name, dim, tile_q, tile_k)
    d_q, d_k, d_v = (_device_2d(nm, x, n, dim) for nm, x in (("q", q), ("k", k), ("v", v)))
    d_o = _device_2d("out", out, n, dim)
    d_g = _device_2d("d_out", d_out, n, dim)
    d_lse = _device_2d("lse", lse, rows * heads, capacity)
    d_starts, d_valid = cuda.to_device(starts), cuda.to_device(valid)
    delta = cuda.device_array((rows * heads, capacity), dtype)
    typed_scale = dtype.type(scale)
    grid_q = (rows * heads, (capacity + tile_q - 1) // tile_q)
    kernels["dq"][grid_q, tile_q](
        d_q,
        d_k,
        d_v,
        d_o,
        d_lse,
        d_g,
        d_starts,
        d_valid,
        heads,
        typed_scale,
        dq.reshape(n, dim),
        delta,
    )
    grid_k = (rows * heads, (capacity + tile_k - 1) // tile_k)
    kernels["dkdv"][grid_k, tile_k](
        d_q,
        d_k,
        d_v,
        d_lse,
        d_g,
        delta,
        d_starts,
        d_valid,
        cuda.to_device(key_end),
        heads,
        typed_scale,
        dk.reshape(n, dim),
        dv.reshape(n, dim),
    )
    return dq, dk, dv
