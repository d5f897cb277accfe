"""The randomized fault-injection tier (``make chaos``): seeded schedules of faults
against a real producer, real pack workers and real trainers, each run checked batch
by batch against the in-process ``digest`` stream and for exactly-once delivery.

    make chaos                          the CI seeds (0 .. DEFAULT_SEEDS-1)
    make chaos CHAOS_SEEDS=200          more of them
    make chaos CHAOS_SEEDS=100-199      a range of seeds
    make chaos CHAOS_SEED=17            replay one seed (printed by a failing run)
    make chaos CHAOS_FAULTS=all         also the opt-in kinds (late_workers) and the disabled ones
    make chaos CHAOS_FAULTS=late_workers,worker_kill    workers starting 6 s after the trainers
    make chaos CHAOS_FAULTS=trainer_kill,garbage    only these kinds

``harness.py`` says what a run does and checks; ``peers.py`` holds the raw-zmq peers.
"""

from __future__ import annotations

import os

import pytest
from harness import WAIT_BOUND, Plan, replay_command, run_seed, selected_kinds

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

#: Seeds CI runs: about 10 CPU-seconds each, the tier within four minutes on two cores;
#: 0-12 draw every kind of the data plane (seed 12 the wrong batch and the idle consumer).
DEFAULT_SEEDS = 13


def _seeds() -> list[int]:
    one = os.environ.get("CHAOS_SEED", "")
    if one:
        return [int(one)]
    spec = os.environ.get("CHAOS_SEEDS", "") or str(DEFAULT_SEEDS)
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last) + 1)) if last else list(range(int(first)))


KINDS = selected_kinds(os.environ.get("CHAOS_FAULTS"))


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    """Compile (or load) the kernels once, into the Numba cache the run's processes share,
    so a fresh checkout does not compile them in seven processes at once."""
    from streampack.packing import warm_up_kernels

    warm_up_kernels()


@pytest.mark.parametrize("seed", _seeds())
def test_every_rank_receives_exactly_the_digest_stream_under_faults(seed, tmp_path):
    """Whatever the seed's faults do, each trainer process receives exactly the oracle's
    batches from the cursor it started at, and each rank reaches the stream's end."""
    run = run_seed(seed, tmp_path, KINDS)
    print(f"seed {seed}: {run.plan.describe()}")
    print("\n".join(run.events))
    waited, where = run.longest_wait()
    print(f"longest wait for a batch: {waited:.2f}s ({where}; bound {WAIT_BOUND}s)")
    print(f"replay: {replay_command(run.plan)}")
    assert all(segments[-1].ended for segments in run.segments.values())


def test_a_seed_draws_the_same_plan_every_time():
    """Replaying a seed replays its schedule: the plan is a function of the seed alone."""
    assert Plan.draw(12345, KINDS) == Plan.draw(12345, KINDS)
    assert Plan.draw(1, KINDS) != Plan.draw(2, KINDS)
