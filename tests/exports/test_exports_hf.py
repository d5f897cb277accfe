"""``PackedBatch.to_hf`` against real transformers models: packed training equals each
document alone (rule C7's loss and every parameter gradient), and the traps the export
closes are real (a plain causal mask, a 2-D padding mask).

Tiny randomly initialised Llama and Qwen3 models are built here (no download), CPU,
float64. Tolerance of the contract: ``|a-b| <= 1e-10 + 1e-9*max(|a|,|b|)``.
"""

from __future__ import annotations

import numpy as np
import pytest

import streampack as sp

torch = pytest.importorskip(
    "torch", reason="the hf extra is not installed: pip install 'streampack[hf]'"
)
transformers = pytest.importorskip(
    "transformers", reason="the hf extra is not installed: pip install 'streampack[hf]'"
)

VOCAB = 48
BINDING = sp.Binding(VOCAB, "tiny-random", "hf-export", "train")
#: Lengths chosen so rows mix several documents, one row is filled exactly, and
#: another ends in padding: 9 documents, capacity 12.
DOCUMENT_LENGTHS = (5, 4, 3, 13, 7, 6, 2, 4, 9)
CAPACITY = 12


def close(a: torch.Tensor, b: torch.Tensor, attention: str = "sdpa") -> bool:
    """The contract's tolerance, coordinate by coordinate. Relaxed for eager attention,
    whose softmax transformers computes in float32 (``softmax(..., dtype=torch.float32)``
    in ``eager_attention_forward``) whatever the model's dtype: the same document's
    probabilities can then differ by a float32 rounding between two layouts, so there
    the bound is float32's, relative to the tensor's largest coordinate."""
    if attention == "eager":
        return bool((abs(a - b) <= 1e-10 + 1e-6 * abs(b).max()).all())
    return bool((abs(a - b) <= 1e-10 + 1e-9 * torch.maximum(abs(a), abs(b))).all())


def tiny_model(family: str, attention: str) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=4, **common))
    return model.to(torch.float64).train()


@pytest.fixture(scope="module")
def packed() -> tuple[sp.Examples, sp.PackedBatch]:
    rng = np.random.default_rng(7)
    documents = [rng.integers(1, VOCAB, n).tolist() for n in DOCUMENT_LENGTHS]
    examples = sp.Examples.from_documents(documents)
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=CAPACITY, max_rows_per_batch=8)
    ).batches
    assert batch.rows >= 3 and (batch.valid_lengths == CAPACITY).any()
    assert (batch.valid_lengths < CAPACITY).any()
    return examples, batch


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


_ALONE: dict[tuple[str, str], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}


def each_document_alone_of(family: str, attention: str, examples: sp.Examples):
    """``each_document_alone`` of the (seeded, so identical) tiny model, once per model."""
    if (family, attention) not in _ALONE:
        _ALONE[family, attention] = each_document_alone(tiny_model(family, attention), examples)
    return _ALONE[family, attention]


def each_document_alone(model: torch.nn.Module, examples: sp.Examples):
    """Rule C7 computed the slow way: every document its own forward pass, NLL summed
    over all targets, divided by their count."""
    total, count = 0.0, 0
    for i in range(len(examples)):
        tokens = torch.from_numpy(examples.example_tokens(i).astype(np.int64))
        logits = model(input_ids=tokens[None, :-1], use_cache=False).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum")
        count += tokens.numel() - 1
    loss = total / count
    return loss.detach(), gradients(model, loss)


