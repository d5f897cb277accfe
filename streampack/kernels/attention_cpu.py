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
tiles: :func:`_transpose_tile`) and the block's rows of ``out`` are zeroed (``out``
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

The micro-tiles are LLVM IR written here (:func:`_micro_kernel`): the accumulators stay
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
from numba.core import cgutils
from numba.extending import intrinsic, overload

#: Queries per block (at most): the rows of every GEMM.
TILE_Q = 64
#: Multiply-adds per backward GEMM call at most; ``tile_k = GEMM_BUDGET // (TILE_Q * head_dim)``.
GEMM_BUDGET = 64 * 64 * 64
#: Keys per forward chunk: the scores of a chunk, ``FORWARD_TILE_K x TILE_Q``, take 16 KB
#: in float32 and stay in L1 next to the transposed queries.
FORWARD_TILE_K = 64
#: How far (natural log units) a score may rise above the fixed softmax shift before the
#: chunk is redone with the exact running-max rescaling: ``exp(16)`` is about 9e6, far
#: from overflowing a sum or ``P V`` in float32.
SHIFT_SLACK = 16.0

_LOG2E = 1.4426950408889634
#: ``2**f`` on ``[0, 1)``, highest power first (relative error below 2e-6).
_EXP2_POLY = (1.8775767e-3, 8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1)

#: Fast-math flags that keep IEEE infinities and NaNs (no ``nnan``/``ninf``) and libm's
#: exact functions (no ``afn``) but let LLVM reassociate sums, so row sums and the exp
#: loop vectorise.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def key_tile(head_dim: int) -> int:
    """Backward keys per chunk for ``head_dim``: as many as the GEMM budget allows (at
    least 1)."""
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
            p = np.float32(_EXP2_POLY[0])
            p = p * f + np.float32(_EXP2_POLY[1])
            p = p * f + np.float32(_EXP2_POLY[2])
            p = p * f + np.float32(_EXP2_POLY[3])
            p = p * f + np.float32(_EXP2_POLY[4])
            p = p * f + np.float32(_EXP2_POLY[5])
            return p * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))

        return impl
    return lambda x: math.exp(x)


#: Rows of a micro-tile: its accumulators (rows x 2 vectors of 32 bytes) plus two rows of
#: B and one broadcast fit the 16 vector registers of AVX2.
MICRO_ROWS = 6


def _emit_product(context, builder, signature, args, rows, vectors, vector, accumulate, softmax):
    """Code of :func:`_micro_kernel`'s intrinsics (``args`` as their signature)."""
    c_arr, c_off, ldc, a_arr, a_off, sa_i, sa_k, b_arr, b_off, ldb, kdim = args[:11]
    c_ty, a_ty, b_ty = signature.args[0], signature.args[3], signature.args[7]
    c_ptr = context.make_array(c_ty)(context, builder, c_arr).data
    a_ptr = context.make_array(a_ty)(context, builder, a_arr).data
    b_ptr = context.make_array(b_ty)(context, builder, b_arr).data
    bits = c_ty.dtype.bitwidth
    width = 256 // bits if vector else 1
    f_ty = context.get_value_type(c_ty.dtype)
    v_ty = ir.VectorType(f_ty, width) if width > 1 else f_ty
    suffix = (f"v{width}" if width > 1 else "") + f"f{bits}"
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v_ty, [v_ty] * 3), "llvm.fmuladd." + suffix
    )
    i_ty = context.get_value_type(types.intp)
    align = bits // 8

    def const(n):
        return ir.Constant(i_ty, n)

    def vector_at(ptr, offset):
        return builder.bitcast(builder.gep(ptr, [offset]), v_ty.as_pointer())

    def c_slot(i, j):
        offset = builder.add(c_off, builder.add(builder.mul(ldc, const(i)), const(j)))
        return vector_at(c_ptr, offset)

    tiles = [(i, j * width) for i in range(rows) for j in range(vectors)]
    zero = ir.Constant(v_ty, None)
    start = [
        builder.load(c_slot(i, j), align=align) if accumulate else zero for i, j in tiles
    ]
    entry = builder.block
    loop = builder.append_basic_block("micro.loop")
    done = builder.append_basic_block("micro.done")
    builder.cbranch(builder.icmp_signed(">", kdim, const(0)), loop, done)

    builder.position_at_end(loop)
    kk = builder.phi(i_ty)
    kk.add_incoming(const(0), entry)
    acc = []
    for value in start:
        phi = builder.phi(v_ty)
        phi.add_incoming(value, entry)
        acc.append(phi)
    b_row = builder.add(b_off, builder.mul(kk, ldb))
    b_vals = [
        builder.load(vector_at(b_ptr, builder.add(b_row, const(j * width))), align=align)
        for j in range(vectors)
    ]
    a_col = builder.add(a_off, builder.mul(kk, sa_k))
    new = []
    for i in range(rows):
        scalar = builder.load(
            builder.gep(a_ptr, [builder.add(a_col, builder.mul(sa_i, const(i)))])
        )
        if width > 1:
            lane = builder.insert_element(
                ir.Constant(v_ty, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0)
            )
            mask = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
            scalar = builder.shuffle_vector(lane, ir.Constant(v_ty, ir.Undefined), mask)
        for j in range(vectors):
            new.append(builder.call(fma, [scalar, b_vals[j], acc[i * vectors + j]]))
    kk_next = builder.add(kk, const(1))
    kk.add_incoming(kk_next, loop)
    for phi, value in zip(acc, new):
        phi.add_incoming(value, loop)
    builder.cbranch(builder.icmp_signed("<", kk_next, kdim), loop, done)

    builder.position_at_end(done)
    final = []
    for value, updated in zip(start, new):
        phi = builder.phi(v_ty)
        phi.add_incoming(value, entry)
        phi.add_incoming(updated, loop)
        final.append(phi)
    if softmax:
        final = _emit_shifted_exp(context, builder, signature, args, final, rows, vectors, width)
    for (i, j), value in zip(tiles, final):
        builder.store(value, c_slot(i, j), align=align)
    return context.get_dummy_value()


