"""Each way a stream handed to transformers' Trainer goes wrong, refused with one line:
the bare stream read through accelerate's prepared loader (dispatching: rank 0 reads
for everyone; sharding: one batch in W kept), Trainer's collation, DataLoader workers,
Trainer's resume by dropping batches, a stream of another rank, a model that cannot
take the step's count, a step count that is not the stream's, a checkpoint without the
stream's state. One process here (the 2-rank runs are in test_hf_trainer.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hf extra is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("accelerate", reason="the hf extra is not installed")

from _trainers import tiny_llama  # noqa: E402

import streampack as sp  # noqa: E402
from streampack.integrations.hf import StreamTrainer  # noqa: E402
from streampack.integrations.torch import StreamDataset  # noqa: E402

NOWHERE = "tcp://127.0.0.1:9"  # the refusals come before any fetch


def arguments(tmp_path, **changes) -> transformers.TrainingArguments:
    settings = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": 1,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "ignore_data_skip": True,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
    }
    return transformers.TrainingArguments(**(settings | changes))


def dataset(endpoint: str = NOWHERE, **stream) -> StreamDataset:
    stream = {"rank": 0, "world_size": 1, "timeout": 60} | stream
    return StreamDataset(sp.BatchStream(endpoint, **stream), pad_id=0)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"per_device_train_batch_size": 2}, "per_device_train_batch_size=2: a streampack batch"),
        ({"dataloader_num_workers": 2}, "dataloader_num_workers=2: every worker would read"),
        ({"ignore_data_skip": False}, "ignore_data_skip=False: on resume Trainer skips"),
    ],
)
def test_trainer_settings_that_would_break_the_stream_are_refused(tmp_path, change, refusal):
    with pytest.raises(sp.InvalidConfig, match=refusal):
        StreamTrainer(
            model=tiny_llama(512), args=arguments(tmp_path, **change), train_dataset=dataset()
        )


def test_a_stream_of_another_rank_a_bare_stream_and_a_countless_model_are_refused(tmp_path):
    args = arguments(tmp_path)
    with pytest.raises(sp.InvalidConfig, match="the stream is rank 1 of 2, but this process is 0"):
        StreamTrainer(model=tiny_llama(512), args=args, train_dataset=dataset(rank=1, world_size=2))
    with pytest.raises(sp.InvalidConfig, match="train_dataset=BatchStream: StreamTrainer trains"):
        StreamTrainer(model=tiny_llama(512), args=args, train_dataset=dataset().stream)

    class NoLossKwargs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(512, 4)

        def forward(self, input_ids, position_ids=None, labels=None, shift_labels=None):
            return self.embed(input_ids).sum()

    with pytest.raises(sp.InvalidConfig, match="NoLossKwargs.forward takes no num_items_in_batch"):
        StreamTrainer(model=NoLossKwargs(), args=args, train_dataset=dataset())


def test_the_bare_stream_read_through_accelerates_prepared_loader_is_refused(service, tmp_path):
    trainer = transformers.Trainer(
        model=tiny_llama(512),
        args=arguments(tmp_path),
        train_dataset=dataset(service.consumer_endpoint),
    )
    with pytest.raises(sp.InvalidConfig, match="accelerate's prepared DataLoader is reading"):
        trainer.train()


def test_a_step_count_other_than_the_streams_is_refused(service, tmp_path):
    # The producer's steps are 2 micro-batches (accumulation = 2); Trainer's here are 1.
    trainer = StreamTrainer(
        model=tiny_llama(512),
        args=arguments(tmp_path, gradient_accumulation_steps=1),
        train_dataset=dataset(service.consumer_endpoint),
    )
    with pytest.raises(sp.InvalidConfig, match="Trainer counted \\d+ loss-eligible targets"):
        trainer.train()


def test_a_checkpoint_without_the_streams_state_is_refused(tmp_path):
    trainer = StreamTrainer(
        model=tiny_llama(512), args=arguments(tmp_path), train_dataset=dataset()
    )
    folder = tmp_path / "run" / "checkpoint-3"
    folder.mkdir(parents=True)
    with pytest.raises(sp.InvalidConfig, match="checkpoint-3 has no streampack_stream.json"):
        trainer.train(resume_from_checkpoint=True)
