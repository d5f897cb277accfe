"""Planning shared by the CPU and CUDA attention kernels (rule C6's blocks and tasks).

A **block** is a run of at most ``tile`` consecutive queries of one row that stops
before every segment start (:func:`next_block`), so it never mixes two segments;
:func:`key_query_end` gives, per key, one past the last query whose range reaches it
(the queries a key block's backward needs, on both devices). The CPU planners deal the
work into one bin per thread, longest first (:func:`plan_forward`,
:func:`plan_backward`); :func:`tile_bounds` gives the tiled CUDA kernels, per aligned
query tile, the keys to visit and the key tiles that need no mask.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def next_block(starts_row, a, stop, tile):  # pragma: no cover - compiled
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
                b, lowest = next_block(starts[r], a, q1, tile_q)
                tile_cost[r, t] += (b - a) * (b - lowest) + 16.0
                a = b
            if tile_cost[r, t] > 0:
                count += heads
    task_rh = np.empty(count, np.int64)
    task_q0 = np.empty(count, np.int64)
    task_cost = np.empty(count, np.float64)
    i = 0
    for r in range(rows):
        for h in range(heads):
            for t in range(n_tiles):
                if tile_cost[r, t] > 0:
                    task_rh[i] = r * heads + h
                    task_q0[i] = t * tile_q
                    task_cost[i] = tile_cost[r, t]
                    i += 1
    order, offsets = _deal(task_cost, n_bins)
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
                b, lowest = next_block(starts[r], a, e, tile_q)
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
    task_cost = np.empty(count, np.float64)
    i = 0
    for t in range(n_chunks):
        for h in range(heads):
            task_rh[i] = chunk_row[t] * heads + h
            task_lo[i] = chunk_lo[t]
            task_hi[i] = chunk_hi[t]
            task_cost[i] = chunk_cost[t]
            i += 1
    order, offsets = _deal(task_cost, n_bins)
    return task_rh, task_lo, task_hi, order, offsets


@njit(cache=True)
def tile_bounds(starts, valid, tile, bounds):  # pragma: no cover - compiled
    """Per aligned query tile ``[t * tile, (t + 1) * tile)`` of each row, what the tiled
    CUDA kernels need to skip and to mask (``bounds`` is int32 ``[rows, tiles, 4]``):

    * ``[0]``, ``[1]``: ``lo``, the smallest start of the tile's active queries, and
      ``hi``, one past its last active query. The keys any of them may use are
      ``[lo, hi)`` (every range holds its own query and the queries are consecutive,
      so the union has no gap): key tiles outside it are fully masked and never
      loaded. ``lo = hi = 0`` for a tile with no active query.
    * ``[2]``, ``[3]``: the largest start and the first query plus one when every query
      of the tile is active, else ``0, 0``. A key tile ``[k0, k0 + n)`` with
      ``bounds[2] <= k0`` and ``k0 + n <= bounds[3]`` is inside every range of the
      tile: no mask is applied to it.
    """
    rows, capacity = starts.shape
    n_tiles = bounds.shape[1]
    for r in range(rows):
        for t in range(n_tiles):
            q0 = t * tile
            q1 = min(q0 + tile, valid[r])
            lowest = 0
            highest = 0
            if q1 > q0:
                lowest = starts[r, q0]
                highest = starts[r, q0]
                for qi in range(q0 + 1, q1):
                    lowest = min(lowest, starts[r, qi])
                    highest = max(highest, starts[r, qi])
            bounds[r, t, 0] = lowest
            bounds[r, t, 1] = q1 if q1 > q0 else 0
            full = q1 == q0 + tile
            bounds[r, t, 2] = highest if full else 0
            bounds[r, t, 3] = q0 + 1 if full else 0
