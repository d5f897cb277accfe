"""``StreamTrainer`` and ``StreamSFTTrainer``: ``transformers.Trainer`` and TRL's
``SFTTrainer`` training on one rank's stream each, exactly, and resuming it.

    stream = sp.BatchStream(endpoint, rank=args.process_index, world_size=args.world_size)
    trainer = StreamTrainer(model=model, args=args, train_dataset=StreamDataset(stream, pad_id=0))
    trainer.train()                                   # or train(resume_from_checkpoint=True)

``StreamTrainerMixin`` does the same for any other subclass of Trainer:
``class MyTrainer(StreamTrainerMixin, AxolotlTrainer): pass``. What it changes, and the
code in transformers 5 and accelerate 1.16 each change answers:

- The train loader (``get_train_dataloader``): Trainer's ``_get_dataloader`` collates
  ``per_device_train_batch_size`` items and passes the loader to
  ``accelerator.prepare``, whose ``prepare_data_loader`` defaults to
  ``dispatch_batches=True`` for an ``IterableDataset`` (rank 0 reads and splits each
  batch across the ranks) and otherwise wraps it in ``IterableDatasetShard`` (each rank
  keeps one batch in ``num_processes``). Each rank's stream is already its own, so the
  loader here is a plain ``DataLoader(dataset, batch_size=None)``, never prepared:
  every batch reaches ``_prepare_inputs`` whole, which moves it to the device and adds
  nothing (no ``attention_mask``: transformers finds the documents in ``position_ids``).
- The step's count (``_get_num_items_in_batch``): Trainer counts the ``shift_labels``
  of the step's micro-batches and all-gathers the count over the ranks; every batch of
  the stream carries that count already, ``step_targets``. The two are compared at
  every step (they differ when the producer's ``accumulation`` is not
  ``gradient_accumulation_steps``, or a step straddles an epoch's end) and the stream's
  is used.
- Checkpoints (``_save_checkpoint``): every rank's ``BatchStream.state_dict()`` is
  gathered and written to ``streampack_stream.json`` in the checkpoint folder, before
  Trainer's own files, so a checkpoint with a ``trainer_state.json`` has it. ``train(
  resume_from_checkpoint=...)`` loads it into the stream first: the stream continues at
  the next batch, on this world size or another, and the service starts there (no
  prefix replayed). Trainer's own resume skips the steps already trained by reading and
  dropping batches (``_run_epoch`` -> accelerate's ``skip_first_batches``), which on a
  resumed stream would drop batches never trained: ``ignore_data_skip=True`` is
  required.

Settings that would break the stream are refused in ``__init__``, one line each
(``InvalidConfig``): ``per_device_train_batch_size != 1``, ``dataloader_num_workers >
0``, ``ignore_data_skip=False``, ``average_tokens_across_devices=False`` on several
processes (the loss would miss its world-size factor), ``n_gpu > 1`` (DataParallel),
a stream whose rank or world size is not the process's, a model whose forward takes no
``num_items_in_batch``, a ``StreamDataset`` without ``num_items_in_batch``.

Needs the ``hf`` extra (``StreamSFTTrainer``: the ``sft`` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any

from streampack.errors import InvalidConfig, StreampackError
from streampack.integrations.torch import StreamDataset, saved_states

try:
    import torch
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - depends on the environment
    raise StreampackError(
        "streampack.integrations.hf needs transformers and accelerate; install them with: "
        "pip install 'streampack[hf]'"
    ) from error

#: The file in each Trainer checkpoint folder that holds every rank's stream cursor.
STATE_FILE = "streampack_stream.json"
STATE_FORMAT = "streampack-stream-state"


def _refusal(trainer: Any, dataset: StreamDataset) -> str | None:
    """The first setting of ``trainer`` that would break the stream, as one line."""
    args = trainer.args
    stream = dataset.stream
    if args.per_device_train_batch_size != 1:
        return (
            f"per_device_train_batch_size={args.per_device_train_batch_size}: a streampack "
            "batch is already a whole micro-batch (its rows packed by the producer, "
            "max_rows_per_batch); collating several would break their rows. Set "
            "per_device_train_batch_size=1"
        )
    if args.dataloader_num_workers != 0:
        return (
            f"dataloader_num_workers={args.dataloader_num_workers}: every worker would read "
            "its own copy of the stream; set dataloader_num_workers=0 (the BatchStream "
            "already fetches ahead)"
        )
    if not args.ignore_data_skip:
        return (
            "ignore_data_skip=False: on resume Trainer skips the steps already trained by "
            "reading and dropping batches, but the stream resumes at its saved cursor, so "
            "it would drop batches never trained; set ignore_data_skip=True"
        )
    if args.n_gpu > 1:
        return (
            f"n_gpu={args.n_gpu}: nn.DataParallel splits each batch across the GPUs and "
            "divides the step's count by guesswork; start one process per GPU (torchrun)"
        )
    if (stream.rank, stream.world_size) != (args.process_index, args.world_size):
        return (
            f"the stream is rank {stream.rank} of {stream.world_size}, but this process is "
            f"{args.process_index} of {args.world_size}; create it with "
            "BatchStream(..., rank=args.process_index, world_size=args.world_size)"
        )
    if args.world_size > 1 and not args.average_tokens_across_devices:
        return (
            f"average_tokens_across_devices=False on {args.world_size} processes: Trainer "
            "would not multiply the loss by the world size, and DDP's mean would divide "
            "the step's exact loss by it; set average_tokens_across_devices=True"
        )
    if not trainer.model_accepts_loss_kwargs:
        return (
            f"{type(trainer.model).__name__}.forward takes no num_items_in_batch (no "
            "**kwargs), so Trainer would average each micro-batch by itself instead of "
            "dividing by the step's count; use a model whose forward takes loss kwargs"
        )
    if not dataset.num_items_in_batch:
        return (
            "StreamDataset(num_items_in_batch=False): the trainer takes each step's count "
            "from the batches' step_targets; leave num_items_in_batch=True"
        )
    return None


class StreamTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass (module doc): its
    ``train_dataset`` is a ``StreamDataset``."""

    # The attributes of transformers.Trainer this mixin reads.
    args: Any
    state: Any
    train_dataset: Any

    def __init__(self, *args: Any, train_dataset: Any = None, **kwargs: Any) -> None:
        if not isinstance(train_dataset, StreamDataset):
            raise InvalidConfig(
                f"train_dataset={type(train_dataset).__name__}: {type(self).__name__} trains "
                "on one rank's stream; give train_dataset=StreamDataset(BatchStream(...), "
                "pad_id=...) by keyword"
            )
        super().__init__(*args, train_dataset=self._stand_in(train_dataset), **kwargs)  # type: ignore[call-arg]
        self.train_dataset = train_dataset
        refused = _refusal(self, train_dataset)
        if refused is not None:
            raise InvalidConfig(refused)

    def _stand_in(self, dataset: StreamDataset) -> Any:
        """What the base class's ``__init__`` is given as ``train_dataset``."""
        return dataset

    def get_train_dataloader(self) -> Any:
        # Not prepared by accelerate, and not collated: see the module doc.
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=None, num_workers=0)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        counted = super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        ours = [b["num_items_in_batch"] for b in batch_samples if "num_items_in_batch" in b]
        if not ours or len(ours) != len(batch_samples):
            return counted  # not the stream's batches (an evaluation's)
        if len(set(ours)) != 1:
            raise InvalidConfig(
                f"the {len(ours)} micro-batches of one optimizer step carry different "
                f"step_targets {ours}: they belong to different steps of the stream. Set the "
                f"producer's accumulation to gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}, with epochs whose batches per rank "
                "are a multiple of it (or one epoch)"
            )
        step = ours[0]
        if counted is not None and max(int(counted), 1) != step:
            raise InvalidConfig(
                f"Trainer counted {int(counted)} loss-eligible targets in this optimizer "
                f"step, the stream's step_targets say {step}: the producer's accumulation "
                "must equal gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}, and every rank train the same steps"
            )
        return torch.tensor(step, device=device)

    def _checkpoint_folder(self, trial: Any) -> str:
        run = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        return os.path.join(run, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Every rank runs _save_checkpoint: the gather is safe here.
        states = self.train_dataset.state_dict()["ranks"]
        if self.args.should_save:
            folder = self._checkpoint_folder(trial)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump({"format": STATE_FORMAT, "version": 1, "ranks": states}, handle)
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """``Trainer.train``; a checkpoint resumed from gives the stream its cursor."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise InvalidConfig(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no "
                    f"{PREFIX_CHECKPOINT_DIR}-N folder"
                )
        if isinstance(resume_from_checkpoint, str):
            self.train_dataset.load_state_dict(load_stream_state(resume_from_checkpoint))
        return super().train(  # type: ignore[misc]
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
        )


def load_stream_state(checkpoint: str) -> Any:
    """Every rank's cursor saved in a Trainer checkpoint folder (``STATE_FILE``)."""
    path = os.path.join(checkpoint, STATE_FILE)
    try:
        with open(path) as handle:
            saved = json.load(handle)
    except FileNotFoundError:
        raise InvalidConfig(
            f"checkpoint {checkpoint} has no {STATE_FILE}: it was not saved by a streampack "
            "trainer, so nothing says where the stream stood; resume from a checkpoint a "
            "StreamTrainer saved"
        ) from None
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read the stream's state: {exc}") from None
    if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
        raise InvalidConfig(f"{path} is not a streampack stream state (format {STATE_FORMAT})")
    return saved_states(saved)


class StreamTrainer(StreamTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` over a ``StreamDataset`` (module doc)."""


def _sft_trainer() -> type:
    try:
        import datasets  # type: ignore[import-untyped]
        import trl
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise StreampackError(
            "StreamSFTTrainer needs TRL; install it with: pip install 'streampack[sft]'"
        ) from error

    class StreamSFTTrainer(StreamTrainerMixin, trl.SFTTrainer):
        """TRL's ``SFTTrainer`` over a ``StreamDataset`` (module doc): the batches are
        already tokenized, masked (``labels`` -100 off the supervision mask) and packed,
        so SFTTrainer's dataset preparation and collator are not used."""

        def _stand_in(self, dataset: StreamDataset) -> Any:
            # SFTTrainer.__init__ accepts only a `datasets` dataset, which it prepares;
            # one tokenized row passes through its preparation unchanged, and is never read.
            return datasets.Dataset.from_dict({"input_ids": [[0, 0]]})

    StreamSFTTrainer.__module__ = __name__
    return StreamSFTTrainer


def __getattr__(name: str) -> Any:
    # StreamSFTTrainer is built on first use: TRL is an extra of its own.
    if name == "StreamSFTTrainer":
        cls = _sft_trainer()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
