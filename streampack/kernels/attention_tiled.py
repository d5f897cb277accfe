"""Tiled range attention on CUDA (FlashAttention-2 style): exact and TF32 kernels.

Selected with ``kernel="tiled"`` (and ``precision="tf32"`` for the tensor-core
forward); :mod:`streampack.kernels.attention_cuda` stays the default until GPU
measurements show these faster. Query ``q < valid[r]`` of row ``r`` may use keys
``[starts[r, q], q]`` (rule C6).

**Exact kernels** (float32 or float64 throughout, FMAs on the CUDA cores). A block
(CTA) owns ``BM`` consecutive queries of one ``(row, head)``; its threads form
``BM / RM`` groups of ``LANES = 8``, and thread ``(g, c)`` owns a register tile: queries
``g * RM + i`` (``i < RM``) against keys ``c + 8 j`` (``j < RN = BN / 8``) of the key
tile, and output columns ``c + 8 dd``::

                 keys of the tile (BN)            one pass per key tile [k0, k0 + BN):
             c=0 c=1 ... c=7 c=0 c=1 ...          1. stage K, V rows in shared memory
    g=0  i=0 [s] [s]     [s] [s] [s]              2. s = (scale q) . k over head_dim,
         i=1 [s] [s]     [s] [s] [s]                 q rows from shared memory
    g=1  i=0  .   .                               3. mask (boundary tiles only), row max
     ...                                             through shared memory, exp, rescale
                                                  4. P to shared memory, acc += P V

Key tiles start at ``lo``, the smallest start of the block's active queries, and stop
at ``hi``, one past its last active query (:func:`~streampack.kernels.attention_plan.tile_bounds`):
the tiles outside are fully masked and never loaded. A tile inside every query's range
(``max start <= k0``, ``k0 + BN <= first query + 1``, every query active) skips the
mask. Row statistics are reduced through a small shared array rather than warp
shuffles, so the simulator runs the very code a GPU runs. Padding queries output 0 and
``lse = -inf``.

Backward, probabilities recomputed from ``lse``, two kernels and no atomics (every cell
written by one thread): ``dq`` per query block over its key tiles (``ds = p (dp - D)``,
``D = dO . out`` computed there and saved), then ``dk``/``dv`` per key block over the
aligned query tiles that can see it (``lo <= last key`` and ``hi > first key`` of that
query tile's bounds), with keys as the register tile's rows and queries as its columns.

**TF32 forward** (``precision="tf32"``, float32 only): each warp owns 16 queries; ``S =
Q K^T`` and ``O += P V`` are ``mma.sync.m16n8k8`` products
(:mod:`~streampack.kernels.attention_mma`) with the softmax in float32 on the
accumulator fragments; the same tile bounds, skipping and masking. The backward of a
TF32 forward is the exact backward.

Tile sizes are chosen per kernel to fit 48 KiB of static shared memory
(:func:`tiles_for`); tests under the simulator pass small ones (``tiles``).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int32, int64

from ..errors import InvalidConfig
from .attention_mma import (
    a_col_d,
    a_from_c_d,
    a_row_d,
    b_col_d,
    b_row_d,
    c_col_d,
    c_row_d,
    pv_key_d,
)
from .attention_mma import mma as _mma
from .attention_plan import tile_bounds

#: Threads of a group that share one query row (the columns of a register tile).
LANES = 8
#: Static shared memory per block, in bytes.
SHARED_LIMIT = 48 * 1024
#: Largest query tile x key tile first, halved until a kernel's arrays fit.
_CANDIDATES = ((64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8))
KERNELS = ("forward", "dq", "dkdv", "forward_tf32")


def threads(rows: int) -> int:
    """Threads of an exact kernel's block whose register tiles cover ``rows`` rows: four
    rows each, and at least one warp."""
    return max(32, rows * LANES // 4)


def _shared_bytes(kernel: str, rows: int, cols: int, dim: int, itemsize: int) -> int:
    padded = dim + 1
    if kernel == "forward":
        cells = rows * padded + cols * padded + cols * dim + rows * (cols + 1) + rows * LANES
    elif kernel == "dq":
        cells = 2 * rows * padded + 2 * cols * padded + rows * (cols + 1) + rows * LANES
    elif kernel == "dkdv":
        cells = 2 * rows * padded + 2 * cols * padded + 2 * rows * (cols + 1) + 3 * cols
    else:  # forward_tf32: K and V tiles, rows padded by 4 words (no bank conflicts)
        cells = 2 * cols * (-(-dim // 8) * 8 + 4) + rows * 4
    return cells * itemsize


def tiles_for(kernel: str, dim: int, itemsize: int) -> tuple[int, int]:
    """``(rows, cols)`` of a kernel's tiles: queries x keys for ``forward``/``dq``/
    ``forward_tf32``, keys x queries for ``dkdv``."""
    candidates = [(64, c) for c in (64, 32, 16, 8)] if kernel == "forward_tf32" else _CANDIDATES
    for rows, cols in candidates:
        if _shared_bytes(kernel, rows, cols, dim, itemsize) <= SHARED_LIMIT:
            return rows, cols
    largest = max(
        d
        for d in range(1, 1024)
        if _shared_bytes(kernel, *candidates[-1], d, itemsize) <= SHARED_LIMIT
    )
    raise InvalidConfig(
        f"head_dim {dim} is too large for kernel='tiled' ({kernel} in {8 * itemsize}-bit "
        f"floats fits head_dim up to {largest} in shared memory); accepted: a smaller "
        "head_dim, or kernel='per_query'"
    )


def check_tiles(kernel: str, rows: int, cols: int) -> None:
    """Tile sizes a kernel can take (tests pass small ones)."""
    if kernel == "forward_tf32":
        ok = rows in (16, 32, 48, 64) and cols % 8 == 0 and cols > 0
        want = "rows 16, 32, 48 or 64 (warps of 16 queries) and cols a multiple of 8"
    else:
        ok = rows >= 4 and rows & (rows - 1) == 0 and cols % LANES == 0 and cols > 0
        want = "rows a power of two from 4, cols a multiple of 8"
    if not ok:
        raise ValueError(f"tiles ({rows}, {cols}) for {kernel}; accepted: {want}")


def _exact_sources(dtype_name: str, dim: int, bm: int, bn: int) -> dict[str, Any]:
    """The exact kernels for query/key tiles ``bm`` x ``bn`` (``dkdv``: keys x queries)."""
    acc_t = float32 if dtype_name == "float32" else float64
    neg_inf = -math.inf
    nt = threads(bm)
    rm = bm * LANES // nt
    rn = bn // LANES
    rd = -(-dim // LANES)
    dp = dim + 1  # padded rows: the lanes of a group read 8 different rows at once
    bn1 = bn + 1  # shapes of shared arrays must be constants, not expressions

    def forward(q, k, v, starts, bounds, heads, scale, out, lse):
        rh = cuda.blockIdx.x
        tile = cuda.blockIdx.y
        r = rh // heads
        t = cuda.threadIdx.x
        g = t // LANES
        c = t % LANES
        capacity = starts.shape[1]
        base = rh * capacity
        q0 = tile * bm
        k_lo = bounds[r, tile, 0]
        k_hi = bounds[r, tile, 1]
        full_lo = bounds[r, tile, 2]
        full_hi = bounds[r, tile, 3]
        sq = cuda.shared.array((bm, dp), acc_t)
        sk = cuda.shared.array((bn, dp), acc_t)
        sv = cuda.shared.array((bn, dim), acc_t)
        sp = cuda.shared.array((bm, bn1), acc_t)
        red = cuda.shared.array((bm, LANES), acc_t)
        for idx in range(t, bm * dim, nt):
            i = idx // dim
            d = idx - i * dim
            sq[i, d] = q[base + q0 + i, d] * scale if q0 + i < k_hi else acc_t(0.0)
        low = cuda.local.array(rm, int32)
        row_max = cuda.local.array(rm, acc_t)
        row_sum = cuda.local.array(rm, acc_t)
        acc = cuda.local.array((rm, rd), acc_t)
        s = cuda.local.array((rm, rn), acc_t)
        kv = cuda.local.array(rn, acc_t)
        vv = cuda.local.array(rd, acc_t)
        for i in range(rm):
            qi = q0 + g * rm + i
            # an inactive query's range is empty: no key is at or after `capacity`
            low[i] = starts[r, qi] if qi < k_hi else capacity
            row_max[i] = neg_inf
            row_sum[i] = 0.0
            for dd in range(rd):
                acc[i, dd] = 0.0
        for k0 in range(k_lo, k_hi, bn):
            cuda.syncthreads()  # q staged; the previous tile's readers are done
            for idx in range(t, bn * dim, nt):
                j = idx // dim
                d = idx - j * dim
                inside = k0 + j < k_hi
                sk[j, d] = k[base + k0 + j, d] if inside else acc_t(0.0)
                sv[j, d] = v[base + k0 + j, d] if inside else acc_t(0.0)
            cuda.syncthreads()
            interior = full_lo <= k0 and k0 + bn <= full_hi
            for i in range(rm):
                for j in range(rn):
                    s[i, j] = 0.0
            for d in range(dim):
                for j in range(rn):
                    kv[j] = sk[c + LANES * j, d]
                for i in range(rm):
                    qd = sq[g * rm + i, d]
                    for j in range(rn):
                        s[i, j] += qd * kv[j]
            for i in range(rm):
                qi = q0 + g * rm + i
                m = row_max[i]
                for j in range(rn):
                    key = k0 + c + LANES * j
                    if not interior and (key < low[i] or key > qi):
                        s[i, j] = neg_inf
                    m = max(m, s[i, j])
                red[g * rm + i, c] = m
            cuda.syncthreads()
            for i in range(rm):
                row = g * rm + i
                m = red[row, 0]
                for x in range(1, LANES):
                    m = max(m, red[row, x])
                if m == neg_inf:  # nothing of this row seen yet
                    for j in range(rn):
                        sp[row, c + LANES * j] = 0.0
                else:
                    alpha = math.exp(row_max[i] - m)
                    part = acc_t(0.0)
                    for j in range(rn):
                        p = math.exp(s[i, j] - m)
                        sp[row, c + LANES * j] = p
                        part += p
                    row_sum[i] = row_sum[i] * alpha + part
                    row_max[i] = m
                    for dd in range(rd):
                        acc[i, dd] *= alpha
            cuda.syncthreads()
            for j in range(min(bn, k_hi - k0)):
                for dd in range(rd):
                    d = c + LANES * dd
                    vv[dd] = sv[j, d] if d < dim else acc_t(0.0)
                for i in range(rm):
                    p = sp[g * rm + i, j]
                    for dd in range(rd):
                        acc[i, dd] += p * vv[dd]
        cuda.syncthreads()
        for i in range(rm):
            red[g * rm + i, c] = row_sum[i]  # each thread's share of the row sum
        cuda.syncthreads()
        for i in range(rm):
            row = g * rm + i
            qi = q0 + row
            if qi < capacity:
                total = acc_t(0.0)
                for x in range(LANES):
                    total += red[row, x]
                active = qi < k_hi
                inv = acc_t(1.0) / total if active else acc_t(0.0)
                for dd in range(rd):
                    d = c + LANES * dd
                    if d < dim:
                        out[base + qi, d] = acc[i, dd] * inv
                if c == 0:
                    lse[rh, qi] = row_max[i] + math.log(total) if active else acc_t(neg_inf)

    def dq_kernel(q, k, v, out, lse, d_out, starts, bounds, heads, scale, dq, delta):
        rh = cuda.blockIdx.x
        tile = cuda.blockIdx.y
        r = rh // heads
        t = cuda.threadIdx.x
        g = t // LANES
        c = t % LANES
        capacity = starts.shape[1]
        base = rh * capacity
        q0 = tile * bm
        k_lo = bounds[r, tile, 0]
        k_hi = bounds[r, tile, 1]
        full_lo = bounds[r, tile, 2]
        full_hi = bounds[r, tile, 3]
        sq = cuda.shared.array((bm, dp), acc_t)
        sg = cuda.shared.array((bm, dp), acc_t)
        sk = cuda.shared.array((bn, dp), acc_t)
        sv = cuda.shared.array((bn, dp), acc_t)
        sds = cuda.shared.array((bm, bn1), acc_t)
        red = cuda.shared.array((bm, LANES), acc_t)
        for idx in range(t, bm * dim, nt):
            i = idx // dim
            d = idx - i * dim
            inside = q0 + i < k_hi
            sq[i, d] = q[base + q0 + i, d] if inside else acc_t(0.0)
            sg[i, d] = d_out[base + q0 + i, d] if inside else acc_t(0.0)
        low = cuda.local.array(rm, int32)
        shift = cuda.local.array(rm, acc_t)
        dlt = cuda.local.array(rm, acc_t)
        acc = cuda.local.array((rm, rd), acc_t)
        s = cuda.local.array((rm, rn), acc_t)
        dpv = cuda.local.array((rm, rn), acc_t)
        kv = cuda.local.array(rn, acc_t)
        vv = cuda.local.array(rn, acc_t)
        kd = cuda.local.array(rd, acc_t)
        for i in range(rm):
            qi = q0 + g * rm + i
            active = qi < k_hi
            low[i] = starts[r, qi] if active else capacity
            shift[i] = lse[rh, qi] if active else acc_t(0.0)
            part = acc_t(0.0)
            for dd in range(rd):
                acc[i, dd] = 0.0
                d = c + LANES * dd
                if active and d < dim:
                    part += d_out[base + qi, d] * out[base + qi, d]
            red[g * rm + i, c] = part
        cuda.syncthreads()
        for i in range(rm):
            total = acc_t(0.0)
            for x in range(LANES):
                total += red[g * rm + i, x]
            dlt[i] = total
        for k0 in range(k_lo, k_hi, bn):
            cuda.syncthreads()
            for idx in range(t, bn * dim, nt):
                j = idx // dim
                d = idx - j * dim
                inside = k0 + j < k_hi
                sk[j, d] = k[base + k0 + j, d] if inside else acc_t(0.0)
                sv[j, d] = v[base + k0 + j, d] if inside else acc_t(0.0)
            cuda.syncthreads()
            interior = full_lo <= k0 and k0 + bn <= full_hi
            for i in range(rm):
                for j in range(rn):
                    s[i, j] = 0.0
                    dpv[i, j] = 0.0
            for d in range(dim):
                for j in range(rn):
                    kv[j] = sk[c + LANES * j, d]
                    vv[j] = sv[c + LANES * j, d]
                for i in range(rm):
                    qd = sq[g * rm + i, d]
                    gd = sg[g * rm + i, d]
                    for j in range(rn):
                        s[i, j] += qd * kv[j]
                        dpv[i, j] += gd * vv[j]
            for i in range(rm):
                qi = q0 + g * rm + i
                for j in range(rn):
                    key = k0 + c + LANES * j
                    ds = acc_t(0.0)
                    if interior or (low[i] <= key and key <= qi):
                        p = math.exp(s[i, j] * scale - shift[i])
                        ds = p * (dpv[i, j] - dlt[i]) * scale
                    sds[g * rm + i, c + LANES * j] = ds
            cuda.syncthreads()
            for j in range(min(bn, k_hi - k0)):
                for dd in range(rd):
                    d = c + LANES * dd
                    kd[dd] = sk[j, d] if d < dim else acc_t(0.0)
                for i in range(rm):
                    w = sds[g * rm + i, j]
                    for dd in range(rd):
                        acc[i, dd] += w * kd[dd]
        for i in range(rm):
            qi = q0 + g * rm + i
            if qi < capacity:
                for dd in range(rd):
                    d = c + LANES * dd
                    if d < dim:
                        dq[base + qi, d] = acc[i, dd]
                if c == 0:
                    delta[rh, qi] = dlt[i]

    def dkdv_kernel(q, k, v, lse, d_out, delta, starts, valid, bounds, heads, scale, dk, dv):
        # rows of the register tiles are keys (bm of them), columns queries (bn)
        rh = cuda.blockIdx.x
        r = rh // heads
        t = cuda.threadIdx.x
        g = t // LANES
        c = t % LANES
        capacity = starts.shape[1]
        base = rh * capacity
        k0 = cuda.blockIdx.y * bm
        n_valid = valid[r]
        sk = cuda.shared.array((bm, dp), acc_t)
        sv = cuda.shared.array((bm, dp), acc_t)
        sq = cuda.shared.array((bn, dp), acc_t)
        sg = cuda.shared.array((bn, dp), acc_t)
        sp = cuda.shared.array((bm, bn1), acc_t)
        sds = cuda.shared.array((bm, bn1), acc_t)
        s_lse = cuda.shared.array(bn, acc_t)
        s_dlt = cuda.shared.array(bn, acc_t)
        s_low = cuda.shared.array(bn, int32)
        for idx in range(t, bm * dim, nt):
            j = idx // dim
            d = idx - j * dim
            inside = k0 + j < n_valid
            sk[j, d] = k[base + k0 + j, d] if inside else acc_t(0.0)
            sv[j, d] = v[base + k0 + j, d] if inside else acc_t(0.0)
        dk_acc = cuda.local.array((rm, rd), acc_t)
        dv_acc = cuda.local.array((rm, rd), acc_t)
        s = cuda.local.array((rm, rn), acc_t)
        dpv = cuda.local.array((rm, rn), acc_t)
        qv = cuda.local.array(rn, acc_t)
        gv = cuda.local.array(rn, acc_t)
        qd = cuda.local.array(rd, acc_t)
        gd = cuda.local.array(rd, acc_t)
        for i in range(rm):
            for dd in range(rd):
                dk_acc[i, dd] = 0.0
                dv_acc[i, dd] = 0.0
        k_last = k0 + bm - 1
        for tq in range(k0 // bn, bounds.shape[1]):
            q_lo = bounds[r, tq, 0]
            q_hi = bounds[r, tq, 1]
            # the same for every thread: whether any query of the tile sees a key here
            if k0 < n_valid and q_lo <= k_last and q_hi > k0:
                a0 = tq * bn
                cuda.syncthreads()  # keys staged; the previous tile's readers are done
                for idx in range(t, bn * dim, nt):
                    i = idx // dim
                    d = idx - i * dim
                    inside = a0 + i < q_hi
                    sq[i, d] = q[base + a0 + i, d] if inside else acc_t(0.0)
                    sg[i, d] = d_out[base + a0 + i, d] if inside else acc_t(0.0)
                for i in range(t, bn, nt):
                    inside = a0 + i < q_hi
                    s_lse[i] = lse[rh, a0 + i] if inside else acc_t(0.0)
                    s_dlt[i] = delta[rh, a0 + i] if inside else acc_t(0.0)
                    s_low[i] = starts[r, a0 + i] if inside else capacity
                cuda.syncthreads()
                interior = bounds[r, tq, 2] <= k0 and k0 + bm <= bounds[r, tq, 3]
                for i in range(rm):
                    for j in range(rn):
                        s[i, j] = 0.0
                        dpv[i, j] = 0.0
                for d in range(dim):
                    for j in range(rn):
                        qv[j] = sq[c + LANES * j, d]
                        gv[j] = sg[c + LANES * j, d]
                    for i in range(rm):
                        kk = sk[g * rm + i, d]
                        vk = sv[g * rm + i, d]
                        for j in range(rn):
                            s[i, j] += kk * qv[j]
                            dpv[i, j] += vk * gv[j]
                for i in range(rm):
                    key = k0 + g * rm + i
                    for j in range(rn):
                        col = c + LANES * j
                        qi = a0 + col
                        p = acc_t(0.0)
                        ds = acc_t(0.0)
                        if interior or (s_low[col] <= key and key <= qi):
                            p = math.exp(s[i, j] * scale - s_lse[col])
                            ds = p * (dpv[i, j] - s_dlt[col]) * scale
                        sp[g * rm + i, col] = p
                        sds[g * rm + i, col] = ds
                cuda.syncthreads()
                for x in range(min(bn, q_hi - a0)):
                    for dd in range(rd):
                        d = c + LANES * dd
                        qd[dd] = sq[x, d] if d < dim else acc_t(0.0)
                        gd[dd] = sg[x, d] if d < dim else acc_t(0.0)
                    for i in range(rm):
                        pw = sp[g * rm + i, x]
                        dw = sds[g * rm + i, x]
                        for dd in range(rd):
                            dv_acc[i, dd] += pw * gd[dd]
                            dk_acc[i, dd] += dw * qd[dd]
        for i in range(rm):
            key = k0 + g * rm + i
            if key < capacity:
                for dd in range(rd):
                    d = c + LANES * dd
                    if d < dim:
                        dk[base + key, d] = dk_acc[i, dd]
                        dv[base + key, d] = dv_acc[i, dd]

    return {"forward": forward, "dq": dq_kernel, "dkdv": dkdv_kernel}


def _tf32_source(dim: int, bm: int, bn: int) -> Any:
    """The TF32 forward for query tiles of ``bm`` (16 per warp) and key tiles of ``bn``."""
    neg_inf = -math.inf
    nt = bm * 2  # 32 lanes per 16 queries
    kd = -(-dim // 8)  # head_dim in chunks of 8: the k of the first product
    nb = bn // 8  # the key tile in chunks of 8: the n of the first, the k of the second
    dp = kd * 8 + 4  # padded rows: the 32 lanes of a fragment load hit 32 banks
    width = kd * 8
    mma = _mma

    def forward_tf32(q, k, v, starts, bounds, heads, scale, out, lse):
        rh = cuda.blockIdx.x
        tile = cuda.blockIdx.y
        r = rh // heads
        t = cuda.threadIdx.x
        warp = t // 32
        lane = t % 32
        capacity = starts.shape[1]
        base = rh * capacity
        q0 = tile * bm
        qw = q0 + warp * 16
        k_lo = bounds[r, tile, 0]
        k_hi = bounds[r, tile, 1]
        full_lo = bounds[r, tile, 2]
        full_hi = bounds[r, tile, 3]
        sk = cuda.shared.array((bn, dp), float32)
        sv = cuda.shared.array((bn, dp), float32)
        red = cuda.shared.array((bm, 4), float32)
        qa = cuda.local.array((kd, 4), float32)
        o = cuda.local.array((kd, 4), float32)
        sf = cuda.local.array((nb, 4), float32)
        low = cuda.local.array(2, int32)
        row_max = cuda.local.array(2, float32)
        row_sum = cuda.local.array(2, float32)
        part_max = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        for x in range(kd):
            for i in range(4):
                qi = qw + a_row_d(lane, i)
                d = x * 8 + a_col_d(lane, i)
                qa[x, i] = q[base + qi, d] * scale if qi < k_hi and d < dim else float32(0.0)
                o[x, i] = 0.0
        for h in range(2):
            qi = qw + c_row_d(lane, 2 * h)
            low[h] = starts[r, qi] if qi < k_hi else capacity
            row_max[h] = neg_inf
            row_sum[h] = 0.0
        for k0 in range(k_lo, k_hi, bn):
            cuda.syncthreads()
            for idx in range(t, bn * width, nt):
                j = idx // width
                d = idx - j * width
                inside = k0 + j < k_hi and d < dim
                sk[j, d] = k[base + k0 + j, d] if inside else float32(0.0)
                sv[j, d] = v[base + k0 + j, d] if inside else float32(0.0)
            cuda.syncthreads()
            interior = full_lo <= k0 and k0 + bn <= full_hi
            for n in range(nb):  # S = Q K^T, B[k = dim, n = key] = K[key, dim]
                d0 = float32(0.0)
                d1 = float32(0.0)
                d2 = float32(0.0)
                d3 = float32(0.0)
                for x in range(kd):
                    b0 = sk[n * 8 + b_col_d(lane, 0), x * 8 + b_row_d(lane, 0)]
                    b1 = sk[n * 8 + b_col_d(lane, 1), x * 8 + b_row_d(lane, 1)]
                    d0, d1, d2, d3 = mma(
                        qa[x, 0], qa[x, 1], qa[x, 2], qa[x, 3], b0, b1, d0, d1, d2, d3
                    )
                sf[n, 0] = d0
                sf[n, 1] = d1
                sf[n, 2] = d2
                sf[n, 3] = d3
            for h in range(2):
                part_max[h] = row_max[h]
            for n in range(nb):
                for i in range(4):
                    qi = qw + c_row_d(lane, i)
                    key = k0 + n * 8 + c_col_d(lane, i)
                    h = i >> 1
                    if not interior and (key < low[h] or key > qi):
                        sf[n, i] = neg_inf
                    part_max[h] = max(part_max[h], sf[n, i])
            for h in range(2):
                red[warp * 16 + c_row_d(lane, 2 * h), lane & 3] = part_max[h]
            cuda.syncthreads()
            for h in range(2):
                row = warp * 16 + c_row_d(lane, 2 * h)
                m = max(max(red[row, 0], red[row, 1]), max(red[row, 2], red[row, 3]))
                alpha[h] = 1.0
                if m != neg_inf:
                    alpha[h] = math.exp(row_max[h] - m)
                    row_max[h] = m
                row_sum[h] *= alpha[h]
            for n in range(nb):
                for i in range(4):
                    h = i >> 1
                    p = float32(0.0)
                    if row_max[h] != neg_inf:
                        p = math.exp(sf[n, i] - row_max[h])
                    sf[n, i] = p
                    row_sum[h] += p
            for x in range(kd):
                for i in range(4):
                    o[x, i] *= alpha[i >> 1]
            for n in range(nb):  # O += P V, keys of the chunk numbered by pv_key
                a0 = sf[n, a_from_c_d(0)]
                a1 = sf[n, a_from_c_d(1)]
                a2 = sf[n, a_from_c_d(2)]
                a3 = sf[n, a_from_c_d(3)]
                for x in range(kd):
                    b0 = sv[n * 8 + pv_key_d(b_row_d(lane, 0)), x * 8 + b_col_d(lane, 0)]
                    b1 = sv[n * 8 + pv_key_d(b_row_d(lane, 1)), x * 8 + b_col_d(lane, 1)]
                    o[x, 0], o[x, 1], o[x, 2], o[x, 3] = mma(
                        a0, a1, a2, a3, b0, b1, o[x, 0], o[x, 1], o[x, 2], o[x, 3]
                    )
        cuda.syncthreads()
        for h in range(2):
            red[warp * 16 + c_row_d(lane, 2 * h), lane & 3] = row_sum[h]
        cuda.syncthreads()
        for h in range(2):
            row = warp * 16 + c_row_d(lane, 2 * h)
            qi = q0 + row
            if qi < capacity:
                total = (red[row, 0] + red[row, 1]) + (red[row, 2] + red[row, 3])
                active = qi < k_hi
                inv = float32(1.0) / total if active else float32(0.0)
                for x in range(kd):
                    for e in range(2):
                        d = x * 8 + c_col_d(lane, 2 * h + e)
                        if d < dim:
                            out[base + qi, d] = o[x, 2 * h + e] * inv
                if (lane & 3) == 0:
                    lse[rh, qi] = row_max[h] + math.log(total) if active else float32(neg_inf)

    return forward_tf32


def _source(kernel: str, dtype_name: str, dim: int, rows: int, cols: int) -> Any:
    if kernel == "forward_tf32":
        return _tf32_source(dim, rows, cols)
    return _exact_sources(dtype_name, dim, rows, cols)[kernel]


def block_threads(kernel: str, rows: int) -> int:
    return rows * 2 if kernel == "forward_tf32" else threads(rows)


def signature(kernel: str, dtype_name: str) -> tuple:
    """Argument types of a kernel (2-D C-contiguous views), for ``compile_ptx``."""
    f = float32 if dtype_name == "float32" else float64
    mat = f[:, ::1]
    starts = int32[:, ::1]
    bounds = int32[:, :, ::1]
    vec = int32[::1]
    return {
        "forward": (mat, mat, mat, starts, bounds, int64, f, mat, mat),
        "forward_tf32": (mat, mat, mat, starts, bounds, int64, f, mat, mat),
        "dq": (mat, mat, mat, mat, mat, mat, starts, bounds, int64, f, mat, mat),
        "dkdv": (mat, mat, mat, mat, mat, mat, starts, vec, bounds, int64, f, mat, mat),
    }[kernel]


@cache
def _kernel(kernel: str, dtype_name: str, dim: int, rows: int, cols: int) -> Any:
    return cuda.jit(_source(kernel, dtype_name, dim, rows, cols))


def _tiles(kernel: str, dim: int, dtype: np.dtype, tiles: tuple[int, int] | None):
    rows, cols = tiles or tiles_for(kernel, dim, dtype.itemsize)
    check_tiles(kernel, rows, cols)
    return rows, cols


def compile_ptx(
    kernel: str, dtype_name: str, dim: int, cc: tuple[int, int], tiles: tuple[int, int] | None
) -> str:
    """PTX of one kernel for compute capability ``cc`` (no GPU needed, only NVVM)."""
    rows, cols = _tiles(kernel, dim, np.dtype(dtype_name), tiles)
    fn = _source(kernel, dtype_name, dim, rows, cols)
    return cuda.compile_ptx(fn, signature(kernel, dtype_name), cc=cc)[0]


def _bounds(starts: np.ndarray, valid: np.ndarray, tile: int) -> Any:
    rows, capacity = starts.shape
    table = np.empty((rows, -(-capacity // tile), 4), np.int32)
    tile_bounds(starts, valid, tile, table)
    return cuda.to_device(table)


def forward(
    arrays: dict[str, Any],
    shape: tuple[int, ...],
    dtype: np.dtype,
    starts: np.ndarray,
    valid: np.ndarray,
    scale: float,
    precision: str,
    tiles: tuple[int, int] | None,
) -> tuple[Any, Any]:
    """Launch the tiled forward on 2-D device views ``arrays`` (``q``, ``k``, ``v``);
    returns device arrays ``(out, lse)`` shaped like ``q`` and ``[rows, heads, capacity]``."""
    rows, heads, capacity, dim = shape
    n = rows * heads * capacity
    out = cuda.device_array(shape, dtype)
    lse = cuda.device_array((rows, heads, capacity), dtype)
    if n == 0:
        return out, lse
    name = "forward_tf32" if precision == "tf32" else "forward"
    bm, bn = _tiles(name, dim, dtype, tiles)
    kern = _kernel(name, dtype.name, dim, bm, bn)
    grid = (rows * heads, -(-capacity // bm))
    kern[grid, block_threads(name, bm)](
        arrays["q"],
        arrays["k"],
        arrays["v"],
        cuda.to_device(starts),
        _bounds(starts, valid, bm),
        heads,
        dtype.type(scale),
        out.reshape(n, dim),
        lse.reshape(rows * heads, capacity),
    )
    return out, lse


def backward(
    arrays: dict[str, Any],
    shape: tuple[int, ...],
    dtype: np.dtype,
    starts: np.ndarray,
    valid: np.ndarray,
    scale: float,
    tiles: tuple[int, int] | None,
) -> tuple[Any, Any, Any]:
    """Launch the ``dq`` then the ``dk``/``dv`` kernel on 2-D device views ``arrays``
    (``q``, ``k``, ``v``, ``out``, ``d_out``, ``lse``); returns ``(dq, dk, dv)``."""
    rows, heads, capacity, dim = shape
    n = rows * heads * capacity
    dq = cuda.device_array(shape, dtype)
    dk = cuda.device_array(shape, dtype)
    dv = cuda.device_array(shape, dtype)
    if n == 0:
        return dq, dk, dv
    d_starts = cuda.to_device(starts)
    typed_scale = dtype.type(scale)
    delta = cuda.device_array((rows * heads, capacity), dtype)
    bm, bn = _tiles("dq", dim, dtype, tiles)
    _kernel("dq", dtype.name, dim, bm, bn)[(rows * heads, -(-capacity // bm)), threads(bm)](
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["out"],
        arrays["lse"],
        arrays["d_out"],
        d_starts,
        _bounds(starts, valid, bm),
        heads,
        typed_scale,
        dq.reshape(n, dim),
        delta,
    )
    km, kn = _tiles("dkdv", dim, dtype, tiles)
    _kernel("dkdv", dtype.name, dim, km, kn)[(rows * heads, -(-capacity // km)), threads(km)](
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["lse"],
        arrays["d_out"],
        delta,
        d_starts,
        cuda.to_device(valid),
        _bounds(starts, valid, kn),
        heads,
        typed_scale,
        dk.reshape(n, dim),
        dv.reshape(n, dim),
    )
    return dq, dk, dv
