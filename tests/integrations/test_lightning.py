"""PyTorch Lightning on the stream: ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` trains one epoch with ``StreamDataModule``, each rank exactly its
``digest`` stream (the epoch's filler included), and ends with the hand loop's
parameters (its last short step too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the lightning extra is not installed")
pytest.importorskip("pytorch_lightning", reason="the lightning extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")

from _service import ROOT, env  # noqa: E402
from test_hf_trainer import (  # noqa: E402
    ACCUMULATION,
    WORLD,
    assert_parameters_equal,
    assert_trained,
    hand_loop,
    oracle,
    records,
)

pytestmark = pytest.mark.slow


def test_lightning_ddp_on_2_cpu_devices_trains_one_epoch_of_each_ranks_stream(service, tmp_path):
    config = {"endpoint": service.consumer_endpoint, "out": str(tmp_path), "vocab": 512}
    config["accumulation"] = ACCUMULATION
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_lightning.py"), str(tmp_path / "config.json")],
        cwd=ROOT,
        env=env() | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    per_rank = [oracle(service.settings, rank, WORLD) for rank in range(WORLD)]
    assert per_rank[1][-1].filler  # the epoch's tail: rank 1's last batch is all padding
    for rank in range(WORLD):
        assert_trained(records(tmp_path, rank), per_rank[rank])
    batches = [per_rank[g % WORLD][g // WORLD] for g in range(WORLD * len(per_rank[0]))]
    span = WORLD * ACCUMULATION
    steps = [batches[s : s + span] for s in range(0, len(batches), span)]
    _, parameters = hand_loop(steps)
    assert_parameters_equal(torch.load(tmp_path / "final.pt")["parameters"], parameters, 1e-10)
