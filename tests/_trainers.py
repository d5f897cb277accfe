"""One rank of the trainer-integration tests (tests/integrations/test_hf_trainer.py):
``torchrun --nproc-per-node N tests/_trainers.py CONFIG.json``.

A ``StreamTrainer`` (or ``StreamSFTTrainer``) on a tiny float64 Llama reads this rank's
stream from the producer at ``config["endpoint"]``. Every forward the model receives is
recorded to ``OUT/rank{R}.jsonl`` as it happens (its fingerprint, ``num_items_in_batch``,
the optimizer step), so a rank killed part way leaves what it trained;
rank 0 saves the logged losses and the final parameters to ``OUT/final.pt``. With
``kill_at``, rank 1 kills itself (SIGKILL) at the end of that optimizer step.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import transformers
from _ddp import tiny_llama

import streampack as sp
from streampack.integrations.hf import StreamTrainer
from streampack.integrations.torch import StreamDataset


def fingerprint(arguments: dict) -> str:
    """SHA-256 of what the model is given: input_ids, position_ids, shift_labels."""
    h = hashlib.sha256()
    for name in ("input_ids", "position_ids", "shift_labels"):
        h.update(arguments[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def training_arguments(config: dict, sft: bool) -> transformers.TrainingArguments:
    """SGD at a constant rate, no clipping: the hand loop reproduces it exactly, and an
    error in the loss's scale shows in the parameters (Adam would hide it)."""
    kind, extra = transformers.TrainingArguments, {}
    if sft:
        import trl

        kind, extra = trl.SFTConfig, {"bf16": False}  # SFTConfig's default is bf16 autocast
    return kind(
        output_dir=config["output_dir"],
        max_steps=config["max_steps"],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=config["accumulation"],
        ignore_data_skip=True,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="steps" if config.get("save_steps") else "no",
        save_steps=config.get("save_steps") or 500,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        **extra,
    )


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    sft = config.get("kind") == "sft"
    args = training_arguments(config, sft)
    rank = args.process_index
    out = Path(config["out"])
    stream = sp.BatchStream(
        config["endpoint"],
        rank=rank,
        world_size=args.world_size,
        prefetch=config.get("prefetch", 4),
        timeout=120,
    )
    dataset = StreamDataset(stream, pad_id=0)
    model = tiny_llama(config["vocab"])
    log = (out / f"rank{rank}.jsonl").open("a")

    def record(module, positional, keywords):
        if module.training:
            fields = {
                "step": trainer.state.global_step,
                "fingerprint": fingerprint(keywords),
                "num_items_in_batch": int(keywords["num_items_in_batch"]),
            }
            log.write(json.dumps(fields) + "\n")
            log.flush()

    model.register_forward_pre_hook(record, with_kwargs=True)

    class Crash(transformers.TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            if state.global_step == config.get("kill_at") and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    kind: type = StreamTrainer
    extra = {}
    if sft:
        from streampack.integrations.hf import StreamSFTTrainer

        kind = StreamSFTTrainer
        extra["processing_class"] = transformers.AutoTokenizer.from_pretrained(config["tokenizer"])
    trainer = kind(model=model, args=args, train_dataset=dataset, callbacks=[Crash()], **extra)
    trainer.train(resume_from_checkpoint=config.get("resume"))
    if rank == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        parameters = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save({"losses": losses, "parameters": parameters}, out / "final.pt")
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
