"""The README's "Trainers" section runs as it stands, against the real service (the
port swapped for the test service's, in a scratch directory). Each block runs in this
process, on one rank: the 2-rank runs of the same code are test_hf_trainer.py and
test_lightning.py, and the Lightning block runs with ``devices=1`` here, since its
``ddp`` launcher would start the second rank by running pytest again. The SFTTrainer
block needs a chat corpus: test_hf_trainer.py's SFT test runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Trainers: transformers, TRL, PyTorch loops, Lightning"
BLOCKS = {
    "trainer": "### transformers' Trainer",
    "sft": "### TRL's SFTTrainer",
    "torch": "### Plain PyTorch and torchdata's StatefulDataLoader",
    "lightning": "### PyTorch Lightning",
}


def readme_block(name: str, endpoint: str) -> str:
    """The Python block of one subsection, reading from ``endpoint``."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    part = section.split(BLOCKS[name], 1)[1].split("\n### ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", part, re.S)
    assert "tcp://127.0.0.1:5556" in code
    return code.replace("tcp://127.0.0.1:5556", endpoint)


def run_block(code: str, name: str) -> dict:
    namespace: dict = {"__name__": f"readme_{name}"}
    exec(compile(code, f"README.md[{name}]", "exec"), namespace)
    return namespace


def test_the_trainer_block_trains_and_checkpoints_the_stream(service, tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(readme_block("trainer", service.consumer_endpoint), "trainer")
    assert namespace["trainer"].state.global_step == 4
    saved = (tmp_path / "out" / "checkpoint-4" / "streampack_stream.json").read_text()
    assert '"index": 8' in saved  # 4 steps of 2 micro-batches on one rank


def test_the_plain_pytorch_block_saves_and_resumes_the_cursor(service, tmp_path, monkeypatch):
    pytest.importorskip("torchdata", reason="the lightning extra is not installed")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(readme_block("torch", service.consumer_endpoint), "torch")
    assert namespace["micro"] == 7
    assert namespace["stream"].state_dict()["index"] == 8


def test_the_lightning_block_trains_one_epoch(service, tmp_path, monkeypatch):
    pytest.importorskip("pytorch_lightning", reason="the lightning extra is not installed")
    monkeypatch.chdir(tmp_path)
    code = readme_block("lightning", service.consumer_endpoint)
    assert 'devices=2, strategy="ddp"' in code
    namespace = run_block(code.replace('devices=2, strategy="ddp"', "devices=1"), "lightning")
    assert namespace["trainer"].global_step == 25  # 49 batches, 2 per step, the last alone
