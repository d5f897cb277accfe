"""TF32 tensor-core products for the CUDA attention: ``mma.sync.aligned.m16n8k8``.

One instruction, issued by all 32 lanes of a warp together, computes
``D[16, 8] = A[16, 8] @ B[8, 8] + C[16, 8]`` (A row-major, B column-major, f32
accumulators, A and B rounded to TF32 first). Each lane holds a **fragment**: four
elements of A, two of B, four of C/D. Which lane holds which element (PTX ISA, "Matrix
Fragments for mma.m16n8k8", ``.tf32``), with ``g = lane >> 2`` and ``c = lane % 4``::

    A  a0 (g, c)   a1 (g + 8, c)   a2 (g, c + 4)   a3 (g + 8, c + 4)      (row, col)
    B  b0 (c, g)   b1 (c + 4, g)                                         (k, n)
    C  c0 (g, 2c)  c1 (g, 2c + 1)  c2 (g + 8, 2c)  c3 (g + 8, 2c + 1)    (row, col)

The functions below are that table as index arithmetic, plain Python so the tests check
them without a GPU, and compiled as device functions for the kernels.

**P as an A operand without shuffles.** In the forward, ``S = Q K^T`` comes out in the C
layout, and ``P = softmax(S)`` must then be the A operand of ``P V``. The C layout holds
keys ``2c, 2c + 1`` where A wants keys ``c, c + 4``; but a product sums over its keys in
any order, so the kernel numbers the 8 keys of a chunk for the second product as
``pv_key(col) = 2 * (col % 4) + col // 4``: A element ``j`` of a lane is then its own C
element ``a_from_c(j)``, and B (rows of V) is loaded with the same numbering.

**Emitting it.** ``numba.cuda`` has no MMA API; :func:`mma_tf32` is an intrinsic that
returns llvmlite inline assembly (``cvt.rna.tf32.f32`` on the six operands, then the
``mma.sync``), as numba-cuda's own ``cache_hints`` emit ``ld.global.cs``. It relies on
numba-cuda's intrinsic and data-model hooks, hence the pinned version in the ``cuda``
extra. The CUDA simulator cannot run inline PTX, so there :func:`mma` is
:func:`mma_emulated`: the same fragment semantics, exchanged through shared memory and
computed with plain float32 FMAs (no TF32 rounding), so the tiling of the TF32 kernel is
tested there and only the instruction itself waits for a GPU.
"""

from __future__ import annotations

from typing import Any

from numba import config, cuda, float32

#: Lanes of a warp, and warps a block of the emulated product may have.
WARP = 32
MAX_WARPS = 4


def a_row(lane: int, i: int) -> int:
    """Row of A held as element ``i`` (0-3) by ``lane``."""
    return (lane >> 2) + 8 * (i & 1)


def a_col(lane: int, i: int) -> int:
    """Column (k) of A held as element ``i`` by ``lane``."""
    return (lane & 3) + 4 * (i >> 1)


def b_row(lane: int, i: int) -> int:
    """Row (k) of B held as element ``i`` (0-1) by ``lane``."""
    return (lane & 3) + 4 * i


def b_col(lane: int, i: int) -> int:
    """Column (n) of B held as element ``i`` by ``lane``."""
    return lane >> 2


def c_row(lane: int, i: int) -> int:
    """Row of C/D held as element ``i`` (0-3) by ``lane``."""
    return (lane >> 2) + 8 * (i >> 1)


def c_col(lane: int, i: int) -> int:
    """Column of C/D held as element ``i`` by ``lane``."""
    return 2 * (lane & 3) + (i & 1)


def pv_key(col: int) -> int:
    """The key of a chunk of 8 that column (k) ``col`` of P, and row ``col`` of V, stand
    for in the second product."""
    return 2 * (col & 3) + (col >> 2)


def a_from_c(j: int) -> int:
    """The C element of a lane that is its A element ``j`` under :func:`pv_key`."""
    return 2 * (j & 1) + (j >> 1)


#: True under ``NUMBA_ENABLE_CUDASIM=1``, where inline PTX cannot run.
SIMULATED = bool(getattr(config, "ENABLE_CUDASIM", 0))


