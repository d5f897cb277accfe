"""The package layout: every module installs under the name of its path.

The service's code is ``streampack/service/`` and imports as ``streampack.service``; the
top-level ``workers/`` folder holds only the entry scripts of the processes a deployment
starts, run by path and never installed, so no module named plain ``workers`` exists.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_packages_are_found_under_their_paths_with_no_mapping():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in config
    assert config["packages"]["find"]["include"] == ["streampack", "streampack.*"]
    assert not (ROOT / "workers" / "__init__.py").exists()


def test_service_imports_from_its_path_and_workers_is_not_installed(tmp_path):
    # From a directory outside the checkout, so that only what is installed is found.
    script = (
        "import importlib.util, pathlib, streampack.service.producer as p\n"
        "print(pathlib.Path(p.__file__).parent.relative_to(pathlib.Path(p.__file__).parents[2]))\n"
        "print(importlib.util.find_spec('workers') is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    folder, workers_missing = out.stdout.split()
    assert folder == "streampack/service"
    assert workers_missing == "True"


@pytest.mark.parametrize("command", ["produce", "worker", "serve"])
def test_each_entry_script_is_its_subcommand(command):
    def help_of(argv: list[str]) -> str:
        out = subprocess.run(
            [sys.executable, *argv, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout

    by_path = help_of([f"workers/{command}.py"])
    by_command = help_of(["-m", "streampack.cli", command])
    assert (
        by_path.replace("streampack", "X").split("\n", 1)[1]
        == (by_command.replace("streampack", "X").split("\n", 1)[1])
    )
    assert "usage:" in by_path
