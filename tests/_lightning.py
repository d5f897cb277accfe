"""The Lightning run of tests/integrations/test_lightning.py: ``python tests/_lightning.py
CONFIG.json`` (Lightning's ``ddp`` launcher starts rank 1 by running it again).

A tiny float64 Llama trained by ``pytorch_lightning.Trainer(accelerator="cpu",
devices=2, strategy="ddp")`` on ``StreamDataModule`` for one epoch of the stream, SGD,
``accumulate_grad_batches`` = the producer's accumulation. Each rank records what every
``training_step`` receives to ``OUT/rank{R}.jsonl``; rank 0 saves the parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from _trainers import fingerprint, tiny_llama

from streampack.integrations.lightning import StreamDataModule


class Model(pl.LightningModule):
    def __init__(self, vocab: int, out: Path) -> None:
        super().__init__()
        self.model = tiny_llama(vocab)
        self.out = out

    def training_step(self, batch, index):
        with (self.out / f"rank{self.global_rank}.jsonl").open("a") as log:
            fields = {
                "fingerprint": fingerprint(batch),
                "num_items_in_batch": batch["num_items_in_batch"],
            }
            log.write(json.dumps(fields) + "\n")
        return self.trainer.datamodule.scale_loss(self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(config["out"])
    model = Model(config["vocab"], out)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        accumulate_grad_batches=config["accumulation"],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = StreamDataModule(config["endpoint"], pad_id=0, timeout=120, prefetch=2)
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        parameters = {n: p.detach().clone() for n, p in model.model.named_parameters()}
        torch.save({"parameters": parameters}, out / "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
