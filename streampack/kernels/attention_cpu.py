"""Range-aware attention on the CPU: Numba kernels, forward and backward.

Pure functions over arrays. :mod:`streampack.kernels.attention` validates every input,
allocates every output (``out``/``dq``/``dk``/``dv`` zeroed, ``lse`` filled with -inf)
and plans the work; nothing here can fail on user data.

Query ``q`` of row ``r`` (``q < valid[r]``) may use keys ``[starts[r, q], q]`` (rule
C6). In one row of next-fit packing the picture is a staircase of triangles::

    keys ->   0 1 2 3 4 5 6 7        starts = [0 0 0 3 3 5 5 5], valid = 8
    q=0       x                      segment A: queries 0-2 see keys [0, q]
    q=1       x x                    segment B: queries 3-4 see keys [3, q]
    q=2       x x x                  segment C: queries 5-7 see keys [5, q]
    q=3             x
    q=4             x x
    q=5                 x
    q=6                 x x
    q=7                 x x x

Nothing outside the triangles is touched. Work is cut into **blocks**: a run of at most
``tile_q`` consecutive queries that stops before every segment start (a query with
``starts[q] == q``), so one block never mixes two segments of a packed row. A query
block ``[a, b)`` needs keys ``[min(starts[a:b]), b)``; those are taken ``tile_k`` at a
time, the scores of a chunk are one small GEMM (``np.dot``: Numba hands it to SciPy's BLAS),
the mask is applied per element only where a chunk crosses a range edge, and softmax
is online (running max and sum, rescaled per chunk). Each GEMM is at most
``64 * 64 * 64`` multiply-adds, which keeps OpenBLAS on the calling thread: above that
it starts its own thread pool, and nested under ``prange`` on 2 cores a 64x1024x64
product measured 3-30x slower than the same work done as 64x64x64 calls.

Parallelism: the planner deals tasks (query tiles for the forward, independent column
chunks of one ``(row, head)`` for the backward) into one bin per thread, longest first,
each to the least loaded bin; ``prange`` runs over bins. A task writes only its own
cells, so there are no races and no atomics, and the result does not depend on the thread count.

Backward (flash style): ``P`` is recomputed from the saved ``lse``; ``D = rowsum(dO*O)``.
For each key block ``[c, e)`` the queries that may see it are ``[c, key_end)`` where
``key_end`` (from :func:`key_query_end`) is one past the last query whose range reaches
the block; ``dK``/``dV`` of the block accumulate in scratch and are written once, while
``dQ`` accumulates in place — it belongs to the same task, a chunk of columns that no
range crosses (in a packed row, whole segments). This does five GEMMs per block pair
instead of the seven that separate dQ and dK/dV passes need.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

#: Queries per block (at most): the rows of every GEMM.
TILE_Q = 64
#: Multiply-adds per GEMM call at most; ``tile_k = GEMM_BUDGET // (TILE_Q * head_dim)``.
GEMM_BUDGET = 64 * 64 * 64

_LOG2E = 1.4426950408889634

#: Fast-math flags that keep IEEE infinities and NaNs (no ``nnan``/``ninf``) and libm's
#: exact functions (no ``afn``) but let LLVM reassociate sums, so row sums and the exp
#: loop vectorise.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def key_tile(head_dim: int) -> int:
    """Keys per chunk for ``head_dim``: as many as the GEMM budget allows (at least 1)."""
    return max(1, GEMM_BUDGET // (TILE_Q * max(head_dim, 1)))


@intrinsic
def _f32_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """Reinterpret the bits of an int32 as a float32 (builds ``2**n`` without libm)."""
    if bits != types.int32:
        return None
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def _exp_nonpositive(x):  # pragma: no cover - replaced by the overload below
    return math.exp(x)


@overload(_exp_nonpositive)
def _exp_nonpositive_impl(x):  # pragma: no cover - compiled
    """``exp(x)`` for ``x <= 0`` (softmax after max subtraction).

    float32: ``2**t`` with ``t = x log2(e)`` split into integer and fraction, a degree-5
    polynomial for the fraction (relative error below 2e-6, a few float32 ulps) and the
    exponent placed with a bit cast, so the loop vectorises; libm's ``expf`` would not
    and would cost more than the GEMMs. Results below ``2**-126`` flush to that bound,
    which softmax cannot tell from zero. float64 keeps ``math.exp``.
    """
    if x == types.float32:

        def impl(x):
            t = x * np.float32(_LOG2E)
            t = max(t, np.float32(-126.0))
            n = np.floor(t)
            f = t - n
            p = np.float32(1.8775767e-3)
            p = p * f + np.float32(8.9893397e-3)
            p = p * f + np.float32(5.5826318e-2)
            p = p * f + np.float32(2.4015361e-1)
            p = p * f + np.float32(6.9315308e-1)
            p = p * f + np.float32(9.9999994e-1)
            return p * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))

        return impl
    return lambda x: math.exp(x)


@njit(cache=True)
def _next_block(starts_row, a, stop, tile):  # pragma: no cover - compiled
    """End of the block that starts at ``a`` (before ``stop``) and its smallest start."""
    b = a + 1
    lowest = starts_row[a]
    limit = min(stop, a + tile)
    while b < limit and starts_row[b] != b:
        if starts_row[b] < lowest:
            lowest = starts_row[b]
        b += 1
    return b, lowest


@njit(cache=True)
def key_query_end(starts, valid, key_end):  # pragma: no cover - compiled
    """``key_end[r, k]`` = one past the last query that may use key ``k`` (``k`` if none).

    Queries are visited from the last down; query ``q`` claims the unclaimed keys of
    ``[starts[q], q]``. A key already claimed by a later query ``p`` lets the walk jump
    to ``starts[p] - 1``, since ``p`` claimed everything from there to the key. With
    contiguous segments every key is visited once.
    """
    rows, capacity = starts.shape
    owner = np.empty(capacity, np.int64)
    for r in range(rows):
        for key in range(capacity):
            key_end[r, key] = key
            owner[key] = -1
        for q in range(valid[r] - 1, -1, -1):
            key = q
            low = starts[r, q]
            while key >= low:
                p = owner[key]
                if p < 0:
                    owner[key] = q
                    key_end[r, key] = q + 1
                    key -= 1
                else:
                    key = min(key, starts[r, p]) - 1


@njit(cache=True)
def _deal(cost, n_bins):  # pragma: no cover - compiled
    """Longest task first into the least loaded bin; returns task order and bin offsets."""
    order = np.argsort(-cost, kind="mergesort")
    load = np.zeros(n_bins, np.float64)
    bin_of = np.empty(cost.shape[0], np.int64)
    for i in range(order.shape[0]):
        best = 0
        for b in range(1, n_bins):
            if load[b] < load[best]:
                best = b
        bin_of[order[i]] = best
        load[best] += cost[order[i]]
    offsets = np.zeros(n_bins + 1, np.int64)
    for t in range(cost.shape[0]):
        offsets[bin_of[t] + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    fill = offsets[:-1].copy()
    tasks = np.empty(cost.shape[0], np.int64)
    for t in range(cost.shape[0]):
        tasks[fill[bin_of[t]]] = t
        fill[bin_of[t]] += 1
    return tasks, offsets


@njit(cache=True)
def plan_forward(starts, valid, heads, tile_q, n_bins):  # pragma: no cover - compiled
    """Tasks ``(row * heads + head, first query)`` of every query tile that has work.

    Returns ``(task_rh, task_q0, order, offsets)``: bin ``b`` runs tasks
    ``order[offsets[b]:offsets[b + 1]]``. A tile's cost is its score cells, the sum
    over its blocks of ``queries * keys``.
    """
    rows, capacity = starts.shape
    n_tiles = (capacity + tile_q - 1) // tile_q
    tile_cost = np.zeros((rows, n_tiles), np.float64)
    count = 0
    for r in range(rows):
        for t in range(n_tiles):
            q0 = t * tile_q
            q1 = min(q0 + tile_q, valid[r])
            a = q0
            while a < q1:
                b, lowest = _next_block(starts[r], a, q1, tile_q)
                tile_cost[r, t] += (b - a) * (b - lowest) + 16.0
                a = b
            if tile_cost[r, t] > 0:
                count += heads
    task_rh = np.empty(count, np.int64)
    task_q0 = np.empty(count, np.int64)
    cost = np.empty(count, np.float64)
    i = 0
    for r in range(rows):
        for h in range(heads):
            for t in range(n_tiles):
                if tile_cost[r, t] > 0:
                    task_rh[i] = r * heads + h
                    task_q0[i] = t * tile_q
                    cost[i] = tile_cost[r, t]
                    i += 1
    order, offsets = _deal(cost, n_bins)
    return task_rh, task_q0, order, offsets


@njit(cache=True)
def plan_backward(starts, valid, heads, tile_q, n_bins):  # pragma: no cover - compiled
    """Tasks ``(row * heads + head, first column, end column)`` of independent chunks.

    A column ``p`` is a cut when no query at or after it reaches back before it
    (``min(starts[p:valid]) >= p``): then no key left of ``p`` is seen from its right,
    so ``dq`` of the queries and ``dk``/``dv`` of the keys in ``[cut, next cut)`` depend
    on that chunk alone. Chunks are grown to at least ``tile_q`` columns, cut where
    possible (between segments of a packed row; never, for ranges that reach back to the
    row start). Returns ``(task_rh, task_lo, task_hi, order, offsets)`` as
    :func:`plan_forward`.
    """
    rows, capacity = starts.shape
    chunk_lo = np.empty(rows * capacity, np.int64)
    chunk_hi = np.empty(rows * capacity, np.int64)
    chunk_row = np.empty(rows * capacity, np.int64)
    chunk_cost = np.empty(rows * capacity, np.float64)
    suffix_min = np.empty(capacity + 1, np.int64)
    n_chunks = 0
    for r in range(rows):
        n_valid = valid[r]
        suffix_min[n_valid] = n_valid
        for p in range(n_valid - 1, -1, -1):
            suffix_min[p] = min(suffix_min[p + 1], starts[r, p])
        c = 0
        while c < n_valid:
            e = c + 1
            while e < n_valid and (e - c < tile_q or suffix_min[e] < e):
                e += 1
            cost = 0.0
            a = c
            while a < e:
                b, lowest = _next_block(starts[r], a, e, tile_q)
                cost += (b - a) * (b - lowest) + 16.0
                a = b
            chunk_lo[n_chunks] = c
            chunk_hi[n_chunks] = e
            chunk_row[n_chunks] = r
            chunk_cost[n_chunks] = cost
            n_chunks += 1
            c = e
    count = n_chunks * heads
    task_rh = np.empty(count, np.int64)
    task_lo = np.empty(count, np.int64)
    task_hi = np.empty(count, np.int64)
    cost = np.empty(count, np.float64)
    i = 0
    for t in range(n_chunks):
        for h in range(heads):
            task_rh[i] = chunk_row[t] * heads + h
            task_lo[i] = chunk_lo[t]
            task_hi[i] = chunk_hi[t]
            cost[i] = chunk_cost[t]
            i += 1
    order, offsets = _deal(cost, n_bins)
    return task_rh, task_lo, task_hi, order, offsets


@njit(cache=True, fastmath=_FASTMATH)
def _softmax_chunk(s, starts_row, a, k0, row_max, row_sum, acc):  # pragma: no cover - compiled
    """Online softmax step for scores ``s[x, j]`` of query ``a + x`` and key ``k0 + j``.

    Keys outside the query's range become 0; the others ``exp(s - running max)``; the
    running sum and the output accumulator are rescaled when the max rises. The loops
    run over row slices from index 0: indexing ``s[x, j]`` from a computed start makes
    Numba check for negative indices on every access, and that kept LLVM from
    vectorising (5x slower per score).
    """
    nq = s.shape[0]
    dim = acc.shape[1]
    for x in range(nq):
        line = s[x]
        lo = min(max(starts_row[a + x] - k0, 0), line.shape[0])
        hi = max(min(a + x - k0 + 1, line.shape[0]), lo)
        line[:lo] = 0.0
        line[hi:] = 0.0
        if hi == lo:
            continue
        kept = line[lo:hi]
        m_new = row_max[x]
        for j in range(kept.shape[0]):
            m_new = max(m_new, kept[j])
        total = s.dtype.type(0.0)
        for j in range(kept.shape[0]):
            e = _exp_nonpositive(kept[j] - m_new)
            kept[j] = e
            total += e
        if row_max[x] != m_new:
            alpha = _exp_nonpositive(row_max[x] - m_new)
            row_sum[x] *= alpha
            for d in range(dim):
                acc[x, d] *= alpha
        row_sum[x] += total
        row_max[x] = m_new


@njit(cache=True, fastmath=_FASTMATH)
def _probability_chunk(p, dp, starts_row, a, c, lse_row, delta, scale):  # pragma: no cover
    """Backward step: ``p = exp(scale * s - lse)`` in range (else 0), ``dp <- dS``.

    On entry ``p`` holds ``q . k`` and ``dp`` holds ``dO . v`` for query ``a + x`` and
    key ``c + j``; on exit ``dp`` is ``scale * p * (dp - D)``, the scaled score gradient.
    Row slices from index 0, as in :func:`_softmax_chunk`.
    """
    nq = p.shape[0]
    for x in range(nq):
        p_line = p[x]
        dp_line = dp[x]
        lo = min(max(starts_row[a + x] - c, 0), p_line.shape[0])
        hi = max(min(a + x - c + 1, p_line.shape[0]), lo)
        p_line[:lo] = 0.0
        p_line[hi:] = 0.0
        dp_line[:lo] = 0.0
        dp_line[hi:] = 0.0
        shift = lse_row[a + x]
        dlt = delta[a + x]
        p_kept = p_line[lo:hi]
        dp_kept = dp_line[lo:hi]
        for j in range(p_kept.shape[0]):
            pj = _exp_nonpositive(p_kept[j] * scale - shift)
            p_kept[j] = pj
            dp_kept[j] = pj * (dp_kept[j] - dlt) * scale


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def forward(
    q, k, v, starts, valid, scale, tile_q, tile_k, task_rh, task_q0, order, offsets, out, lse
):  # pragma: no cover - compiled
    """Fill ``out`` and ``lse`` for every planned query tile (others stay 0 / -inf).

    ``q, k, v, out``: ``[rows * heads * capacity, head_dim]`` C-contiguous views;
    ``lse``: ``[rows * heads, capacity]``.
    """
    capacity = starts.shape[1]
    heads = lse.shape[0] // starts.shape[0]
    dim = q.shape[1]
    dtype = q.dtype
    n_bins = offsets.shape[0] - 1
    for bin_index in prange(n_bins):
        q_buf = np.empty(tile_q * dim, dtype)
        s_buf = np.empty(tile_q * tile_k, dtype)
        pv_buf = np.empty(tile_q * dim, dtype)
        acc_buf = np.empty(tile_q * dim, dtype)
        row_max = np.empty(tile_q, dtype)
        row_sum = np.empty(tile_q, dtype)
        for i in range(offsets[bin_index], offsets[bin_index + 1]):
            task = order[i]
            rh = task_rh[task]
            r = rh // heads
            base = rh * capacity
            q0 = task_q0[task]
            q1 = min(q0 + tile_q, valid[r])
            a = q0
            while a < q1:
                b, lowest = _next_block(starts[r], a, q1, tile_q)
                nq = b - a
                qs = q_buf[: nq * dim].reshape(nq, dim)
                acc = acc_buf[: nq * dim].reshape(nq, dim)
                for x in range(nq):
                    row_max[x] = -np.inf
                    row_sum[x] = 0.0
                    for d in range(dim):
                        qs[x, d] = q[base + a + x, d] * scale
                        acc[x, d] = 0.0
                for k0 in range(lowest, b, tile_k):
                    k1 = min(k0 + tile_k, b)
                    nk = k1 - k0
                    s = s_buf[: nq * nk].reshape(nq, nk)
                    np.dot(qs, k[base + k0 : base + k1].T, s)
                    _softmax_chunk(s, starts[r], a, k0, row_max, row_sum, acc)
                    pv = pv_buf[: nq * dim].reshape(nq, dim)
                    np.dot(s, v[base + k0 : base + k1], pv)
                    for x in range(nq):
                        for d in range(dim):
                            acc[x, d] += pv[x, d]
                for x in range(nq):
                    inv = 1.0 / row_sum[x]
                    for d in range(dim):
                        out[base + a + x, d] = acc[x, d] * inv
                    lse[rh, a + x] = row_max[x] + math.log(row_sum[x])
                a = b


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    starts,
    valid,
    key_end,
    scale,
    tile_q,
    tile_k,
    task_rh,
    task_lo,
    task_hi,
    order,
    offsets,
    dq,
    dk,
    dv,
):  # pragma: no cover - compiled
    """Accumulate ``dq`` and write ``dk``/``dv`` for every planned independent chunk.

    Arrays as in :func:`forward`; ``dq``, ``dk``, ``dv`` arrive zeroed, and cells no
    active query reaches (padding keys, inactive queries) stay exactly zero.
    """
    capacity = starts.shape[1]
    heads = lse.shape[0] // starts.shape[0]
    dim = q.shape[1]
    dtype = q.dtype
    n_bins = offsets.shape[0] - 1
    for bin_index in prange(n_bins):
        p_buf = np.empty(tile_q * tile_k, dtype)
        dp_buf = np.empty(tile_q * tile_k, dtype)
        tmp_buf = np.empty(max(tile_q, tile_k) * dim, dtype)
        dk_buf = np.empty(tile_k * dim, dtype)
        dv_buf = np.empty(tile_k * dim, dtype)
        delta = np.empty(capacity, dtype)
        for i in range(offsets[bin_index], offsets[bin_index + 1]):
            task = order[i]
            rh = task_rh[task]
            r = rh // heads
            base = rh * capacity
            c = task_lo[task]
            c_end = task_hi[task]
            for x in range(c, c_end):
                total = dtype.type(0.0)
                for d in range(dim):
                    total += d_out[base + x, d] * out[base + x, d]
                delta[x] = total
            while c < c_end:
                e, _ = _next_block(starts[r], c, c_end, tile_k)
                nk = e - c
                q_end = e
                for key in range(c, e):
                    q_end = max(q_end, key_end[r, key])
                kb = k[base + c : base + e]
                vb = v[base + c : base + e]
                dk_acc = dk_buf[: nk * dim].reshape(nk, dim)
                dv_acc = dv_buf[: nk * dim].reshape(nk, dim)
                for x in range(nk):
                    for d in range(dim):
                        dk_acc[x, d] = 0.0
                        dv_acc[x, d] = 0.0
                for a in range(c, q_end, tile_q):
                    b = min(a + tile_q, q_end)
                    nq = b - a
                    qc = q[base + a : base + b]
                    doc = d_out[base + a : base + b]
                    p = p_buf[: nq * nk].reshape(nq, nk)
                    dp = dp_buf[: nq * nk].reshape(nq, nk)
                    np.dot(qc, kb.T, p)
                    np.dot(doc, vb.T, dp)
                    _probability_chunk(p, dp, starts[r], a, c, lse[rh], delta, scale)
                    tmp = tmp_buf[: nk * dim].reshape(nk, dim)
                    np.dot(p.T, doc, tmp)
                    for x in range(nk):
                        for d in range(dim):
                            dv_acc[x, d] += tmp[x, d]
                    np.dot(dp.T, qc, tmp)
                    for x in range(nk):
                        for d in range(dim):
                            dk_acc[x, d] += tmp[x, d]
                    tmq = tmp_buf[: nq * dim].reshape(nq, dim)
                    np.dot(dp, kb, tmq)
                    for x in range(nq):
                        for d in range(dim):
                            dq[base + a + x, d] += tmq[x, d]
                for x in range(nk):
                    for d in range(dim):
                        dk[base + c + x, d] = dk_acc[x, d]
                        dv[base + c + x, d] = dv_acc[x, d]
                c = e
