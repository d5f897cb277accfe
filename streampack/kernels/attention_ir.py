"""LLVM IR for the CPU attention kernels: register-blocked micro-tiles and a fast exp.

Code generation only; :mod:`streampack.kernels.attention_cpu` drives it. The
micro-tiles (:func:`_micro_kernel`) keep their accumulators in vector registers for a
whole inner product, every step broadcasts, vector loads and ``llvm.fmuladd``; the
softmax variant applies the shifted exp (:func:`_emit_shifted_exp`) before storing. The
``*_tile`` functions at the end pick the intrinsic for a tile of 1 to ``MICRO_ROWS``
rows. :func:`exp_nonpositive` is the float32 exp the softmax loops use.

Numba's cache keys a compiled function on its own source file only: after editing this
module, clear ``NUMBA_CACHE_DIR`` (``make clean``) so the kernels that call into it are
compiled again.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

#: How far (natural log units) a score may rise above the fixed softmax shift before the
#: chunk is redone with the exact running-max rescaling: ``exp(16)`` is about 9e6, far
#: from overflowing a sum or ``P V`` in float32.
SHIFT_SLACK = 16.0

_LOG2E = 1.4426950408889634
#: ``2**f`` on ``[0, 1)``, highest power first (relative error below 2e-6).
_EXP2_POLY = (1.8775767e-3, 8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1)


@intrinsic
def _f32_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """Reinterpret the bits of an int32 as a float32 (builds ``2**n`` without libm)."""
    if bits != types.int32:
        return None
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def exp_nonpositive(x):  # pragma: no cover - replaced by the overload below
    return math.exp(x)


@overload(exp_nonpositive)
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
    start = [builder.load(c_slot(i, j), align=align) if accumulate else zero for i, j in tiles]
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
        scalar = builder.load(builder.gep(a_ptr, [builder.add(a_col, builder.mul(sa_i, const(i)))]))
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
    :func:`_micro_kernel`). float32 uses the polynomial of :func:`exp_nonpositive` on
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
def transpose_scaled(q, row0, nq, scale, qt, ld):  # pragma: no cover - compiled
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


# --- Row dispatch --------------------------------------------------------------------
#
# One ladder per micro-tile kind, written out rather than generated: each call site in
# compiled code must name one intrinsic (Numba cannot index a tuple of intrinsics, or
# call one through a variable, with a row count known only at run time), so choosing
# among the six row counts takes an if-ladder. Generating the ladders (``exec`` of a
# template) would save ~80 lines but hide them from readers, linters and Numba's cache,
# which keys compiled code on the source file it can read.


@njit(cache=True)
def micro_columns(x):  # pragma: no cover - compiled
    """Columns of a full micro-tile for ``x``'s dtype: two 32-byte vectors."""
    return 64 // x.itemsize


@njit(cache=True)
def score_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
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
def softmax_tile(
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
def edge_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
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
def value_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
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
def half_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
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
def single_tile(rows, c, c_off, ldc, a, a_off, sa_i, sa_k, b, b_off, ldb, kdim):  # pragma: no cover
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
