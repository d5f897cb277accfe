"""Elastic resume over real processes: checkpoint at one world size, resume at another.

A job of ``W`` ranks (``streampack consume`` processes) stops after ``k`` batches per
rank and saves each rank's cursor; a job of ``W'`` ranks resumes from the list of those
cursors. Together the two jobs must receive every global batch of the uninterrupted
stream exactly once, in order per rank, byte for byte: each rank's ``StreamDigest`` is
compared with one built from the uninterrupted (world size 1, in-process) stream.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from _service import FIXTURE, ROOT, SMALL, Service, command, consume, env, flags, result

from streampack import PackedBatch
from streampack.client import StreamDigest
from streampack.service.digest import rank_stream
from streampack.settings import ProducerSettings

pytestmark = pytest.mark.slow

SETTINGS = {"shuffle": True, "seed": 3, "epochs": 2}


@pytest.fixture(scope="module")
def uninterrupted():
    """Every global batch of every epoch, in order: {epoch: [PackedBatch, ...]}."""
    settings = ProducerSettings(corpus=str(FIXTURE), **SMALL, **SETTINGS)
    batches: dict[int, list[PackedBatch]] = {}
    for epoch, index, batch in rank_stream(settings, 0, 1):
        assert index == len(batches.setdefault(epoch, []))
        batches[epoch].append(batch)
    return batches


def expected_digest(uninterrupted, rank, world_size, base=0, count=None):
    """What rank ``rank`` of ``world_size`` receives when epoch 0 is shared from global
    batch ``base`` on (``count`` batches, or to the end): the uninterrupted batches,
    numbered as they are, ``base + rank``, ``base + rank + world_size``, ..., with this
    world size's all-padding fillers at each epoch's tail (``tail = "fill"``)."""
    digest = StreamDigest()
    for epoch, batches in sorted(uninterrupted.items()):
        first = base if epoch == 0 else 0
        per_rank = -(-(len(batches) - first) // world_size)
        for index in range(first + rank, first + per_rank * world_size, world_size):
            if count is not None and digest.batches == count:
                break
            if index < len(batches):
                batch = batches[index]
            else:
                batch = PackedBatch.filler_like(
                    batches[0].binding, SMALL["max_rows_per_batch"], SMALL["capacity"]
                )
            digest.update(batch, epoch, index)
    return digest.hexdigest(), digest.batches


def run_job(endpoint, tmp_path, world_size, name, *extra):
    """``world_size`` consume processes, one per rank; their result lines."""
    procs = [
        consume(
            endpoint, rank, world_size, "--state-out", str(tmp_path / f"{name}-{rank}.json"), *extra
        )
        for rank in range(world_size)
    ]
    return [result(proc) for proc in procs]


@pytest.mark.parametrize(
    ("saved", "k", "resumed", "same_producer"),
    [(4, 5, 2, False), (2, 20, 3, False), (4, 3, 3, True)],
)
def test_a_job_resumed_at_another_world_size_receives_exactly_the_remaining_batches(
    tmp_path, uninterrupted, saved, k, resumed, same_producer
):
    """k batches per rank at ``saved`` ranks, then the rest at ``resumed`` ranks: after a
    restart of the whole service, or from the same producer (which then serves two
    world sizes one after the other). ``streampack digest --state-in`` agrees."""
    first = Service(FIXTURE, serve_workers=2, **SETTINGS).__enter__()
    second = None
    try:
        before = run_job(
            first.consumer_endpoint, tmp_path, saved, "before", "--max-batches", str(k)
        )
        for rank, line in enumerate(before):
            assert (line["digest"], line["batches"]) == expected_digest(
                uninterrupted, rank, saved, count=k
            )
        states = [
            json.loads((tmp_path / f"before-{rank}.json").read_text()) for rank in range(saved)
        ]
        assert states == [
            {"epoch": 0, "index": k * saved + rank, "base": 0, "rank": rank, "world_size": saved}
            for rank in range(saved)
        ]
        checkpoint = tmp_path / "checkpoint.json"
        checkpoint.write_text(json.dumps(states))
        if not same_producer:
            first.__exit__(None, None, None)
            first = None
            second = Service(FIXTURE, serve_workers=2, **SETTINGS).__enter__()
        endpoint = (second or first).consumer_endpoint
        after = run_job(endpoint, tmp_path, resumed, "after", "--state-in", str(checkpoint))
    finally:
        for service in (first, second):
            if service is not None:
                service.__exit__(None, None, None)
    for rank, line in enumerate(after):
        assert (line["digest"], line["batches"]) == expected_digest(
            uninterrupted, rank, resumed, base=k * saved
        )
        assert line["state"] == {
            "epoch": 2,
            "index": rank,
            "base": 0,
            "rank": rank,
            "world_size": resumed,
        }
    # `streampack digest` computes the resumed stream from the same checkpoint.
    rank = resumed - 1
    out = subprocess.run(
        command(
            "digest",
            *flags({"corpus": str(FIXTURE), **SMALL, **SETTINGS}),
            "--rank",
            str(rank),
            "--world-size",
            str(resumed),
            "--state-in",
            str(checkpoint),
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["digest"] == after[rank]["digest"]
    # The two jobs' real batches are the uninterrupted stream's, each exactly once.
    real = sum(line["batches"] - line["fillers"] for line in before + after)
    assert real == sum(len(batches) for batches in uninterrupted.values())


def test_consume_refuses_states_of_ranks_out_of_step(tmp_path):
    """No mapping to 3 ranks avoids a repeat or a gap when rank 0 had 2 batches and rank
    1 had 1: one line says so, no traceback, a failing exit status."""
    checkpoint = tmp_path / "checkpoint.json"
    checkpoint.write_text(
        json.dumps(
            [
                {"epoch": 0, "index": 4, "rank": 0, "world_size": 2},
                {"epoch": 0, "index": 3, "rank": 1, "world_size": 2},
            ]
        )
    )
    out = subprocess.run(
        command(
            "consume",
            "--connect",
            "tcp://127.0.0.1:1",
            "--rank",
            "0",
            "--world-size",
            "3",
            "--state-in",
            str(checkpoint),
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert (
        "consumed different numbers of batches (rank 0: epoch 0 after 2, rank 1: epoch 0 "
        "after 1)" in out.stderr
    )
