"""Range-aware attention on the CPU: Numba kernels, forward and backward.

Pure functions over arrays. :mod:`streampack.kernels.attention` validates every input,
allocates every output (``dq``/``dk``/``dv`` zeroed, ``lse`` filled with -inf; ``out``
uninitialised, the forward writes all of it)
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
block ``[a, b)`` needs keys ``[min(starts[a:b]), b)``.

Forward: the keys of a block are taken ``tile_k`` at a time from ``b`` back towards the
segment start, so the first chunk holds the diagonal. Per block the scaled queries are
transposed once into ``qt`` (``scale * q``, ``[head_dim, queries]``, by 8x8 register
tiles: ``attention_ir._transpose_tile``) and the block's rows of ``out`` are zeroed (``out``
arrives uninitialised; no accumulator, no copy). Per chunk

* ``st = K qt`` (``[keys, queries]``) by register-blocked micro-tiles of 6 keys x 16
  queries (float32; 8 for float64), skipping every tile whose keys all come after all its
  queries (about half of the diagonal square) and computing one vector, not two, where
  the diagonal crosses a tile's second half;
* softmax with a **fixed shift** per query: its own score (the diagonal key, in the first
  chunks), kept for every later chunk, so one pass gives the exps and the column sums
  and there is neither a max pass nor a rescaling of ``out``. The pass also records how
  far any score rises above the shift; a chunk where that exceeds ``SHIFT_SLACK`` (16,
  so the exps stay below ``exp(16)``) or is NaN is recomputed and redone exactly, with
  the running max and rescaling (:func:`_softmax_columns`). Chunks with masked cells
  (the diagonal, or ranges that do not cover the chunk) use :func:`_softmax_shifted`,
  which writes exactly 0 outside each query's range, four rows at a time across queries
  (vectorised); chunks wholly inside every query's range (every other chunk of a packed
  row) get the exp on the score micro-tile's registers before they are stored
  (:func:`_scores_softmax`);
* ``out += P V`` straight into ``out``, by micro-tiles of 6 queries x 16 output columns
  that sum only the keys some of the six may see.

Measured on the benchmark's shapes (one process, old and new alternating) the fixed
shift with the fused exp, the register transpose and the in-kernel zeroing of ``out``
together made the forward about 1.3x faster than the two-pass online softmax before.

The micro-tiles are LLVM IR (``attention_ir._micro_kernel``): the accumulators stay
in vector registers for the whole inner product and every step is broadcasts, vector
loads and ``llvm.fmuladd``. Measured on the benchmark's shapes they ran about 1.7x the
rate of OpenBLAS on the same 64x64x64 products called through ``np.dot``, which pays for
checks, packing and its call on every small product; they also need no BLAS thread
control. The backward still calls ``np.dot`` (SciPy's BLAS) per chunk, with each GEMM at
most ``64 * 64 * 64`` multiply-adds (``GEMM_BUDGET``), which keeps OpenBLAS on the calling
thread: above that it starts its own thread pool, and nested under ``prange`` on 2 cores
a 64x1024x64 product measured 3-30x slower than the same work done as 64x64x64 calls.

Parallelism: the planner deals tasks (query tiles for the forward, independent column
chunks of one ``(row, head)`` for the backward) into one bin per thread, longest first,
each to the least loaded bin; ``prange`` runs over bins. A task writes only its own
cells, so there are no races and no atomics, and the result does not depend on the thread count.

Backward (flash style): ``P`` is recomputed from the saved ``lse``; ``D = rowsum(dO*O)``.
For each key block ``[c, e)`` the queries that may see it are ``[c, key_end)`` where
``key_end`` (from ``attention_plan.key_query_end``) is one past the last query whose range reaches
the block; ``dK``/``dV`` of the block accumulate in scratch and are written once, while
``dQ`` accumulates in place — it belongs to the same task, a chunk of columns that no
range crosses (in a packed row, whole segments). This does five GEMMs per block pair
instead of the seven that separate dQ and dK/dV passes need.

Three modules: this one holds the drivers (``forward``, ``backward``) and the loops
between them and the tiles; :mod:`~streampack.kernels.attention_ir` generates the LLVM
IR (micro-tiles, the fast exp); :mod:`~streampack.kernels.attention_plan` cuts blocks
and deals tasks, and is shared with the CUDA kernels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention_ir import (
    MICRO_ROWS,
    SHIFT_SLACK,
    edge_tile,
    exp_nonpositive,
    half_tile,
    micro_columns,
    score_tile,
    single_tile,
    softmax_tile,
    transpose_scaled,
    value_tile,
)
from .attention_plan import next_block

#: Queries per block (at most): the rows of every GEMM.
TILE_Q = 64
#: Multiply-adds per backward GEMM call at most; ``tile_k = GEMM_BUDGET // (TILE_Q * head_dim)``.
GEMM_BUDGET = 64 * 64 * 64
#: Keys per forward chunk: the scores of a chunk, ``FORWARD_TILE_K x TILE_Q``, take 16 KB
#: in float32 and stay in L1 next to the transposed queries.
FORWARD_TILE_K = 64

#: Fast-math flags that keep IEEE infinities and NaNs (no ``nnan``/``ninf``) and libm's
#: exact functions (no ``afn``) but let LLVM reassociate sums, so row sums and the exp
#: loop vectorise.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def key_tile(head_dim: int) -> int:
    """Backward keys per chunk for ``head_dim``: as many as the GEMM budget allows (at
    least 1)."""
    return max(1, GEMM_BUDGET // (TILE_Q * max(head_dim, 1)))


@njit(cache=True)
def _scores(k, k_row0, nk, qt, ld, nq, diagonal, dim, st):  # pragma: no cover - compiled
    """``st[j, x] = k[k_row0 + j] . qt[:, x]`` for ``j < nk`` and ``x`` up to ``nq``
    rounded up to whole micro-tiles.

    ``diagonal`` is ``a - k0``, the first query's column less the first key's: a
    micro-tile whose keys all come after all its queries is skipped, and where the
    diagonal crosses the second half of a tile only that half is computed (one vector);
    the cells skipped hold stale values that the softmax never reads.
    """
    step = micro_columns(st)
    half = step // 2
    n_cols = (nq + step - 1) // step * step
    for j0 in range(0, nk, MICRO_ROWS):
        rows = min(MICRO_ROWS, nk - j0)
        a_off = (k_row0 + j0) * dim
        first = max(j0 - diagonal, 0) // half * half
        if first % step != 0 and first < n_cols:
            # the diagonal crosses the second half of a tile: one vector wide is enough
            edge_tile(rows, st, j0 * ld + first, ld, k, a_off, dim, 1, qt, first, ld, dim)
            first += half
        for c0 in range(first, n_cols, step):
            score_tile(rows, st, j0 * ld + c0, ld, k, a_off, dim, 1, qt, c0, ld, dim)


@njit(cache=True)
def _scores_softmax(k, k_row0, nk, qt, ld, nq, dim, st, stats):  # pragma: no cover - compiled
    """:func:`_scores` and :func:`_softmax_shifted` in one, for a chunk whose cells are
    all in range: ``st[j, x] = exp(k[k_row0 + j] . qt[:, x] - shift[x])`` with the
    exponent computed on the micro-tile's registers before they are stored.

    ``stats`` holds ``shift``, ``total`` and ``rise`` at offsets 0, ``ld`` and ``2 ld``
    (the caller sets them; ``total`` 0, ``rise`` -inf); on return ``total[x]`` is the
    column sum and ``rise[x]`` the largest ``score - shift`` of column ``x``.
    """
    step = micro_columns(st)
    n_cols = (nq + step - 1) // step * step
    for j0 in range(0, nk, MICRO_ROWS):
        rows = min(MICRO_ROWS, nk - j0)
        for c0 in range(0, n_cols, step):
            softmax_tile(
                rows,
                st,
                j0 * ld + c0,
                ld,
                k,
                (k_row0 + j0) * dim,
                dim,
                1,
                qt,
                c0,
                ld,
                dim,
                stats,
                c0,
                ld,
            )


@njit(cache=True, fastmath=_FASTMATH)
def _softmax_columns(
    st, ld, nq, nk, low, a, k0, row_max, row_sum, chunk_max, out, out_row0
):  # pragma: no cover - compiled
    """Online softmax step on ``st[j, x]`` (key ``k0 + j``, query ``a + x``).

    Key ``k0 + j`` is in query ``a + x``'s range when ``low[x] <= k0 + j <= a + x``; the
    others become exactly 0 and are never read otherwise (they may hold stale values).
    A query whose running max rises has its running sum and its accumulated output row
    ``out[out_row0 + x]`` rescaled. Indices are unsigned: that keeps Numba's
    negative-index fix-ups (and slice reference counting) out of the loops, which then
    vectorise across queries.
    """
    lowest = st.dtype.type(-np.inf)
    zero = st.dtype.type(0.0)
    n = np.uintp(nq)
    for x in range(n):
        chunk_max[x] = lowest
    for j in range(nk):
        key = low.dtype.type(k0 + j)
        row = np.uintp(j * ld)
        for x in range(np.uintp(min(max(k0 + j - a, 0), nq)), n):
            score = st[row + x]  # loaded unconditionally: no masked load
            chunk_max[x] = max(chunk_max[x], score if low[x] <= key else lowest)
    for x in range(nq):
        new = max(row_max[x], chunk_max[x])
        if new > row_max[x]:
            if row_max[x] > -np.inf:
                alpha = exp_nonpositive(row_max[x] - new)
                row_sum[x] *= alpha
                acc = out[out_row0 + x]
                for d in range(acc.shape[0]):
                    acc[d] *= alpha
            row_max[x] = new
    for j in range(nk):
        key = low.dtype.type(k0 + j)
        row = np.uintp(j * ld)
        first = np.uintp(min(max(k0 + j - a, 0), nq))
        for x in range(first):
            st[row + x] = zero
        for x in range(first, n):
            e = exp_nonpositive(st[row + x] - row_max[x])
            e = e if low[x] <= key else zero
            st[row + x] = e
            row_sum[x] += e


@njit(cache=True, fastmath=_FASTMATH)
def _shifted_exp(score, shift, keep, slack, zero, lowest):  # pragma: no cover - compiled
    """``(exp(score - shift) or zero, score - shift or lowest)`` as ``keep``; the exp's
    argument is capped at ``slack``, so a cell beyond it cannot overflow (the caller sees
    it in the returned rise and redoes the chunk)."""
    d = score - shift
    e = exp_nonpositive(min(d, slack))
    return (e if keep else zero), (d if keep else lowest)


@njit(cache=True, fastmath=_FASTMATH)
def _softmax_shifted(
    st, ld, nq, nk, low, a, k0, masked, shift, chunk_sum, chunk_over
):  # pragma: no cover - compiled
    """One-pass softmax step with a fixed shift: ``st[j, x] = exp(st[j, x] - shift[x])``.

    Writes exactly 0 outside each query's range when ``masked`` (else every cell must be
    in range), sets ``chunk_sum[x]`` to the column sums, and returns the largest
    ``score - shift`` over the cells in range: the caller keeps the result only when it
    is at most :data:`SHIFT_SLACK` (for larger values, or NaN, the exps may overflow).
    Rows are taken four at a time, so the per-query shift, sum and rise are loaded and
    stored once per four cells; indices are unsigned, as in :func:`_softmax_columns`.
    """
    zero = st.dtype.type(0.0)
    lowest = st.dtype.type(-np.inf)
    bounds = (st.dtype.type(SHIFT_SLACK), zero, lowest)
    n = np.uintp(nq)
    ldu = np.uintp(ld)
    for x in range(n):
        chunk_sum[x] = zero
        chunk_over[x] = lowest
    j = 0
    while j + 4 <= nk:
        r0 = np.uintp(j * ld)
        r1 = r0 + ldu
        r2 = r1 + ldu
        r3 = r2 + ldu
        if masked:
            key0 = low.dtype.type(k0 + j)
            key1 = low.dtype.type(k0 + j + 1)
            key2 = low.dtype.type(k0 + j + 2)
            key3 = low.dtype.type(k0 + j + 3)
            f0 = np.uintp(min(max(k0 + j - a, 0), nq))
            f1 = np.uintp(min(max(k0 + j + 1 - a, 0), nq))
            f2 = np.uintp(min(max(k0 + j + 2 - a, 0), nq))
            f3 = np.uintp(min(max(k0 + j + 3 - a, 0), nq))
            for x in range(f0):
                st[r0 + x] = zero
                st[r1 + x] = zero
                st[r2 + x] = zero
                st[r3 + x] = zero
            for x in range(f0, n):
                sh = shift[x]
                lo = low[x]
                e0, d0 = _shifted_exp(st[r0 + x], sh, (lo <= key0) & (x >= f0), *bounds)
                e1, d1 = _shifted_exp(st[r1 + x], sh, (lo <= key1) & (x >= f1), *bounds)
                e2, d2 = _shifted_exp(st[r2 + x], sh, (lo <= key2) & (x >= f2), *bounds)
                e3, d3 = _shifted_exp(st[r3 + x], sh, (lo <= key3) & (x >= f3), *bounds)
                st[r0 + x] = e0
                st[r1 + x] = e1
                st[r2 + x] = e2
                st[r3 + x] = e3
                chunk_over[x] = max(chunk_over[x], max(max(d0, d1), max(d2, d3)))
                chunk_sum[x] += (e0 + e1) + (e2 + e3)
        else:
            for x in range(n):
                sh = shift[x]
                e0, d0 = _shifted_exp(st[r0 + x], sh, True, *bounds)
                e1, d1 = _shifted_exp(st[r1 + x], sh, True, *bounds)
                e2, d2 = _shifted_exp(st[r2 + x], sh, True, *bounds)
                e3, d3 = _shifted_exp(st[r3 + x], sh, True, *bounds)
                st[r0 + x] = e0
                st[r1 + x] = e1
                st[r2 + x] = e2
                st[r3 + x] = e3
                chunk_over[x] = max(chunk_over[x], max(max(d0, d1), max(d2, d3)))
                chunk_sum[x] += (e0 + e1) + (e2 + e3)
        j += 4
    while j < nk:
        row = np.uintp(j * ld)
        key = low.dtype.type(k0 + j)
        first = np.uintp(min(max(k0 + j - a, 0), nq)) if masked else np.uintp(0)
        for x in range(first):
            st[row + x] = zero
        for x in range(first, n):
            e, d = _shifted_exp(st[row + x], shift[x], (low[x] <= key) | (not masked), *bounds)
            st[row + x] = e
            chunk_over[x] = max(chunk_over[x], d)
            chunk_sum[x] += e
        j += 1
    over = lowest
    for x in range(n):
        over = max(over, chunk_over[x])
    return over


@njit(cache=True)
def _accumulate_values(st, ld, nq, nk, low, a, k0, v, v_row0, out, out_row0):  # pragma: no cover
    """``out[out_row0 + x] += sum_j st[j, x] * v[v_row0 + j]`` for ``x < nq``.

    Per micro-tile of queries only the keys that some of them may see are summed: none
    after its last query, none before its lowest range start.
    """
    dim = v.shape[1]
    step = micro_columns(v)
    half = step // 2
    for x0 in range(0, nq, MICRO_ROWS):
        rows = min(MICRO_ROWS, nq - x0)
        lowest = low[x0]
        for y in range(x0 + 1, x0 + rows):
            lowest = min(lowest, low[y])
        lo = max(lowest - k0, 0)
        hi = min(nk, a + x0 + rows - k0)
        if hi <= lo:
            continue
        c_off = (out_row0 + x0) * dim
        b_off = (v_row0 + lo) * dim
        a_off = lo * ld + x0
        c = 0
        while c + step <= dim:
            value_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += step
        if c + half <= dim:
            half_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += half
        while c < dim:
            single_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += 1


@njit(cache=True, fastmath=_FASTMATH)
def _probability_chunk(p, dp, starts_row, a, c, lse_row, delta, scale):  # pragma: no cover
    """Backward step: ``p = exp(scale * s - lse)`` in range (else 0), ``dp <- dS``.

    On entry ``p`` holds ``q . k`` and ``dp`` holds ``dO . v`` for query ``a + x`` and
    key ``c + j``; on exit ``dp`` is ``scale * p * (dp - D)``, the scaled score gradient.
    The loops run over row slices from index 0: indexing from a computed start makes
    Numba check for negative indices on every access, which keeps LLVM from vectorising.
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
            pj = exp_nonpositive(p_kept[j] * scale - shift)
            p_kept[j] = pj
            dp_kept[j] = pj * (dp_kept[j] - dlt) * scale


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def forward(
    q, k, v, starts, valid, scale, tile_q, tile_k, task_rh, task_q0, order, offsets, out, lse
):  # pragma: no cover - compiled
    """Fill ``out`` and ``lse`` for every planned query tile; ``out`` is 0 and ``lse``
    stays -inf on inactive queries.

    ``q, k, v, out``: ``[rows * heads * capacity, head_dim]`` C-contiguous views;
    ``lse``: ``[rows * heads, capacity]``. ``out`` may arrive uninitialised: a block's
    rows are zeroed before they accumulate, and each bin zeroes the rows of inactive
    queries of some ``(row, head)`` pairs. Per block, ``qt`` holds ``scale * q``
    transposed (columns padded to a whole micro-tile) and ``st[j, x]`` the score, then
    the probability, of key ``k0 + j`` for query ``a + x``.
    """
    capacity = starts.shape[1]
    heads = lse.shape[0] // starts.shape[0]
    dim = q.shape[1]
    dtype = q.dtype
    width = micro_columns(q)
    ld = (tile_q + width - 1) // width * width
    n_bins = offsets.shape[0] - 1
    n_rh = lse.shape[0]
    for bin_index in prange(n_bins):
        # rows of inactive queries: no task writes them
        for rh in range(bin_index, n_rh, n_bins):
            r = rh // heads
            out[rh * capacity + valid[r] : (rh + 1) * capacity] = 0.0
        qt = np.zeros(dim * ld, dtype)
        st = np.zeros(tile_k * ld, dtype)
        row_max = np.empty(tile_q, dtype)
        row_sum = np.empty(tile_q, dtype)
        chunk_max = np.empty(tile_q, dtype)
        saved_max = np.empty(tile_q, dtype)
        saved_over = np.empty(tile_q, dtype)
        # shift, sum and rise of the fused softmax; padding columns keep shift 0
        stats = np.zeros(3 * ld, dtype)
        low = np.empty(tile_q, np.int32)
        for i in range(offsets[bin_index], offsets[bin_index + 1]):
            task = order[i]
            rh = task_rh[task]
            r = rh // heads
            base = rh * capacity
            q0 = task_q0[task]
            q1 = min(q0 + tile_q, valid[r])
            a = q0
            while a < q1:
                b, lowest = next_block(starts[r], a, q1, tile_q)
                nq = b - a
                transpose_scaled(q, base + a, nq, scale, qt, ld)
                out[base + a : base + b] = 0.0
                highest = lowest
                for x in range(nq):
                    row_max[x] = -np.inf
                    row_sum[x] = 0.0
                    low[x] = starts[r, a + x]
                    highest = max(highest, low[x])
                # the diagonal chunk first, then back towards the segment start
                k1 = b
                while k1 > lowest:
                    k0 = max(lowest, k1 - tile_k)
                    nk = k1 - k0
                    exact = k0 > a
                    masked = k1 > a or highest > k0
                    if masked:
                        _scores(k, base + k0, nk, qt, ld, nq, a - k0, dim, st)
                    if not exact:
                        # every query has its own key here or in an earlier chunk: a query
                        # without a shift yet takes its own score
                        for x in range(nq):
                            saved_max[x] = row_max[x]
                            if row_max[x] == -np.inf:
                                row_max[x] = st[(a + x - k0) * ld + x]
                        if masked:
                            over = _softmax_shifted(
                                st, ld, nq, nk, low, a, k0, True, row_max, chunk_max, saved_over
                            )
                        else:
                            # all shifts are set: every query's own key came earlier
                            for x in range(nq):
                                stats[x] = row_max[x]
                            for x in range(ld):
                                stats[ld + x] = 0.0
                                stats[2 * ld + x] = -np.inf
                            _scores_softmax(k, base + k0, nk, qt, ld, nq, dim, st, stats)
                            over = stats[2 * ld]
                            for x in range(nq):
                                chunk_max[x] = stats[ld + x]
                                over = max(over, stats[2 * ld + x])
                        if over <= SHIFT_SLACK:
                            for x in range(nq):
                                row_sum[x] += chunk_max[x]
                        else:
                            for x in range(nq):
                                row_max[x] = saved_max[x]
                            _scores(k, base + k0, nk, qt, ld, nq, a - k0, dim, st)
                            exact = True
                    if exact:
                        _softmax_columns(
                            st, ld, nq, nk, low, a, k0, row_max, row_sum, chunk_max, out, base + a
                        )
                    _accumulate_values(st, ld, nq, nk, low, a, k0, v, base + k0, out, base + a)
                    k1 = k0
                for x in range(nq):
                    inv = 1.0 / row_sum[x]
                    line = out[base + a + x]
                    for d in range(dim):
                        line[d] *= inv
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
                e, _ = next_block(starts[r], c, c_end, tile_k)
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
