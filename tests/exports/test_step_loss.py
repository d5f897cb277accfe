"""The token-weighted loss over a whole optimizer step (rule C7, issue 20 part 6), with
real models: 2 ranks x 2 micro-batches in real processes (torch.distributed, gloo,
DDP) reading the real service give exactly the gradient of one process taking the
token-weighted mean over all four batches; the per-micro-batch mean differs; a filler
batch's loss is exactly 0 with a zero gradient."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import streampack as sp
from streampack.loss import step_loss

torch = pytest.importorskip("torch", reason="the hf extra is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from _ddp import ACCUMULATION, VOCAB, nll_sum, tiny_model  # noqa: E402
from _service import FIXTURE, ROOT, SMALL, Service, env  # noqa: E402

BINDING = sp.Binding(VOCAB, "tiny", "step", "train")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((abs(a - b) <= 1e-10 + 1e-9 * torch.maximum(abs(a), abs(b))).all())


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_a_filler_batch_has_loss_exactly_0_and_zero_gradient_with_its_step_count():
    model = tiny_model()
    filler = sp.PackedBatch.filler_like(BINDING, rows=2, capacity=8, step_targets=57)
    loss = model(**filler.to_hf(pad_id=0, num_items_in_batch=True)).loss
    assert loss.item() == 0.0
    assert all(not g.any() for g in gradients(model, loss).values())
    assert step_loss(torch.tensor(0.0), 57, 2).item() == 0.0
    # Without it, transformers' mean over zero targets is 0/0: the NaN every loss log,
    # all-reduced metric and loss-spike guard of a data-parallel step would see.
    assert torch.isnan(model(**filler.to_hf(pad_id=0)).loss)
    with pytest.raises(sp.InvalidArray, match="num_items_in_batch=True needs step_targets"):
        sp.PackedBatch.filler_like(BINDING, rows=1, capacity=8).to_hf(
            pad_id=0, num_items_in_batch=True
        )


@pytest.mark.slow
def test_two_ranks_two_micro_batches_under_ddp_equal_one_token_weighted_step(tmp_path):
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    world = 2
    settings = {"accumulation": ACCUMULATION}
    out = tmp_path / "grads.pt"
    with Service(FIXTURE, **settings) as service:
        service.add_worker()
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "_ddp.py"),
                    str(rank),
                    str(world),
                    str(tmp_path / "init"),
                    service.consumer_endpoint,
                    str(out),
                ],
                cwd=ROOT,
                env=env(),
            )
            for rank in range(world)
        ]
        for proc in ranks:
            assert proc.wait(timeout=300) == 0
    saved = torch.load(out)

    # The oracle: one process, the first step's four batches, their token-weighted mean.
    merged = ProducerSettings(corpus=str(FIXTURE), **SMALL, **settings)
    step = {}
    for rank in range(world):
        for _, g, batch in rank_stream(merged, rank, world):
            if g < world * ACCUMULATION:
                step[g] = batch
    batches = [step[g] for g in range(world * ACCUMULATION)]
    counts = [int(b.loss_mask.sum()) for b in batches]
    assert len(set(counts)) > 1  # unequal batches: the two weightings below differ
    for record in saved["ranks"]:
        assert record["step_targets"] == [sum(counts)] * ACCUMULATION
        for hf_loss, loss in zip(record["hf_loss"], record["loss"]):
            assert abs(hf_loss - loss) <= 1e-6 * loss  # transformers' loss is float32 inside

    model = tiny_model()
    sums = [nll_sum(model, b)[0] for b in batches]
    want = gradients(model, sum(sums) / sum(counts))
    got = saved["grads"]
    assert got.keys() == want.keys()
    for name in want:
        assert close(got[name], want[name]), name
    # The usual bug: each micro-batch's own mean, averaged over micro-batches and ranks.
    model = tiny_model()
    means = [nll_sum(model, b)[0] / c for b, c in zip(batches, counts)]
    wrong = gradients(model, sum(means) / len(means))
    assert not all(close(got[name], wrong[name]) for name in want)
    assert np.isfinite([g.abs().max().item() for g in got.values()]).all()
