"""Content digests: what lets a consumer trust tokens that did not come from the producer.

A worker that serves batches (or reads the corpus itself) is a peer like any other; a
consumer yields a batch from it only when its tokens are what the corpus holds. The unit
of that check is one *range* of a document, as an occurrence selects it: its content
digest is the first ``DIGEST_BYTES`` bytes of SHA-256 over

- its tokens, as the little-endian bytes of the corpus's token frame dtype
  (``wire.token_dtype`` of its vocabulary: uint16 when it fits, else int32) — the
  dtype the tokens travel in, so no side widens them to hash them — then
- its supervision mask (uint8, one 0/1 per token) when the corpus has one.

The same function computes it wherever the tokens are (a producer's window, a corpus
build, a consumer's received batch), so digests written once can be compared with
digests of tokens received much later. SHA-256 because a worker holds the tokens it
serves: it could steer a keyed or polynomial hash whose key it must be given, not this
one; truncated to 16 bytes because finding a second input for a given 128-bit digest is
as far out of reach, at half the bytes per document.

Computed by one compiled call over every range (``streampack.kernels.digest_cpu``:
OpenSSL's ``SHA256_*`` from Numba, cached: 1.3 ns per token at 240-token uint16
documents, against 8.9 for a hashlib call per range, ``benchmarks/digests.py``); where
libcrypto or those symbols are missing, or the kernel's answer on a known input is not
hashlib's, the hashlib loop (the same digests) with one log line.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Bytes of one range's content digest.
DIGEST_BYTES = 16
#: Token dtypes a digest is defined over (``wire.token_dtype``'s two answers).
TOKEN_DTYPES = (np.dtype("<u2"), np.dtype("<i4"))


def range_digests(
    tokens: np.ndarray, offsets: np.ndarray, mask: np.ndarray | None = None
) -> np.ndarray:
    """``(n, DIGEST_BYTES)`` uint8: row ``i`` digests ``tokens[offsets[i]:offsets[i + 1]]``
    (and the same slice of ``mask``), for ``n = len(offsets) - 1`` ranges laid end to end.

    ``tokens`` is one-dimensional uint16 or int32; ``offsets`` non-decreasing int64 from
    0 to at most ``tokens.size``; ``mask``, when given, uint8 of ``tokens``' shape.
    """
    tokens = np.ascontiguousarray(tokens)
    if tokens.ndim != 1 or tokens.dtype.newbyteorder("<") not in TOKEN_DTYPES:
        raise ValueError(
            f"tokens of dtype {tokens.dtype} and shape {tokens.shape}; expected one "
            "dimension of uint16 or int32"
        )
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0:
        raise ValueError(f"offsets {offsets[:4]}...; expected int64 starting at 0")
    if np.any(np.diff(offsets) < 0) or offsets[-1] > tokens.size:
        raise ValueError(f"offsets must rise from 0 to at most {tokens.size} tokens")
    if mask is not None and (mask.dtype != np.uint8 or mask.shape != tokens.shape):
        raise ValueError(
            f"mask of dtype {mask.dtype} and shape {mask.shape}; expected uint8 {tokens.shape}"
        )
    data = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    marks = None if mask is None else np.ascontiguousarray(mask)
    out = np.empty((offsets.size - 1, DIGEST_BYTES), np.uint8)
    width = tokens.dtype.itemsize
    kernel = _kernel()
    if kernel is not None:
        if _compiled(kernel, data, width, offsets, marks, out):
            return out
        _fall_back("OpenSSL's SHA256_* reported a failure")
    return _hashlib_digests(data, width, offsets, marks, out)


def _hashlib_digests(
    data: np.ndarray, width: int, offsets: np.ndarray, marks: np.ndarray | None, out: np.ndarray
) -> np.ndarray:
    """The definition, one ``hashlib`` call per range (``data``: the tokens' bytes,
    ``width`` per token): the reference the kernel is tested against, and the fallback
    where it cannot run."""
    for i in range(offsets.size - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        digest = hashlib.sha256(data[lo * width : hi * width].data)
        if marks is not None:
            digest.update(marks[lo:hi].data)
        out[i] = np.frombuffer(digest.digest()[:DIGEST_BYTES], np.uint8)
    return out


def _compiled(
    kernel: Any,
    data: np.ndarray,
    width: int,
    offsets: np.ndarray,
    marks: np.ndarray | None,
    out: np.ndarray,
) -> bool:
    """``_hashlib_digests`` by the compiled kernel, into ``out``; False when OpenSSL
    reported a failure (``out`` then holds nothing to keep)."""
    state = np.zeros(kernel.CONTEXT_BYTES, np.uint8)
    digest = np.zeros(kernel.SHA256_BYTES, np.uint8)
    masked = marks is not None
    marks = marks if marks is not None else np.zeros(0, np.uint8)
    return not kernel.sha256_ranges(data, width, offsets, marks, masked, state, digest, out)


_state: dict[str, Any] = {}  # "kernel": the compiled module once checked, or None


def _fall_back(why: str) -> None:
    """Use the hashlib loop from now on, said once in the log."""
    logger.warning("content digests: %s; using hashlib (the same digests, slower)", why)
    _state["kernel"] = None


def _kernel() -> Any:
    """``streampack.kernels.digest_cpu`` once it has given the definition's digests of
    a known input (imported on first use: the client loads no Numba at import), else
    None (OpenSSL or its symbols missing, or a wrong answer: said once)."""
    if "kernel" in _state:
        return _state["kernel"]
    from streampack.kernels import digest_cpu

    if not digest_cpu.AVAILABLE:
        _fall_back(f"no compiled SHA-256 ({digest_cpu.UNAVAILABLE})")
        return None
    # An empty range and a masked one checked against hashlib before any is trusted.
    probe = np.arange(70, dtype="<u2").view(np.uint8)
    marks = np.ones(70, np.uint8)
    offsets = np.array([0, 0, 70], np.int64)
    got = np.empty((2, DIGEST_BYTES), np.uint8)
    want = _hashlib_digests(probe, 2, offsets, marks, np.empty_like(got))
    if not _compiled(digest_cpu, probe, 2, offsets, marks, got) or not np.array_equal(got, want):
        _fall_back("the compiled SHA-256 disagreed with hashlib on a known input")
        return None
    _state["kernel"] = digest_cpu
    return digest_cpu
