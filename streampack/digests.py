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
"""

from __future__ import annotations

import hashlib

import numpy as np

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
    width = tokens.dtype.itemsize
    marks = mask.view(np.uint8) if mask is not None else None
    out = np.empty((offsets.size - 1, DIGEST_BYTES), np.uint8)
    for i in range(offsets.size - 1):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        digest = hashlib.sha256(data[lo * width : hi * width].data)  # (a buffer, no copy)
        if marks is not None:
            digest.update(marks[lo:hi].data)
        out[i] = np.frombuffer(digest.digest()[:DIGEST_BYTES], np.uint8)
    return out