FAMILIES = ("llama", "qwen3")
ATTENTIONS = ("sdpa", "eager")
#: Export variants: (layout, mask) by attention implementation.
VARIANTS = {
    "rows": lambda attention: ("rows", None),
    "rows-4d-mask": lambda attention: ("rows", "bool" if attention == "sdpa" else "additive"),
    "flat": lambda attention: ("flat", None),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_loss_and_every_gradient_equal_each_document_alone_c7(
    packed, family, attention, variant
):
    examples, batch = packed
    model = tiny_model(family, attention)
    want_loss, want_grads = each_document_alone_of(family, attention, examples)

    layout, mask = VARIANTS[variant](attention)
    arguments = batch.to_hf(layout, pad_id=0, mask=mask, mask_dtype=torch.float64)
    output = model(**arguments)
    # transformers' own loss casts the logits to float32 first (ForCausalLMLoss:
    # ``logits.float()``), so it can only agree to float32 rounding; the float64
    # comparison takes the same mean over the export's shift_labels, in float64.
    assert abs(output.loss.item() - want_loss.item()) <= 1e-6 * want_loss.item()
    loss = torch.nn.functional.cross_entropy(
        output.logits.flatten(0, 1), arguments["shift_labels"].flatten(), ignore_index=-100
    )
    got_grads = gradients(model, loss)

    assert close(loss.detach(), want_loss, attention), (loss.item(), want_loss.item())
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert close(got_grads[name], want_grads[name], attention), name


def plain_causal(batch: sp.PackedBatch, attention: str) -> torch.Tensor:
    allowed = torch.ones(batch.capacity, batch.capacity, dtype=torch.bool).tril()
    allowed = allowed.expand(batch.rows, 1, -1, -1)
    if attention == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
        ~allowed, torch.finfo(torch.float64).min
    )


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_negative_controls_a_plain_causal_or_a_2d_padding_mask_differ(packed, family, attention):
    """The equality above is not automatic: the same rows under a plain causal mask, or
    with the 2-D padding mask that ``to_hf`` refuses, give another loss."""
    examples, batch = packed
    model = tiny_model(family, attention)
    want_loss, _ = each_document_alone_of(family, attention, examples)
    arguments = batch.to_hf("rows", pad_id=0)
    with torch.no_grad():
        causal = model(**(arguments | {"attention_mask": plain_causal(batch, attention)})).loss
        padding = model(
            **(arguments | {"attention_mask": torch.from_numpy(batch.input_valid.astype(np.int64))})
        ).loss
    assert not close(causal, want_loss, attention), (causal.item(), want_loss.item())
    assert not close(padding, want_loss, attention), (padding.item(), want_loss.item())
    assert abs(causal - want_loss) > 1e-3 and abs(padding - want_loss) > 1e-3


def test_rows_layout_names_dtypes_and_values(packed):
    _, batch = packed
    arguments = batch.to_hf("rows", pad_id=3)
    assert set(arguments) == {"input_ids", "position_ids", "shift_labels", "labels", "use_cache"}
    assert arguments["use_cache"] is False
    for name in ("input_ids", "position_ids", "shift_labels"):
        assert arguments[name].dtype == torch.int64 and arguments[name].shape == (
            batch.rows,
            batch.capacity,
        ), name
    assert arguments["labels"] is arguments["shift_labels"]
    padding = ~batch.input_valid
    assert (arguments["input_ids"].numpy()[padding] == 3).all()
    assert (arguments["shift_labels"].numpy()[~batch.loss_mask] == -100).all()
    np.testing.assert_array_equal(
        arguments["shift_labels"].numpy()[batch.loss_mask], batch.targets[batch.loss_mask]
    )