def _micro_kernel(rows, vectors, vector, accumulate, softmax=False):
    """An intrinsic for one micro-tile ``C[i, j] (+)= sum_kk A[i, kk] * B[kk, j]``.

    ``i < rows``; ``j < vectors * w`` where ``w`` is the number of elements in 32 bytes
    (8 float32, 4 float64) when ``vector``, else ``w = 1``. Element ``(i, kk)`` of A is at
    ``a_off + i * sa_i + kk * sa_k``; row ``kk`` of B at ``b_off + kk * ldb`` (its ``w *
    vectors`` elements consecutive); row ``i`` of C at ``c_off + i * ldc``. Offsets count
    elements from the start of each array's data, which must be C-contiguous. The
    accumulators stay in registers for the whole ``kk`` loop and C is read (when
    ``accumulate``) and written once; every step is ``rows`` broadcasts, ``vectors``
    loads of B and ``rows * vectors`` ``llvm.fmuladd`` (a fused multiply-add where the
    CPU has one).

    With ``softmax`` (no ``accumulate``, ``vector``, two vectors) the intrinsic takes
    three more arguments, ``stats, s_off, lds``, and stores ``exp(C[i, j] - shift[j])``
    instead of ``C``, adding it to ``total[j]`` and raising ``rise[j]`` to at least
    ``C[i, j] - shift[j]``, where ``shift``, ``total`` and ``rise`` start at ``s_off``,
    ``s_off + lds`` and ``s_off + 2 * lds`` in ``stats`` (see :func:`_emit_shifted_exp`).
    """
    if softmax:

        @intrinsic
        def micro_softmax(
            typingctx, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds
        ):
            arrays = (c, a, b, stats)
            if not all(isinstance(x, types.Array) for x in arrays):
                return None
            if not all(x.dtype == c.dtype and x.layout == "C" for x in arrays):
                return None
            if c.dtype not in (types.float32, types.float64):
                return None
            intp = types.intp
            sig = types.void(
                c, intp, intp, a, intp, intp, intp, b, intp, intp, intp, stats, intp, intp
            )

            def codegen(context, builder, signature, args):
                return _emit_product(
                    context, builder, signature, args, rows, vectors, True, False, True
                )

            return sig, codegen

        return micro_softmax

    @intrinsic
    def micro(typingctx, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):
        arrays = (c, a, b)
        if not all(isinstance(x, types.Array) for x in arrays):
            return None
        if not all(x.dtype == c.dtype and x.layout == "C" for x in arrays):
            return None
        if c.dtype not in (types.float32, types.float64):
            return None
        intp = types.intp
        sig = types.void(c, intp, intp, a, intp, intp, intp, b, intp, intp, intp)

        def codegen(context, builder, signature, args):
            return _emit_product(
                context, builder, signature, args, rows, vectors, vector, accumulate, False
            )

        return sig, codegen

    return micro


