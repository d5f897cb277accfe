"""The weighted schedule of a mixture: which source each step of an epoch picks.

A mixture lists sources with weights, say A: 3 and B: 1. Each epoch interleaves their
documents by *smooth weighted round-robin* (the schedule nginx balances with): every
step, each source's credit grows by its weight, the source with the most credit (the
lowest index on a tie) is picked and pays the sum of all weights. With integer weights
the picks repeat with a period of ``sum(weights)``, and in every prefix of the stream
each source's count is within one of its exact share::

    weights  A=3 B=1                    credit before the pick   pick
    step 0                               A 3  B 1                 A  (A 3-4 = -1)
    step 1                               A 2  B 2                 A  (tie: lowest index)
    step 2                               A 1  B 3                 B  (B 3-4 = -1)
    step 3                               A 4  B 0                 A  -> back to A 0 B 0
    period   A A B A | A A B A | ...

The n-th pick of a source takes its n-th document in the source's own order for the
epoch: corpus order, or with ``shuffle`` a permutation drawn from ``(seed, epoch,
source, cycle)``. So the stream depends only on (seed, epoch, weights, source sizes),
never on workers or timing.

When is an epoch over? ``stopping`` says, with the names Hugging Face's
``interleave_datasets`` uses:

* ``first_exhausted`` (default): the epoch ends at the first pick of a source that has
  no document left. No document repeats within an epoch; the larger sources are cut
  short (the next epoch starts them over, in a new order).
* ``all_exhausted``: a source that runs out starts over (its next *cycle*, a new order
  when shuffled) until every source has been visited whole at least once; the epoch
  ends at the first pick of a source that runs out when all others already have. Small
  sources repeat; no document of any source is left out.

With sizes ``n_k`` the epoch's length is ``min_k T_k`` or ``max_k T_k``, where ``T_k``
is the step of source ``k``'s pick number ``n_k`` (counting from 0): the first pick
that finds it empty.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from streampack.errors import InvalidConfig

STOPPING = ("first_exhausted", "all_exhausted")

#: Largest period (sum of the weights reduced to integers) accepted: the schedule holds
#: one period, 8 bytes a step. Weights like 0.7/0.3 or 3/1 have periods of 10 and 4.
MAX_PERIOD = 1 << 20


def check_stopping(stopping: object, where: str) -> str:
    """A mixture's ``stopping`` rule, checked (the one place it is)."""
    if stopping not in STOPPING:
        raise InvalidConfig(
            f"{where}: stopping {stopping!r}; expected one of {', '.join(STOPPING)}"
        )
    return str(stopping)


def integer_weights(weights: Sequence[float | int]) -> tuple[int, ...]:
    """``weights`` as the smallest integers in the same exact ratios.

    Each weight is read as the decimal it prints as (0.1 is 1/10, not the binary
    fraction nearest to it), so the schedule is the one the manifest's text describes.
    """
    if not weights:
        raise InvalidConfig("a mixture needs at least one source with a weight")
    fractions = []
    for i, weight in enumerate(weights):
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not (math.isfinite(weight) and weight > 0)
        ):
            raise InvalidConfig(f"source {i}: weight {weight!r} must be a positive finite number")
        fractions.append(Fraction(repr(weight)) if isinstance(weight, float) else Fraction(weight))
    denominator = math.lcm(*(f.denominator for f in fractions))
    scaled = [int(f * denominator) for f in fractions]
    divisor = math.gcd(*scaled)
    result = tuple(w // divisor for w in scaled)
    if sum(result) > MAX_PERIOD:
        raise InvalidConfig(
            f"weights {list(weights)} are in the ratios {list(result)}, a schedule period of "
            f"{sum(result)} steps; at most {MAX_PERIOD} are accepted: round the weights "
            f"(e.g. to 3 significant digits)"
        )
    return result


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The smooth weighted round-robin over sources with these weights (module doc).

    ``pattern[t]`` is the source picked at step ``t`` of one period; the pattern repeats.
    """

    weights: tuple[int, ...]
    pattern: np.ndarray  # int64 source per step of one period
    before: np.ndarray  # int64 per step: earlier steps of the period picking that source
    steps: tuple[np.ndarray, ...]  # per source: the steps of the period that pick it

    @classmethod
    def of(cls, weights: Sequence[float | int]) -> Schedule:
        reduced = integer_weights(weights)
        period = sum(reduced)
        pattern = np.empty(period, np.int64)
        credit = [0] * len(reduced)
        for t in range(period):
            for k, w in enumerate(reduced):
                credit[k] += w
            pick = max(range(len(reduced)), key=lambda k: (credit[k], -k))
            credit[pick] -= period
            pattern[t] = pick
        steps = tuple(np.flatnonzero(pattern == k) for k in range(len(reduced)))
        before = np.empty(period, np.int64)
        for where in steps:
            before[where] = np.arange(len(where))
        return cls(weights=reduced, pattern=pattern, before=before, steps=steps)

    @property
    def period(self) -> int:
        return len(self.pattern)

    def picks(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps ``lo..hi-1``: the source each picks, and which pick of that source it
        is (0 for its first)."""
        t = np.arange(lo, hi, dtype=np.int64)
        cycle, step = np.divmod(t, self.period)
        source = self.pattern[step]
        weight = np.asarray(self.weights, np.int64)[source]
        return source, cycle * weight + self.before[step]

    def step_of_pick(self, source: int, n: int) -> int:
        """The step at which ``source`` makes its pick number ``n`` (from 0)."""
        cycle, within = divmod(n, self.weights[source])
        return cycle * self.period + int(self.steps[source][within])

    def epoch_length(self, sizes: Sequence[int], stopping: str) -> int:
        """Documents (steps) in an epoch over sources of these sizes (module doc);
        ``stopping`` as :func:`check_stopping` accepts it."""
        if len(sizes) != len(self.weights):
            raise InvalidConfig(f"{len(sizes)} source sizes for {len(self.weights)} weights")
        ends = [self.step_of_pick(k, n) for k, n in enumerate(sizes)]
        return min(ends) if stopping == "first_exhausted" else max(ends)
