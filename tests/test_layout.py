"""The package layout: what gets installed under which import name.

The service's code lives in the top-level ``workers/`` folder but is installed and
imported as ``streampack.service`` (pyproject.toml maps the folder), so no top-level
module named plain ``workers`` reaches a user's site-packages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_its_import_name():
    config = _setuptools_config()
    folders = {name: folder for name, folder in config["package-dir"].items()}
    assert folders == {"streampack.service": "workers"}
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("streampack", "workers")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    as_imported = {
        name.replace("workers", "streampack.service", 1)
        if name.split(".")[0] == "workers"
        else name
        for name in on_disk
    }
    assert sorted(config["packages"]) == sorted(as_imported)
    assert not any(name.split(".")[0] == "workers" for name in config["packages"])


def test_service_imports_as_streampack_service_and_workers_is_not_installed(tmp_path):
    # From a directory outside the checkout, so that only what is installed is found.
    script = (
        "import importlib.util, pathlib, streampack.service.producer as p\n"
        "print(pathlib.Path(p.__file__).parent.name)\n"
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
    # An editable install runs the checkout's workers/ folder; a wheel, streampack/service/.
    assert folder in ("workers", "service")
    assert workers_missing == "True"
