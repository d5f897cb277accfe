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


def test_a_lightning_checkpoint_resumes_the_stream_after_the_last_batch_trained(service, tmp_path):
    """One device, in this process: a run checkpointed at step 2 and resumed from that
    checkpoint trains every batch once. Lightning's loop had fetched a batch ahead when
    it saved; the data module's cursor is the batch trained, not the one fetched."""
    import pytorch_lightning as pl
    from _trainers import fingerprint, tiny_llama

    from streampack.integrations.lightning import StreamDataModule

    trained = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama(512)

        def training_step(self, batch, index):
            trained.append(fingerprint(batch))
            return self.trainer.datamodule.scale_loss(self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    def fit(steps: int, **kwargs) -> None:
        every = pl.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            accumulate_grad_batches=ACCUMULATION,
            callbacks=[every],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = StreamDataModule(service.consumer_endpoint, pad_id=0, timeout=120, prefetch=1)
        trainer.fit(Model(), datamodule=data, **kwargs)

    fit(3)  # trains step 3 too, then stops: its batches are lost work, trained again below
    assert len(trained) == 3 * ACCUMULATION
    del trained[2 * ACCUMULATION :]
    fit(4, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    want = oracle(service.settings, 0, 1, count=4 * ACCUMULATION)
    assert trained == [fingerprint(b.to_hf(pad_id=0)) for b in want]
