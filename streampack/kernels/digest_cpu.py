"""Compiled content digests: SHA-256 of many ranges in one call, through OpenSSL.

``streampack.digests.range_digests`` validates its arrays and calls :func:`sha256_ranges`
when :data:`AVAILABLE`; its hashlib loop is the plain-Python reference (and the fallback
where this module finds no OpenSSL). Per range, the kernel runs OpenSSL's low-level
``SHA256_Init`` / ``SHA256_Update`` / ``SHA256_Final`` on a context of its own — the
functions Python's ``hashlib`` reaches through the EVP layer, without its per-call
object and lock (``SHA256()``, the one-shot, fetches the algorithm at every call in
OpenSSL 3 and is slower).

Why intrinsics and not ctypes: a ctypes function called from ``@njit`` code is a
pointer baked into the machine code, which Numba refuses to cache ("uses dynamic
globals"), and a compile at every start costs start-up time. Here the three functions
are declared in the kernel's LLVM module as external symbols, by name, and resolved
when the object code is linked — at compile time or when it is loaded from
``NUMBA_CACHE_DIR`` — against the libcrypto that :func:`_load_libcrypto` made known to
LLVM's dynamic linker (``llvmlite.binding.load_library_permanently``). So the cached
code stays valid in every process that loads the same library first, which importing
this module does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

logger = logging.getLogger(__name__)

#: Bytes a ``SHA256_CTX`` may take (OpenSSL 3's is 112): the caller's context buffer.
CONTEXT_BYTES = 256
#: Bytes of a whole SHA-256 digest (``SHA256_Final``'s output).
SHA256_BYTES = 32
_SYMBOLS = ("SHA256_Init", "SHA256_Update", "SHA256_Final")


def _libcrypto_path() -> str | None:
    """The libcrypto this Python's ``hashlib`` loaded (from the process's memory map),
    else the one the system's linker finds; None when there is none."""
    import _hashlib  # noqa: F401  (loads libcrypto into the process)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if "/libcrypto.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("crypto")


def _load_libcrypto() -> str | None:
    """Why the compiled digests cannot run here (None: they can): libcrypto found,
    with the three symbols, and made resolvable for the kernels' object code."""
    try:
        path = _libcrypto_path()
    except ImportError:
        return "Python's hashlib has no OpenSSL (_hashlib)"
    if path is None:
        return "no libcrypto found"
    try:
        library = ctypes.CDLL(path)
        missing = [name for name in _SYMBOLS if not hasattr(library, name)]
        if missing:
            return f"{path} lacks {', '.join(missing)}"
        binding.load_library_permanently(path)
    except (OSError, RuntimeError) as exc:
        return f"cannot load {path}: {exc}"
    return None


#: Why the kernel is not used (None when it is): ``digests`` logs it once.
UNAVAILABLE = _load_libcrypto()
AVAILABLE = UNAVAILABLE is None

_BYTE_PTR = ir.IntType(8).as_pointer()


def _pointer(context, builder, array_type, array, at):
    """``&array[at]`` as a byte pointer (``array`` a C-contiguous uint8 array)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [at]), _BYTE_PTR)


def _external(builder, name, arguments):
    """Call the C function ``int name(arguments...)``, declared by name (resolved at link)."""
    signature = ir.FunctionType(ir.IntType(32), [a.type for a in arguments])
    return builder.call(cgutils.get_or_insert_function(builder.module, signature, name), arguments)


@intrinsic
def _sha256_init(typingctx, context_buffer):
    def codegen(context, builder, signature, args):
        zero = ir.Constant(ir.IntType(64), 0)
        state = _pointer(context, builder, signature.args[0], args[0], zero)
        return _external(builder, "SHA256_Init", [state])

    return types.int32(context_buffer), codegen


@intrinsic
def _sha256_update(typingctx, context_buffer, data, start, count):
    def codegen(context, builder, signature, args):
        zero = ir.Constant(ir.IntType(64), 0)
        state = _pointer(context, builder, signature.args[0], args[0], zero)
        first = _pointer(context, builder, signature.args[1], args[1], args[2])
        return _external(builder, "SHA256_Update", [state, first, args[3]])

    return types.int32(context_buffer, data, types.int64, types.int64), codegen


@intrinsic
def _sha256_final(typingctx, digest, context_buffer):
    def codegen(context, builder, signature, args):
        zero = ir.Constant(ir.IntType(64), 0)
        out = _pointer(context, builder, signature.args[0], args[0], zero)
        state = _pointer(context, builder, signature.args[1], args[1], zero)
        return _external(builder, "SHA256_Final", [out, state])

    return types.int32(digest, context_buffer), codegen


@njit(cache=True)
def sha256_ranges(data, width, offsets, mask, masked, state, digest, out):  # pragma: no cover
    """Row ``i`` of ``out`` (``(n, k)`` uint8, ``k <= 32``): the first ``k`` bytes of
    SHA-256 over ``data[offsets[i] * width:offsets[i + 1] * width]`` (tokens as bytes,
    ``width`` bytes each), then ``mask[offsets[i]:offsets[i + 1]]`` when ``masked``.
    ``state`` (``CONTEXT_BYTES``) and ``digest`` (``SHA256_BYTES``) are scratch
    uint8 arrays. Returns 0, or 1 when OpenSSL reported a failure (the caller then
    falls back: no digest of a failed call is kept)."""
    keep = out.shape[1]
    failed = 0
    for i in range(offsets.shape[0] - 1):
        lo = offsets[i]
        hi = offsets[i + 1]
        ok = _sha256_init(state)
        ok &= _sha256_update(state, data, lo * width, (hi - lo) * width)
        if masked:
            ok &= _sha256_update(state, mask, lo, hi - lo)
        ok &= _sha256_final(digest, state)
        if ok != 1:
            failed = 1
        for k in range(keep):
            out[i, k] = digest[k]
    return failed
