"""The README's training loops run as they stand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def training_snippets() -> dict[str, str]:
    text = README.read_text()
    section = text.split("## Training with Hugging Face / Megatron / plain PyTorch", 1)[1]
    section = section.split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return dict(zip(("hugging_face", "megatron", "plain_pytorch"), blocks, strict=True))


@pytest.mark.parametrize("name", ["hugging_face", "megatron", "plain_pytorch"])
def test_readme_training_loop_runs(name):
    pytest.importorskip("torch", reason="the hf extra is not installed")
    snippet = training_snippets()[name]
    if name == "hugging_face":
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    if name == "megatron":
        pytest.importorskip(
            "megatron.core.packed_seq_params",
            reason="megatron-core is not installed (pip install megatron-core)",
        )
    namespace: dict = {}
    exec(compile(snippet, f"README.md[{name}]", "exec"), namespace)
    assert "batch" in namespace  # the loop ran at least once
