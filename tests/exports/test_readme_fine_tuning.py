"""The README's "Fine-tuning on chat data" runs as it stands: build a masked corpus from
conversations with a tokenizer directory, inspect it, serve it with real processes,
and train a tiny Llama on what arrives (the ports swapped for free ones)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _chat import CONVERSATIONS, make_tokenizer_dir
from _service import env, free_port, stop

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.slow


def fine_tuning_blocks() -> tuple[list[list[str]], str]:
    """The section's shell commands (split into argv lists) and its Python block."""
    section = README.read_text().split("## Fine-tuning on chat data", 1)[1]
    section = section.split("\n## ", 1)[0]
    (shell,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    commands = [shlex.split(line) for line in shell.replace("\\\n", " ").splitlines() if line]
    return commands, python


def test_the_readme_fine_tuning_section_builds_serves_and_trains(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    commands, python = fine_tuning_blocks()
    assert [c[:3] for c in commands] == [
        [".venv/bin/streampack", "corpus", "build"],
        [".venv/bin/streampack", "corpus", "inspect"],
        [".venv/bin/streampack", "serve", "--corpus"],
    ]
    make_tokenizer_dir(tmp_path / "my-tokenizer")
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 20)
    )
    ports = {"5555": str(free_port()), "5556": str(free_port())}

    def runnable(argv: list[str]) -> list[str]:
        argv = [sys.executable, "-m", "streampack.cli", *argv[1:]]
        return [re.sub(r":(5555|5556)$", lambda m: ":" + ports[m[1]], a) for a in argv]

    for argv in commands[:2]:
        done = subprocess.run(
            runnable(argv), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    assert "supervised" in done.stdout  # inspect reports the supervised targets
    server = subprocess.Popen(
        runnable(commands[2]), cwd=tmp_path, env=env(), stderr=subprocess.PIPE, text=True
    )
    try:
        namespace: dict = {}
        code = python.replace("127.0.0.1:5556", f"127.0.0.1:{ports['5556']}")
        exec(compile(code, "README.md[fine-tuning]", "exec"), namespace)
    finally:
        stop(server)
    batch = namespace["batch"]  # the loop ran; the last batch trained only its responses
    assert 0 < int(batch.loss_mask.sum()) < int(batch.target_valid.sum())
    assert bool(namespace["loss"].isfinite())
