"""Step targets (rule C7 over an optimizer step, issue 20 part 6): every batch carries
the loss-eligible targets of its whole step — W ranks x A micro-batches — so a trainer
divides by the step's count with no communication. Checked here for the arithmetic,
for ``digest`` (the oracle) against the global batch sequence, and for the producer
(driven in process, every message through the wire format) against ``digest``."""

from __future__ import annotations

import pytest
from _harness import Harness
from _service import FIXTURE, SMALL

from streampack import wire
from streampack.loss import step_loss, step_range
from streampack.service.digest import epoch_batches, rank_stream
from streampack.settings import ProducerSettings


def test_step_range_is_the_picture_of_the_loss_module():
    # W = 2, A = 2: global batches 0..3 are step 0, 4..7 step 1.
    assert [step_range(g, 2, 2) for g in range(8)] == [(0, 4)] * 4 + [(4, 8)] * 4
    assert step_range(9, 3, 1) == (9, 12)
    assert step_range(14, 3, 2, base=2) == (14, 20)  # an elastic resume counts from base


def test_step_loss_is_the_nll_over_the_steps_targets_and_a_filler_step_is_zero():
    assert step_loss(12.0, 48, world_size=2) == 0.5
    assert step_loss(0.0, 0, world_size=4) == 0.0  # all fillers: 0, never 0/0
    with pytest.raises(ValueError, match="step_targets = -1; accepted: >= 0"):
        step_loss(1.0, -1)


def brute_force(settings: ProducerSettings, world_size: int) -> dict[tuple[int, int], int]:
    """Each global index's step targets, from the whole global sequence (fillers count 0;
    under a drop tail the leftovers belong to no step)."""
    from streampack.corpus import open_corpus
    from streampack.service.delivery import rank_share

    source = open_corpus(settings.corpus_path())
    out = {}
    for epoch in range(settings.epochs):
        counts = [int(b.loss_mask.sum()) for b in epoch_batches(settings, source, epoch)]
        limit = rank_share(len(counts), world_size, settings.tail) * world_size
        for g in range(limit):
            first, stop = step_range(g, world_size, settings.accumulation)
            out[epoch, g] = sum(counts[first : min(stop, limit, len(counts))])
    return out


CASES = [
    {"accumulation": 2, "tail": "fill"},
    {"accumulation": 2, "tail": "drop"},
    {"accumulation": 3, "tail": "fill", "shuffle": True, "seed": 4},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"A{c['accumulation']}-{c['tail']}")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_digest_gives_every_batch_its_steps_targets(case, world_size):
    settings = ProducerSettings(corpus=str(FIXTURE), epochs=2, **SMALL, **case)
    want = brute_force(settings, world_size)
    got = {}
    for rank in range(world_size):
        for epoch, g, batch in rank_stream(settings, rank, world_size):
            got[epoch, g] = batch.step_targets
            assert batch.step_targets >= int(batch.loss_mask.sum())
    assert got == want
    # A step of the last group is cut short at the epoch's end, and holds the fillers.
    assert len(set(want.values())) > 1


class StepHarness(Harness):
    """The harness, each received batch reported with its step targets too."""

    def batches(self, identity: bytes) -> list[tuple[int, int, str, int | None]]:  # type: ignore[override]
        out = []
        for message in self.take(identity, "batch"):
            batch = wire.batch_from_message(message).expand()
            fields = message.fields
            out.append((fields["epoch"], fields["index"], batch.digest(), batch.step_targets))
        return out


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c["tail"])
def test_the_producer_sends_each_rank_the_steps_targets_digest_computes(case):
    """Rank 0 drained whole, then rank 1, under a reorder budget of a few batches: a
    batch waiting for the rest of its step makes room by evicting, never wedges."""
    settings = {"epochs": 2, "reorder_budget_bytes": 20_000, **case}
    harness = StepHarness(**settings)
    harness.join(b"w1")
    merged = {"corpus": str(FIXTURE), **SMALL, **settings}
    for rank in (0, 1):
        got = harness.drain(b"rank%d" % rank, rank, 2)
        want = [
            (e, g, b.digest(), b.step_targets)
            for e, g, b in rank_stream(ProducerSettings(**merged), rank, 2)
        ]
        assert got == want
    assert harness.counters["evicted"] > 0  # the budget was what it says: tight