def _device(fn: Any) -> Any:
    """``fn`` callable from kernels. On the CUDA target an intrinsic that compiles it
    into the caller (``context.compile_internal``, as Numba's own builtins): a
    ``cuda.jit(device=True)`` function or an overload is compiled through a dispatcher
    that asks the driver for the GPU's compute capability, and ``compile_ptx`` must work
    without a GPU. On the simulator, which runs kernels as Python, ``fn`` itself."""
    if SIMULATED:
        return fn
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def codegen(context, builder, signature, values):
        return context.compile_internal(builder, fn, signature, values)

    # (an intrinsic's typer takes no *args: one for each arity)
    def unary(typingctx, x):
        return types.int64(types.unliteral(x)), codegen

    def binary(typingctx, x, y):
        return types.int64(types.unliteral(x), types.unliteral(y)), codegen

    typer = unary if fn.__code__.co_argcount == 1 else binary
    typer.__name__ = fn.__name__
    return intrinsic(typer)


a_row_d, a_col_d, b_row_d, b_col_d, c_row_d, c_col_d, pv_key_d, a_from_c_d = (
    _device(fn) for fn in (a_row, a_col, b_row, b_col, c_row, c_col, pv_key, a_from_c)
)


@cuda.jit(device=True)
def mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):  # pragma: no cover - device code
    """The product of :func:`mma_tf32` from the lanes' fragments, through shared memory
    (for the simulator, which has no warp shuffles): every lane of the block must call
    it, as every lane of a warp must issue ``mma.sync``."""
    t = cuda.threadIdx.x
    warp = t // WARP
    lane = t % WARP
    sa = cuda.shared.array((MAX_WARPS, 16, 8), float32)
    sb = cuda.shared.array((MAX_WARPS, 8, 8), float32)
    sa[warp, a_row_d(lane, 0), a_col_d(lane, 0)] = a0
    sa[warp, a_row_d(lane, 1), a_col_d(lane, 1)] = a1
    sa[warp, a_row_d(lane, 2), a_col_d(lane, 2)] = a2
    sa[warp, a_row_d(lane, 3), a_col_d(lane, 3)] = a3
    sb[warp, b_row_d(lane, 0), b_col_d(lane, 0)] = b0
    sb[warp, b_row_d(lane, 1), b_col_d(lane, 1)] = b1
    cuda.syncthreads()
    d0 = c0
    d1 = c1
    d2 = c2
    d3 = c3
    for kk in range(8):
        d0 += sa[warp, c_row_d(lane, 0), kk] * sb[warp, kk, c_col_d(lane, 0)]
        d1 += sa[warp, c_row_d(lane, 1), kk] * sb[warp, kk, c_col_d(lane, 1)]
        d2 += sa[warp, c_row_d(lane, 2), kk] * sb[warp, kk, c_col_d(lane, 2)]
        d3 += sa[warp, c_row_d(lane, 3), kk] * sb[warp, kk, c_col_d(lane, 3)]
    cuda.syncthreads()  # the next call's stores wait until every lane has read
    return d0, d1, d2, d3


#: ``mma.sync`` with TF32 rounding of A and B done in the same asm block; operands
#: ``$0-$3`` are D, ``$4-$7`` A, ``$8-$9`` B, ``$10-$13`` C.
MMA_PTX = (
    "{\n"
    ".reg .b32 ta<4>, tb<2>;\n"
    "cvt.rna.tf32.f32 ta0, $4;\n"
    "cvt.rna.tf32.f32 ta1, $5;\n"
    "cvt.rna.tf32.f32 ta2, $6;\n"
    "cvt.rna.tf32.f32 ta3, $7;\n"
    "cvt.rna.tf32.f32 tb0, $8;\n"
    "cvt.rna.tf32.f32 tb1, $9;\n"
    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
    "{$0, $1, $2, $3}, {ta0, ta1, ta2, ta3}, {tb0, tb1}, {$10, $11, $12, $13};\n"
    "}"
)


def _make_intrinsic() -> Any:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``(d0, d1, d2, d3)`` of one ``mma.sync.aligned.m16n8k8`` (float32 operands)."""
        f = types.float32
        sig = types.UniTuple(f, 4)(*([f] * 10))

        def codegen(context, builder, signature, args):
            ft = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([ft] * 4), [ft] * 10)
            asm = ir.InlineAsm(fnty, MMA_PTX, "=f,=f,=f,=f," + ",".join(["f"] * 10))
            result = builder.call(asm, list(args))
            values = [builder.extract_value(result, i) for i in range(4)]
            return context.make_tuple(builder, signature.return_type, values)

        return sig, codegen

    return mma_tf32


mma_tf32 = None if SIMULATED else _make_intrinsic()
#: The product the kernels call: the instruction, or its emulation on the simulator.
mma = mma_emulated if SIMULATED else mma_tf32
