"""The service under ``policy = "best_fit"``: real processes deliver exactly the stream
``streampack digest`` computes, batches say which policy made them, and the fill is
better than next-fit's on the same corpus."""

from __future__ import annotations

import pytest
from _service import FIXTURE, Service, drain_ranks, expected, stream_digest

pytestmark = pytest.mark.slow

BEST_FIT = {"policy": "best_fit", "open_rows": 8, "shuffle": True, "seed": 5}


def test_best_fit_stream_equals_the_in_process_digest_for_every_rank():
    reference = {rank: expected(FIXTURE, rank, 2, **BEST_FIT) for rank in (0, 1)}
    next_fit = {
        rank: expected(FIXTURE, rank, 2, **(BEST_FIT | {"policy": "next_fit", "open_rows": None}))
        for rank in (0, 1)
    }
    # The policy changes the stream (so the comparison below can fail) and packs the
    # same tokens into fewer batches.
    assert reference[0]["digest"] != next_fit[0]["digest"]
    assert sum(r["tokens"] for r in reference.values()) == sum(
        r["tokens"] for r in next_fit.values()
    )
    assert sum(r["batches"] - r["fillers"] for r in reference.values()) < sum(
        r["batches"] - r["fillers"] for r in next_fit.values()
    )

    with Service(FIXTURE, serve_workers=2, **BEST_FIT) as service:
        received = drain_ranks(service.consumer_endpoint, 2)
    for rank in (0, 1):
        assert stream_digest(received[rank]) == (
            reference[rank]["digest"],
            reference[rank]["batches"],
        )
        assert {batch.stats()["policy"] for _, batch in received[rank]} == {"best_fit"}
