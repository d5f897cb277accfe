"""Imports go one way (docs/architecture.md): each layer, imported alone in a fresh
interpreter, pulls in only what it may.

- ``streampack`` and ``streampack.errors``: no Numba, no NumPy (public names are lazy).
- the client, the wire format and the settings: no Numba, and nothing of the decoder,
  the audit, the packer or the service.
- the library core (every ``streampack`` module but the CLI): never the service.
- the CLI: only the chosen subcommand's module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "streampack"
HEAVY = ("numba", "llvmlite", "torch", "pyarrow", "transformers", "matplotlib", "tokenizers")


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def _ours(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "streampack" or m.startswith("streampack.")}


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in HEAVY}


@pytest.mark.parametrize(
    "statement",
    [
        "import streampack",
        "import streampack.errors",
        "from streampack import InvalidConfig, PackConfig",
    ],
)
def test_the_package_and_its_errors_load_nothing_heavy(statement):
    loaded = _loaded_after(statement)
    assert _ours(loaded) == {"streampack", "streampack.config", "streampack.errors"}
    assert "numpy" not in loaded
    assert not _heavy(loaded)


@pytest.mark.parametrize("module", ["streampack.client", "streampack.wire", "streampack.settings"])
def test_the_client_side_loads_no_numba_decoder_audit_packer_or_service(module):
    loaded = _loaded_after(f"import {module}")
    assert not _heavy(loaded)
    forbidden = {
        "streampack.decoder",
        "streampack.audit",
        "streampack.packing",
        "streampack.kernels",
        "streampack.trace",
        "streampack.service",
    }
    assert not {m for m in loaded if any(m == f or m.startswith(f"{f}.") for f in forbidden)}


def test_a_lazy_public_name_loads_its_module_on_first_use():
    loaded = _loaded_after(
        "import streampack as sp\nassert 'streampack.packing' not in sys.modules\n"
        "sp.pack_examples\nassert callable(sp.audit)"
    )
    assert {"streampack.packing", "streampack.audit", "numba"} <= loaded
    assert not {m for m in loaded if m.startswith("streampack.service")}


def test_every_public_name_resolves_and_audit_stays_the_function():
    _loaded_after(
        "import streampack as sp, streampack.audit\n"
        "missing = [n for n in sp.__all__ if not hasattr(sp, n)]\n"
        "assert not missing, missing\n"
        "assert callable(sp.audit) and sp.audit.__module__ == 'streampack.audit'\n"
        "assert set(sp.__all__) <= set(dir(sp))"
    )


def _library_modules() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _library_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_library_module_imports_the_service_or_reaches_up_to_the_package(path):
    """Statically, including imports inside functions: the core never imports the
    service (the CLI names service modules as strings, imported on demand), and no
    module inside the package imports names from the package root (``from streampack
    import X`` would import the whole public API)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([target] if target else [])])
            names = [target]
            submodules = all((LIBRARY / f"{alias.name}.py").exists() for alias in node.names)
            if target == "streampack" and not submodules:
                assert path.name == "__init__.py" and path.parent == LIBRARY, (
                    f"{path.name}:{node.lineno} imports from the package root; import from "
                    "the module that defines the name"
                )
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            assert not name.startswith(("streampack.service", "workers")), (
                f"{path.name}:{node.lineno} imports the service ({name})"
            )


#: The rows of docs/architecture.md's table, bottom up: a module imports from its own row
#: and the rows before it only. A module missing here fails the test below: place it in
#: the table and here.
LAYERS: list[tuple[str, list[str]]] = [
    ("leaves", ["errors", "config", "logs", "progress"]),
    ("kernels", ["kernels"]),
    ("data model", ["examples", "batch", "exports", "loss", "settings"]),
    ("references", ["reference"]),
    ("library operations", ["packing", "decoder", "audit", "trace", "render"]),
    ("transport", ["wire", "client", "client_metrics"]),
    ("data in", ["corpus", "windows", "mixture"]),
    ("service", ["service"]),
    ("command line", ["cli"]),
]


def _layer(module: str) -> int:
    """Row of ``streampack.X[.Y]`` (the package itself: the bottom)."""
    parts = module.split(".")
    if parts == ["streampack"]:
        return 0
    for row, (_, names) in enumerate(LAYERS):
        if parts[1] in names:
            return row
    raise AssertionError(f"{module} is in no row of docs/architecture.md (LAYERS here)")


def _modules_and_paths() -> list[tuple[str, Path]]:
    found = []
    for path in _library_modules():
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    for path in sorted((ROOT / "workers").glob("*.py")):
        name = "streampack.service" + ("" if path.stem == "__init__" else f".{path.stem}")
        found.append((name, path))
    return found


def _imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``streampack`` import in ``path``, functions included."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([target] if target else [])])
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return [(line, name) for line, name in found if name.split(".")[0] == "streampack"]


@pytest.mark.parametrize(
    ("module", "path"), _modules_and_paths(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_imports_go_down_the_layers_of_the_architecture_doc(module, path):
    if module == "streampack":
        return  # the package's lazy table names every layer
    own = _layer(module)
    for line, name in _imported(module, path):
        if name == "streampack":
            continue  # names from the package root (the service's own style)
        assert _layer(name) <= own, (
            f"{path.relative_to(ROOT)}:{line} imports {name} ({LAYERS[_layer(name)][0]}) from "
            f"{LAYERS[own][0]}: a layer may import only from its own and lower ones"
        )


def test_the_cli_imports_only_the_chosen_subcommand():
    loaded = _loaded_after(
        "from streampack.cli import build_parser\n"
        "build_parser('health').parse_args(['health', '--timeout', '1'])"
    )
    service = {m for m in loaded if m.startswith("streampack.service.")}
    assert service == {"streampack.service.health"}
    assert not _heavy(loaded)


def test_the_help_of_one_subcommand_works_without_the_others(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "streampack.cli", "health", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--endpoint" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "streampack.cli", "no-such-command"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "invalid choice: 'no-such-command'" in out.stderr