def _emit_shifted_exp(context, builder, signature, args, values, rows, vectors, width):
    """The softmax epilogue of a micro-tile: ``values`` (``rows x vectors`` vectors of
    scores) become ``exp(min(score - shift, SHIFT_SLACK))``; per column vector the sum
    and the largest ``score - shift`` are updated in ``stats`` (layout in
    :func:`_micro_kernel`). float32 uses the polynomial of :func:`_exp_nonpositive` on
    the vectors; float64 calls ``llvm.exp``. A NaN score stays NaN in the exp and the sum.
    """
    s_arr, s_off, lds = args[11], args[12], args[13]
    s_ty = signature.args[11]
    s_ptr = context.make_array(s_ty)(context, builder, s_arr).data
    f_ty = context.get_value_type(s_ty.dtype)
    v_ty = ir.VectorType(f_ty, width)
    bits = s_ty.dtype.bitwidth
    align = bits // 8

    def splat(x):
        return ir.Constant(v_ty, [x] * width)

    def slot(offset, j):
        ptr = builder.gep(s_ptr, [builder.add(offset, ir.Constant(offset.type, j * width))])
        return builder.bitcast(ptr, v_ty.as_pointer())

    total_off = builder.add(s_off, lds)
    rise_off = builder.add(total_off, lds)
    shift = [builder.load(slot(s_off, j), align=align) for j in range(vectors)]
    total = [builder.load(slot(total_off, j), align=align) for j in range(vectors)]
    rise = [builder.load(slot(rise_off, j), align=align) for j in range(vectors)]
    suffix = f"v{width}f{bits}"
    fn = ir.FunctionType(v_ty, [v_ty])
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v_ty, [v_ty] * 3), "llvm.fmuladd." + suffix
    )
    out = []
    for idx, value in enumerate(values):
        j = idx % vectors
        d = builder.fsub(value, shift[j])
        rise[j] = builder.select(builder.fcmp_ordered(">", d, rise[j]), d, rise[j])
        # "unordered or less": a NaN passes through
        slack = splat(SHIFT_SLACK)
        d = builder.select(builder.fcmp_unordered("<", d, slack), d, slack)
        if bits == 32:
            t = builder.fmul(d, splat(_LOG2E))
            t = builder.select(builder.fcmp_unordered(">", t, splat(-126.0)), t, splat(-126.0))
            floor = cgutils.get_or_insert_function(builder.module, fn, "llvm.floor." + suffix)
            n = builder.call(floor, [t])
            f = builder.fsub(t, n)
            p = splat(_EXP2_POLY[0])
            for coefficient in _EXP2_POLY[1:]:
                p = builder.call(fma, [p, f, splat(coefficient)])
            i_ty = ir.VectorType(ir.IntType(32), width)
            exponent = builder.add(builder.fptosi(n, i_ty), ir.Constant(i_ty, [127] * width))
            exponent = builder.shl(exponent, ir.Constant(i_ty, [23] * width))
            e = builder.fmul(p, builder.bitcast(exponent, v_ty))
        else:
            exp = cgutils.get_or_insert_function(builder.module, fn, "llvm.exp." + suffix)
            e = builder.call(exp, [d])
        total[j] = builder.fadd(total[j], e)
        out.append(e)
    for j in range(vectors):
        builder.store(total[j], slot(total_off, j), align=align)
        builder.store(rise[j], slot(rise_off, j), align=align)
    return out


