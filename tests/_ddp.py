"""One rank of the data-parallel test of step targets (tests/exports/test_step_loss.py):
``python tests/_ddp.py RANK WORLD INIT_FILE ENDPOINT OUT``.

Real ``torch.distributed`` (gloo) and DDP over a tiny float64 Llama: the rank takes
``ACCUMULATION`` micro-batches of one optimizer step from the producer at ``ENDPOINT``
and accumulates ``step_loss(nll_sum, batch.step_targets, WORLD)`` (DDP syncs on the
last), then rank 0 saves the averaged gradients, each micro-batch's transformers loss
(``to_hf(num_items_in_batch=True)``) and its own float64 value to ``OUT``.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import transformers

from streampack.client import BatchStream
from streampack.loss import step_loss

ACCUMULATION = 2
VOCAB = 512


def tiny_llama(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def tiny_model() -> torch.nn.Module:
    return tiny_llama(VOCAB).train()


def nll_sum(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 NLL sum over the batch's loss-eligible cells, and transformers' own
    loss given the step's count (float32 inside, so only for a looser comparison)."""
    arguments = batch.to_hf(pad_id=0, num_items_in_batch=True)
    output = model(**arguments)
    labels = arguments["shift_labels"]
    total = torch.nn.functional.cross_entropy(
        output.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return total, output.loss.detach()


def main() -> int:
    rank, world, init_file, endpoint, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    model = torch.nn.parallel.DistributedDataParallel(tiny_model())
    record = {"hf_loss": [], "loss": [], "step_targets": []}
    with BatchStream(endpoint, rank=rank, world_size=world, timeout=120) as stream:
        for micro in range(ACCUMULATION):
            batch = next(stream)
            last = micro == ACCUMULATION - 1
            with contextlib.nullcontext() if last else model.no_sync():
                total, hf_loss = nll_sum(model, batch)
                loss = step_loss(total, batch.step_targets, world)
                loss.backward()
            record["hf_loss"].append(hf_loss.item())
            record["loss"].append((total / batch.step_targets).item())
            record["step_targets"].append(batch.step_targets)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, record)
    if rank == 0:
        grads = {name: p.grad.detach().clone() for name, p in model.module.named_parameters()}
        torch.save({"grads": grads, "ranks": gathered}, out)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
