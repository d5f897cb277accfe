"""Chat data for the fine-tuning tests: a byte-level BPE tokenizer directory with a
ChatML template marking the assistant's turns with ``{% generation %}``, built here with
``tokenizers`` and saved as transformers saves one (no download), and conversations."""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "The capital of France is Paris.",
    "Paris is lovely in spring, and Rome in autumn.",
    "What is two plus two? Four. What is three plus three? Six.",
    "Name a colour. Blue. Name another. Green.",
    "user assistant system",
]
# A template with {% generation %} around each assistant message and its end of turn.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_GENERATION = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    [
        {"role": "system", "content": "Name a colour."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another."},
        {"role": "assistant", "content": "Green."},
    ],
    [
        {"role": "user", "content": "What is three plus three?"},
        {"role": "assistant", "content": "Six."},
        {"role": "user", "content": "The capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
]


def make_tokenizer_dir(path: Path, template: str = TEMPLATE) -> Path:
    """A byte-level BPE with <s>, </s> and ChatML markers, saved as transformers saves a
    tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        WORDS * 20,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return path
