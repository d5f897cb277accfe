"""Documents longer than a row: quarantined (the default) or cut into ranges.

A source's manifest entry says which with ``long_documents``; :func:`split_ranges` is
the cut the window screen applies to a ``"split"`` source's documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streampack.errors import InvalidConfig

LONG_DOCUMENTS = ("quarantine", "split")


def split_ranges(
    start: np.ndarray, stop: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut each range ``[start[i], stop[i])`` into consecutive ranges of at most ``limit``
    tokens (``capacity + 1``: one row's worth of pairs)::

        document   t0 t1 t2 t3 t4 t5 t6 t7 t8 t9      limit = 4
        ranges     [t0 t1 t2 t3] [t4 t5 t6 t7] [t8 t9]
        pairs      t0>t1 t1>t2 t2>t3 | t4>t5 ... | t8>t9     lost: t3>t4 and t7>t8

    Each range is its own example: its pairs stay inside it (rule C1), so the one pair
    across each cut is not formed. A last range of a single token holds no pair and is
    not formed either (it would break C1); its cut still costs that one pair.

    Returns ``(owner, piece_start, piece_stop, pairs_cut)``: per range formed, the index
    of the range it came from and its bounds, in order; per input range, the pairs
    lost, ``(stop - start - 1) - sum(piece pairs)``.
    """
    if limit < 2:
        raise InvalidConfig(f"split limit {limit}: a range needs at least 2 tokens")
    start = np.asarray(start, np.int64)
    span = np.asarray(stop, np.int64) - start
    pieces = np.maximum(-(-span // limit), 0)
    owner = np.repeat(np.arange(len(span), dtype=np.int64), pieces)
    first_piece = np.cumsum(pieces) - pieces
    j = np.arange(int(pieces.sum()), dtype=np.int64) - first_piece[owner]
    piece_start = start[owner] + j * limit
    piece_stop = np.minimum(piece_start + limit, start[owner] + span[owner])
    formed = piece_stop - piece_start >= 2
    owner, piece_start, piece_stop = owner[formed], piece_start[formed], piece_stop[formed]
    kept_pairs = np.bincount(
        owner, weights=piece_stop - piece_start - 1, minlength=len(span)
    ).astype(np.int64)
    pairs_cut = np.maximum(span - 1, 0) - kept_pairs
    return owner, piece_start, piece_stop, pairs_cut


def long_documents_policy(entry: dict[str, Any], where: str) -> str:
    """A source entry's ``long_documents`` (default ``quarantine``), checked."""
    policy = entry.get("long_documents", "quarantine")
    if policy not in LONG_DOCUMENTS:
        raise InvalidConfig(
            f"{where}: long_documents {policy!r}; expected one of {', '.join(LONG_DOCUMENTS)}"
        )
    return str(policy)