_score1, _score2, _score3, _score4, _score5, _score6 = (
    _micro_kernel(rows, 2, True, False) for rows in range(1, MICRO_ROWS + 1)
)
@intrinsic
def _transpose_tile(typingctx, dst, dst_off, ldd, src, src_off, lds, scale):  # pragma: no cover
    """``dst[dst_off + c * ldd + r] = scale * src[src_off + r * lds + c]`` for ``r, c < w``
    (``w`` elements in 32 bytes: 8 float32, 4 float64): ``w`` vector loads, a transpose
    in registers (LLVM picks the shuffles) and ``w`` vector stores."""
    if not all(isinstance(x, types.Array) and x.layout == "C" for x in (dst, src)):
        return None
    if dst.dtype != src.dtype or dst.dtype not in (types.float32, types.float64):
        return None
    if scale != dst.dtype:
        return None
    intp = types.intp
    sig = types.void(dst, intp, intp, src, intp, intp, scale)

    def codegen(context, builder, signature, args):
        d_arr, d_off, ldd, s_arr, s_off, lds, factor = args
        d_ptr = context.make_array(signature.args[0])(context, builder, d_arr).data
        s_ptr = context.make_array(signature.args[3])(context, builder, s_arr).data
        bits = signature.args[0].dtype.bitwidth
        width = 256 // bits
        f_ty = context.get_value_type(signature.args[0].dtype)
        v_ty = ir.VectorType(f_ty, width)
        i_ty = context.get_value_type(intp)
        i32 = ir.IntType(32)

        def at(ptr, offset, stride, i):
            index = builder.add(offset, builder.mul(stride, ir.Constant(i_ty, i)))
            return builder.bitcast(builder.gep(ptr, [index]), v_ty.as_pointer())

        rows = [builder.load(at(s_ptr, s_off, lds, r), align=bits // 8) for r in range(width)]
        undefined = ir.Constant(v_ty, ir.Undefined)
        lane = builder.insert_element(undefined, factor, ir.Constant(i32, 0))
        zeros = ir.Constant(ir.VectorType(i32, width), [0] * width)
        splat = builder.shuffle_vector(lane, undefined, zeros)
        for c in range(width):
            column = ir.Constant(v_ty, ir.Undefined)
            for r in range(width):
                element = builder.extract_element(rows[r], ir.Constant(i32, c))
                column = builder.insert_element(column, element, ir.Constant(i32, r))
            builder.store(builder.fmul(column, splat), at(d_ptr, d_off, ldd, c), align=bits // 8)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def _transpose_scaled(q, row0, nq, scale, qt, ld):  # pragma: no cover - compiled
    """``qt[d * ld + x] = scale * q[row0 + x, d]`` for ``x < nq``: whole ``w x w`` tiles
    with :func:`_transpose_tile`, the ragged edges one element at a time."""
    dim = q.shape[1]
    w = 32 // q.itemsize
    x_end = nq // w * w
    d_end = dim // w * w
    for x0 in range(0, x_end, w):
        for d0 in range(0, d_end, w):
            _transpose_tile(qt, d0 * ld + x0, ld, q, (row0 + x0) * dim + d0, dim, scale)
    for d in range(d_end, dim):
        for x in range(x_end):
            qt[d * ld + x] = q[row0 + x, d] * scale
    for x in range(x_end, nq):
        for d in range(dim):
            qt[d * ld + x] = q[row0 + x, d] * scale


_softmax1, _softmax2, _softmax3, _softmax4, _softmax5, _softmax6 = (
    _micro_kernel(rows, 2, True, False, softmax=True) for rows in range(1, MICRO_ROWS + 1)
)
_edge1, _edge2, _edge3, _edge4, _edge5, _edge6 = (
    _micro_kernel(rows, 1, True, False) for rows in range(1, MICRO_ROWS + 1)
)
_value1, _value2, _value3, _value4, _value5, _value6 = (
    _micro_kernel(rows, 2, True, True) for rows in range(1, MICRO_ROWS + 1)
)
_half1, _half2, _half3, _half4, _half5, _half6 = (
    _micro_kernel(rows, 1, True, True) for rows in range(1, MICRO_ROWS + 1)
)
_single1, _single2, _single3, _single4, _single5, _single6 = (
    _micro_kernel(rows, 1, False, True) for rows in range(1, MICRO_ROWS + 1)
)


@njit(cache=True)
def _micro_columns(x):  # pragma: no cover - compiled
    """Columns of a full micro-tile for ``x``'s dtype: two 32-byte vectors."""
    return 64 // x.itemsize


@njit(cache=True)
def _score_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
    """``C = A B`` on ``rows`` (1 to 6) rows and two vectors of columns."""
    if rows == 6:
        _score6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 5:
        _score5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 4:
        _score4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 3:
        _score3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 2:
        _score2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        _score1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@njit(cache=True)
def _softmax_tile(
    rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds
):  # pragma: no cover - compiled
    """``C = exp(A B - shift)`` with sums and rises, on ``rows`` (1 to 6) rows and two
    vectors of columns."""
    if rows == 6:
        _softmax6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)
    elif rows == 5:
        _softmax5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)
    elif rows == 4:
        _softmax4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)
    elif rows == 3:
        _softmax3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)
    elif rows == 2:
        _softmax2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)
    else:
        _softmax1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim, stats, s_off, lds)


@njit(cache=True)
def _edge_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
    """``C = A B`` on ``rows`` (1 to 6) rows and one vector of columns."""
    if rows == 6:
        _edge6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 5:
        _edge5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 4:
        _edge4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 3:
        _edge3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 2:
        _edge2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        _edge1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@njit(cache=True)
