"""The docs say what the code does: lists in docs/ that name code are checked against it.

- every exception class is defined in ``errors.py`` and exported from ``streampack``;
- ``docs/architecture.md`` places every top-level module and every service module;
- ``docs/service.md``'s list of the settings that change the stream is exactly what
  the cut (``CutSpec``) and the pack config read, plus the corpus, epochs and tail.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
from pathlib import Path

import streampack
from streampack.config import PackConfig
from streampack.windows import CutSpec

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "streampack"
DOCS = ROOT / "docs"


def _classes(path: Path) -> list[tuple[str, list[str]]]:
    """(name, base names) of every class defined in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
            found.append((node.name, bases))
    return found


def test_every_exception_class_lives_in_errors_and_is_exported():
    ours = {name for name, _ in _classes(LIBRARY / "errors.py")}
    builtin = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}
    exceptions = {n for n in builtin if issubclass(getattr(builtins, n), BaseException)}
    elsewhere = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(LIBRARY.rglob("*.py"))
        if path.name != "errors.py"
        for name, bases in _classes(path)
        if set(bases) & (ours | exceptions)
    ]
    assert elsewhere == [], "define exceptions in streampack/errors.py"
    assert ours <= set(streampack.__all__)


def _architecture_rows() -> dict[str, str]:
    """Part name -> the text of its row in docs/architecture.md's table."""
    rows = {}
    for line in (DOCS / "architecture.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = f"{cells[1]} | {cells[2]}"
    return rows


def test_the_architecture_table_places_every_module_and_every_service_module():
    rows = _architecture_rows()
    table = " ".join(rows.values())
    top = sorted(
        p.stem if p.is_file() else p.name
        for p in LIBRARY.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    )
    missing = [m for m in top if f"`{m}.py`" not in table and f"`{m}/`" not in table]
    assert missing == []
    service = sorted(p.stem for p in (LIBRARY / "service").glob("*.py") if p.stem != "__init__")
    named = set(re.findall(r"`(\w+)`", rows["Service"]))
    assert [m for m in service if m not in named] == []


def _stream_settings_in_docs() -> set[str]:
    text = " ".join((DOCS / "service.md").read_text().split())
    sentence = re.search(r"The settings that change the stream are (.*?); pass the same", text)
    assert sentence, "docs/service.md no longer lists the settings that change the stream"
    return set(re.findall(r"`(\w+)`", sentence.group(1)))


def test_the_documented_stream_settings_are_those_the_cut_and_the_packing_read():
    # Besides the cut and the packing, the stream depends on what is read (corpus), how
    # often (epochs) and how each epoch's last batches are shared among ranks (tail).
    read = {f.name for f in dataclasses.fields(CutSpec)} | {
        f.name for f in dataclasses.fields(PackConfig)
    }
    assert _stream_settings_in_docs() == read | {"corpus", "epochs", "tail"}
