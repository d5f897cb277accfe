"""``StreamDataModule``: each rank's stream as a PyTorch Lightning data module.

    class Model(pl.LightningModule):
        def training_step(self, batch, index):
            # NLL sum / step_targets, undoing DDP's mean and Lightning's division by
            # accumulate_grad_batches (see scale_loss)
            return self.trainer.datamodule.scale_loss(self.model(**batch).loss)

    data = StreamDataModule("tcp://127.0.0.1:5556", pad_id=0)
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2,
               max_epochs=1).fit(Model(), datamodule=data)

Batches are ``StreamDataset`` items (``to_hf`` dicts with ``num_items_in_batch``). What
Lightning 2's code does that this answers:

- The rank is known only once the strategy has set up (the ``ddp`` launcher starts the
  other ranks by running the script again), so the ``BatchStream`` is created in
  ``setup`` with ``trainer.global_rank`` and ``trainer.world_size``. A distributed
  sampler is never injected (``use_distributed_sampler`` leaves an
  ``IterableDataset``'s loader alone: ``_DataConnector._requires_distributed_sampler``).
- The fit loop fetches one batch ahead (``_PrefetchDataFetcher``, to know the last
  one), so a loader's own state at a checkpoint is a batch past what was trained, and
  ``_FitLoop.on_save_checkpoint`` would save that (a resume would skip the batch). The
  loader here is a plain ``DataLoader``; the module's ``state_dict`` (saved by
  Lightning in every checkpoint, on every rank) holds every rank's cursor after the
  last batch handed to ``training_step`` (``on_before_batch_transfer``), and
  ``load_state_dict`` resumes the stream there, at this world size or another.
- Automatic optimization divides each micro-batch's loss by ``accumulate_grad_batches``
  (``_ClosureResult.from_training_step_output``), the last short step of an epoch
  included, and DDP averages over the ranks; ``scale_loss`` multiplies both back, so
  ``model(**batch).loss`` (NLL sum / ``step_targets``) makes the step's exact mean.
  The producer's ``accumulation`` must equal ``accumulate_grad_batches``: the
  micro-batches of one step must carry one ``step_targets``, checked at every batch.

Needs the ``lightning`` extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from streampack.client import BatchStream
from streampack.errors import InvalidConfig, StreampackError
from streampack.integrations.torch import StreamDataset, gather_states, saved_states

try:
    import pytorch_lightning as pl
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise StreampackError(
        "streampack.integrations.lightning needs PyTorch Lightning; install it with: "
        "pip install 'streampack[lightning]'"
    ) from error


class _Tagged(NamedTuple):
    """An item with the stream's cursor after it (a named tuple: torch's loaders turn a
    plain tuple into a list, and keep a named one)."""

    cursor: dict[str, int]
    item: dict[str, Any]


class _WithCursor(torch.utils.data.IterableDataset):
    """Each item of a ``StreamDataset``, tagged with the cursor after it."""

    def __init__(self, dataset: StreamDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[_Tagged]:
        for item in self.dataset:
            yield _Tagged(self.dataset.stream.state_dict(), item)


class StreamDataModule(pl.LightningDataModule):
    """One ``BatchStream`` per rank, created in ``setup`` (module doc).

    Args:
        endpoint: the producer's consumer endpoint.
        pad_id, mask, mask_dtype: as ``PackedBatch.to_hf``.
        stream: further ``BatchStream`` keyword arguments (``prefetch``, ``timeout``, ...).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        pad_id: int,
        mask: str | None = None,
        mask_dtype: Any = None,
        **stream: Any,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self._to_hf = {"pad_id": pad_id, "mask": mask, "mask_dtype": mask_dtype}
        self._stream_arguments = stream
        self.dataset: StreamDataset | None = None
        self._trained: dict[str, int] | None = None  # the cursor after the last batch trained
        self._micro = 0  # micro-batches handed to training_step since setup or a restore
        self._step_targets: int | None = None

    @property
    def fitting(self) -> pl.Trainer:
        """The Trainer this module is attached to (by ``Trainer.fit``)."""
        if self.trainer is None:
            raise InvalidConfig("the StreamDataModule is used by Trainer.fit(datamodule=...)")
        return self.trainer

    @property
    def stream(self) -> BatchStream:
        if self.dataset is None:
            raise InvalidConfig(
                "the StreamDataModule has no stream before Trainer.fit calls its setup"
            )
        return self.dataset.stream

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            stream = BatchStream(
                self.endpoint,
                rank=self.fitting.global_rank,
                world_size=self.fitting.world_size,
                **self._stream_arguments,
            )
            self.dataset = StreamDataset(stream, **self._to_hf)
            self._trained = stream.state_dict()

    def train_dataloader(self) -> Any:
        if self.dataset is None:
            raise InvalidConfig("StreamDataModule.train_dataloader is called by Trainer.fit")
        return torch.utils.data.DataLoader(_WithCursor(self.dataset), batch_size=None)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, _Tagged):
            return batch
        cursor, item = batch
        accumulate = self.fitting.accumulate_grad_batches
        targets = int(item["num_items_in_batch"])
        if self._micro % accumulate and targets != self._step_targets:
            raise InvalidConfig(
                f"micro-batch {self._micro % accumulate} of an optimizer step carries "
                f"step_targets {targets}, the step's first {self._step_targets}: the "
                f"producer's accumulation must equal accumulate_grad_batches={accumulate}"
            )
        self._step_targets = targets
        self._micro += 1
        self._trained = cursor
        return item

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` (a batch's NLL sum / its step's targets) times the world size and
        ``accumulate_grad_batches``, which DDP's mean and Lightning divide out again."""
        return loss * self.fitting.world_size * self.fitting.accumulate_grad_batches

    def state_dict(self) -> dict[str, Any]:
        """Every rank's cursor after its last batch trained (a collective: Lightning
        builds a checkpoint on every rank)."""
        if self._trained is None:
            return {}
        return {"ranks": gather_states(self._trained, self.stream.world_size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.stream.load_state_dict(saved_states(state))
        self._trained = self.stream.state_dict()
        self._micro = 0

    def teardown(self, stage: str) -> None:
        if self.dataset is not None and stage == "fit":
            self.dataset.stream.close()