def _value_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
    """``C += A B`` on ``rows`` (1 to 6) rows and two vectors of columns."""
    if rows == 6:
        _value6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 5:
        _value5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 4:
        _value4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 3:
        _value3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 2:
        _value2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        _value1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@njit(cache=True)
def _half_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
    """``C += A B`` on ``rows`` (1 to 6) rows and one vector of columns."""
    if rows == 6:
        _half6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 5:
        _half5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 4:
        _half4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 3:
        _half3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 2:
        _half2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        _half1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@njit(cache=True)
def _single_tile(
    rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim
):  # pragma: no cover
    """``C += A B`` on ``rows`` (1 to 6) rows and one column."""
    if rows == 6:
        _single6(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 5:
        _single5(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 4:
        _single4(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 3:
        _single3(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    elif rows == 2:
        _single2(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)
    else:
        _single1(c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim)


@njit(cache=True)
def _scores(k, k_row0, nk, qt, ld, nq, diagonal, dim, st):  # pragma: no cover - compiled
    """``st[j, x] = k[k_row0 + j] . qt[:, x]`` for ``j < nk`` and ``x`` up to ``nq``
    rounded up to whole micro-tiles.

    ``diagonal`` is ``a - k0``, the first query's column less the first key's: a
    micro-tile whose keys all come after all its queries is skipped, and where the
    diagonal crosses the second half of a tile only that half is computed (one vector);
    the cells skipped hold stale values that the softmax never reads.
    """
    step = _micro_columns(st)
    half = step // 2
    n_cols = (nq + step - 1) // step * step
    for j0 in range(0, nk, MICRO_ROWS):
        rows = min(MICRO_ROWS, nk - j0)
        a_off = (k_row0 + j0) * dim
        first = max(j0 - diagonal, 0) // half * half
        if first % step != 0 and first < n_cols:
            # the diagonal crosses the second half of a tile: one vector wide is enough
            _edge_tile(rows, st, j0 * ld + first, ld, k, a_off, dim, 1, qt, first, ld, dim)
            first += half
        for c0 in range(first, n_cols, step):
            _score_tile(rows, st, j0 * ld + c0, ld, k, a_off, dim, 1, qt, c0, ld, dim)


@njit(cache=True)
def _scores_softmax(k, k_row0, nk, qt, ld, nq, dim, st, stats):  # pragma: no cover - compiled
    """:func:`_scores` and :func:`_softmax_shifted` in one, for a chunk whose cells are
    all in range: ``st[j, x] = exp(k[k_row0 + j] . qt[:, x] - shift[x])`` with the
    exponent computed on the micro-tile's registers before they are stored.

    ``stats`` holds ``shift``, ``total`` and ``rise`` at offsets 0, ``ld`` and ``2 ld``
    (the caller sets them; ``total`` 0, ``rise`` -inf); on return ``total[x]`` is the
    column sum and ``rise[x]`` the largest ``score - shift`` of column ``x``.
    """
    step = _micro_columns(st)
    n_cols = (nq + step - 1) // step * step
    for j0 in range(0, nk, MICRO_ROWS):
        rows = min(MICRO_ROWS, nk - j0)
        for c0 in range(0, n_cols, step):
            _softmax_tile(
                rows, st, j0 * ld + c0, ld, k, (k_row0 + j0) * dim, dim, 1, qt, c0, ld, dim,
                stats, c0, ld,
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
                alpha = _exp_nonpositive(row_max[x] - new)
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
            e = _exp_nonpositive(st[row + x] - row_max[x])
            e = e if low[x] <= key else zero
            st[row + x] = e
            row_sum[x] += e


@njit(cache=True, fastmath=_FASTMATH)
def _shifted_exp(score, shift, keep, slack, zero, lowest):  # pragma: no cover - compiled
    """``(exp(score - shift) or zero, score - shift or lowest)`` as ``keep``; the exp's
    argument is capped at ``slack``, so a cell beyond it cannot overflow (the caller sees
    it in the returned rise and redoes the chunk)."""
    d = score - shift
    e = _exp_nonpositive(min(d, slack))
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
    step = _micro_columns(v)
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
            _value_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += step
        if c + half <= dim:
            _half_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += half
        while c < dim:
            _single_tile(rows, out, c_off + c, dim, st, a_off, 1, ld, v, b_off + c, dim, hi - lo)
            c += 1


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
            pj = _exp_nonpositive(p_kept[j] * scale - shift)
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
    width = _micro_columns(q)
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
                b, lowest = _next_block(starts[r], a, q1, tile_q)
                nq = b - a
                _transpose_scaled(q, base + a, nq, scale, qt, ld)
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