def test_worked_example_in_both_layouts():
    from _packing_cases import BINDING as WORKED
    from _packing_cases import A, B, C

    (batch,) = sp.pack_examples(
        sp.Examples.from_documents([A, B, C]),
        WORKED,
        sp.PackConfig(capacity=6, max_rows_per_batch=2),
    ).batches
    rows = batch.to_hf("rows", pad_id=0)
    assert rows["input_ids"].tolist() == [[0, 99, 100, 0, 101, 0], [0, 102, 103, 104, 0, 0]]
    assert rows["shift_labels"].tolist() == [
        [99, 100, 1, 101, 1, -100],
        [102, 103, 104, 1, -100, -100],
    ]
    flat = batch.to_hf("flat", pad_id=0)
    assert flat["input_ids"].tolist() == [[0, 99, 100, 0, 101, 0, 102, 103, 104]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert flat["shift_labels"].tolist() == [[99, 100, 1, 101, 1, 102, 103, 104, 1]]
    assert flat["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert flat["seq_idx"].dtype == torch.int32
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert flat[name].tolist() == [0, 3, 5, 9] and flat[name].dtype == torch.int32
    assert (flat["max_length_q"], flat["max_length_k"]) == (4, 4)
    assert type(flat["max_length_q"]) is int
    mask = batch.to_hf("rows", pad_id=0, mask="bool")["attention_mask"]
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]  # B sees [3, 5)
    assert mask[0, 0, 5].tolist() == [False] * 5 + [True]  # padding: itself only (no NaN)
    additive = batch.to_hf("rows", pad_id=0, mask="additive")["attention_mask"]
    assert additive.dtype == torch.float32
    assert (additive[mask] == 0).all() and (additive[~mask] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"mask": "padding"},
            r"2-D padding attention_mask\) is refused: transformers .* "
            r"packed-sequence detection",
        ),
        ({"mask": "2d"}, r"mask='2d'; accepted: None, 'bool' \(sdpa\) or 'additive'"),
        ({"layout": "padded"}, r"layout='padded'; accepted: 'rows', 'flat'"),
        ({"pad_id": -1}, r"pad_id=-1; accepted: a token id >= 0"),
        ({"layout": "flat", "mask": "bool"}, r"mask='bool' with layout='flat'"),
    ],
)
def test_to_hf_refuses_what_would_silently_break_training(packed, arguments, message):
    _, batch = packed
    with pytest.raises(sp.InvalidConfig, match=message):
        batch.to_hf(**({"pad_id": 0} | arguments))


def test_a_filler_batch_cannot_be_flattened_or_described():
    filler = sp.PackedBatch.filler_like(BINDING, rows=2, capacity=6)
    with pytest.raises(sp.InvalidConfig, match="filler batch has no real cells"):
        filler.to_hf("flat", pad_id=0)
    with pytest.raises(sp.InvalidConfig, match="filler batch has no sequences"):
        filler.to_megatron()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_on_cpu_sdpa_and_eager_take_flat_boundaries_from_position_ids_alone(packed, attention):
    """What transformers 5.x does with the flat layout on CPU: sdpa and eager separate
    documents by ``position_ids`` (a position that does not follow its left neighbour
    starts a document) and never read ``cu_seq_lens_q/k`` / ``max_length_q/k``, which
    only the FlashAttention paths (CUDA) take. So on CPU the positions are what keep
    documents apart: wrong boundaries in cu_seq_lens change nothing, positions that run
    on across documents change the logits."""
    _, batch = packed
    model = tiny_model("llama", attention)
    arguments = batch.to_hf("flat", pad_id=0)
    cells = arguments["input_ids"].shape[1]
    one_sequence = {
        "cu_seq_lens_q": torch.tensor([0, cells], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, cells], dtype=torch.int32),
        "max_length_q": cells,
        "max_length_k": cells,
    }
    with torch.no_grad():
        logits = model(**arguments).logits
        assert torch.equal(model(**(arguments | one_sequence)).logits, logits)
        running = model(**(arguments | {"position_ids": torch.arange(cells)[None]})).logits
    assert not torch.allclose(running, logits)


# -- supervised fine-tuning: only the marked targets are trained (rule C5) ---------------


@pytest.fixture(scope="module")
def packed_sft() -> tuple[sp.Examples, sp.PackedBatch]:
    """The same documents as ``packed``, each a prompt (mask 0) then a response (mask
    1) of at least one token."""
    rng = np.random.default_rng(7)
    documents = [rng.integers(1, VOCAB, n).tolist() for n in DOCUMENT_LENGTHS]
    prompts = [int(rng.integers(1, n)) for n in DOCUMENT_LENGTHS]
    masks = [[0] * p + [1] * (n - p) for p, n in zip(prompts, DOCUMENT_LENGTHS)]
    examples = sp.Examples.from_documents(documents, masks=masks)
    (batch,) = sp.pack_examples(
        examples, BINDING, sp.PackConfig(capacity=CAPACITY, max_rows_per_batch=8)
    ).batches
    assert 0 < batch.loss_mask.sum() < batch.target_valid.sum()
    return examples, batch


def each_example_alone_with_its_prompt_masked(model: torch.nn.Module, examples: sp.Examples):
    """The fine-tuning objective the slow way, in Hugging Face's own convention: each
    example alone, ``labels = input_ids`` with -100 where the mask is 0, shifted by the
    model's loss; NLL summed over every example's labelled targets, divided by their
    count (rule C7), in float64."""
    total, count = 0.0, 0
    for i in range(len(examples)):
        tokens = torch.from_numpy(examples.example_tokens(i).astype(np.int64))
        mask = torch.from_numpy(examples.example_mask(i).astype(bool))
        labels = torch.where(mask, tokens, -100)
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
        total = total + torch.nn.functional.cross_entropy(
            logits[:-1], labels[1:], ignore_index=-100, reduction="sum"
        )
        count += int((labels[1:] != -100).sum())
    loss = total / count
    return loss.detach(), gradients(model, loss)


@pytest.mark.parametrize("layout", ["rows", "flat"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_fine_tuning_loss_and_every_gradient_equal_each_example_alone_c5_c7(
    packed_sft, family, layout
):
    examples, batch = packed_sft
    model = tiny_model(family, "sdpa")
    want_loss, want_grads = each_example_alone_with_its_prompt_masked(model, examples)
    arguments = batch.to_hf(layout, pad_id=0)
    labels = arguments["shift_labels"]
    assert int((labels != -100).sum()) == int(batch.loss_mask.sum())
    output = model(**arguments)
    assert abs(output.loss.item() - want_loss.item()) <= 1e-6 * want_loss.item()
    loss = torch.nn.functional.cross_entropy(
        output.logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    got_grads = gradients(model, loss)
    assert close(loss.detach(), want_loss), (loss.item(), want_loss.item())
    for name in want_grads:
        assert close(got_grads[name], want_grads[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_a_packer_that_drops_the_mask_trains_the_prompts_too(packed_sft, family):
    """TRL #3728's bug, here impossible: the same documents packed without their mask
    train every target, and the loss is no longer the fine-tuning loss."""
    import dataclasses

    examples, _ = packed_sft
    model = tiny_model(family, "sdpa")
    want_loss, _ = each_example_alone_with_its_prompt_masked(model, examples)
    (dropped,) = sp.pack_examples(
        dataclasses.replace(examples, mask=None),
        BINDING,
        sp.PackConfig(capacity=CAPACITY, max_rows_per_batch=8),
    ).batches
    with torch.no_grad():
        loss = model(**dropped.to_hf("rows", pad_id=0)).loss
    assert not close(loss.double(), want_loss) and abs(loss - want_loss) > 1e-3


def test_to_torch_and_megatron_loss_mask_carry_the_supervision_mask(packed_sft):
    _, batch = packed_sft
    tensors = batch.to_torch()
    assert torch.equal(tensors["loss_mask"], torch.from_numpy(batch.loss_mask))
    assert not torch.equal(tensors["loss_mask"], tensors["target_valid"])
    # Megatron takes the loss mask beside PackedSeqParams, flattened as the tokens are.
    assert batch.megatron_loss_mask().tolist() == [batch.loss_mask.reshape(-1).tolist()]
    assert batch.megatron_loss_mask().dtype == torch.float32
