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

ROOT = Path(__file__).resolve().parents[2]
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
        # The trainer adapters' package: each framework only with its own module.
        "import streampack.integrations",
    ],
)
def test_the_package_and_its_errors_load_nothing_heavy(statement):
    loaded = _loaded_after(statement)
    assert _ours(loaded) - {"streampack.integrations"} == {
        "streampack",
        "streampack.config",
        "streampack.errors",
    }
    assert "numpy" not in loaded
    assert not _heavy(loaded)


# (streampack.digests too: the consumer checks tokens with it; its kernel loads on first use.)
@pytest.mark.parametrize(
    "module",
    ["streampack.client", "streampack.wire", "streampack.settings", "streampack.digests"],
)
def test_the_client_side_loads_no_numba_decoder_audit_packer_or_service(module):
    loaded = _loaded_after(f"import {module}")
    assert not _heavy(loaded)
    forbidden = {
        "streampack.decoder",
        "streampack.auditing",
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
    assert {"streampack.packing", "streampack.auditing", "numba"} <= loaded
    assert not {m for m in loaded if m.startswith("streampack.service")}


def test_every_public_name_resolves_and_audit_stays_the_function():
    _loaded_after(
        "import streampack as sp, streampack.auditing\n"
        "missing = [n for n in sp.__all__ if not hasattr(sp, n)]\n"
        "assert not missing, missing\n"
        "assert callable(sp.audit) and sp.audit.__module__ == 'streampack.auditing'\n"
        "assert set(sp.__all__) <= set(dir(sp))"
    )


def _modules() -> list[tuple[str, Path]]:
    """(import name, path) of every module of the package, the service's included."""
    found = []
    for path in sorted(p for p in LIBRARY.rglob("*.py") if "__pycache__" not in p.parts):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _imported(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``streampack`` import in ``path``, imports inside
    functions included; ``from X import a, b`` gives ``X`` with ``[a, b]``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([target] if target else [])])
            found.append((node.lineno, target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
    return [item for item in found if item[1].split(".")[0] == "streampack"]


MODULES = _modules()
NAMES = {name for name, _ in MODULES}


def _targets(name: str, imported: list[str]) -> list[str]:
    """The modules an import loads: ``from pkg import sub`` names the submodule."""
    subs = [f"{name}.{item}" for item in imported if f"{name}.{item}" in NAMES]
    return subs if subs and len(subs) == len(imported) else [name]


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_no_module_reaches_up_to_the_package_root_and_the_library_never_imports_the_service(
    module, path
):
    """Statically, including imports inside functions: no module but the package's
    ``__init__`` imports names from the package root (``from streampack import X`` would
    import the whole public API), and the library never imports the service (the CLI
    names service modules as strings, imported on demand)."""
    library = not module.startswith(("streampack.service", "streampack.cli"))
    for line, name, imported in _imported(module, path):
        if name == "streampack" and module != "streampack":
            assert all(f"streampack.{item}" in NAMES for item in imported), (
                f"{path.relative_to(ROOT)}:{line} imports from the package root; import "
                "from the module that defines the name"
            )
        if library:
            assert not name.startswith("streampack.service"), (
                f"{path.relative_to(ROOT)}:{line} imports the service ({name})"
            )


#: The rows of docs/architecture.md's table, bottom up: a module imports from its own row
#: and the rows before it only. A module missing here fails the test below: place it in
#: the table and here.
LAYERS: list[tuple[str, list[str]]] = [
    ("leaves", ["errors", "config", "logs", "progress"]),
    ("kernels", ["kernels"]),
    ("data model", ["examples", "batch", "digests", "exports", "loss", "settings"]),
    ("references", ["reference"]),
    ("library operations", ["packing", "decoder", "auditing", "trace", "render"]),
    ("transport", ["wire", "client", "client_metrics"]),
    ("integrations", ["integrations"]),
    ("data in", ["corpus", "windows"]),
    ("service", ["service"]),
    ("command line", ["cli"]),
]


def _layer(module: str) -> int:
    """Row of ``streampack.X[.Y]`` (the package itself: the bottom, as its lazy table
    loads each name only on first use)."""
    parts = module.split(".")
    if parts == ["streampack"]:
        return 0
    for row, (_, names) in enumerate(LAYERS):
        if parts[1] in names:
            return row
    raise AssertionError(f"{module} is in no row of docs/architecture.md (LAYERS here)")


def _type_checking_lines(path: Path) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:`` (they load nothing when run)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            lines.update(n.lineno for n in ast.walk(node) if hasattr(n, "lineno"))
    return lines


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_imports_go_down_the_layers_of_the_architecture_doc(module, path):
    own = _layer(module)
    # The package root is the facade of every layer: it names their public API for type
    # checkers only and loads each on first use (PEP 562); what it loads when imported
    # is checked in a fresh interpreter above.
    facade = _type_checking_lines(path) if module == "streampack" else set()
    for line, name, imported in _imported(module, path):
        if line in facade:
            continue
        for target in _targets(name, imported):
            assert _layer(target) <= own, (
                f"{path.relative_to(ROOT)}:{line} imports {target} ({LAYERS[_layer(target)][0]}) "
                f"from {LAYERS[own][0]}: a layer may import only from its own and lower ones"
            )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of the import graph, as its modules in order (Tarjan's strongly
    connected components with more than one module, or one importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (inside functions too). The package
    root's lazy table and a package's re-exports of its own modules are left out: the
    first loads nothing until used, the second only gathers names."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES:
        edges = set()
        for _, name, imported in _imported(module, path):
            edges.update(t for t in _targets(name, imported) if t != "streampack")
        if path.name == "__init__.py":
            edges = {t for t in edges if not t.startswith(f"{module}.")}
        graph[module] = edges - {module}
    return graph


def test_no_import_cycle_inside_a_layer():
    assert import_cycles(_import_graph()) == []


def test_the_cycle_check_finds_a_cycle_made_on_purpose():
    graph = _import_graph()
    # The cycle this layout removed: opening a source back from the manifest module.
    graph["streampack.corpus.sources"].add("streampack.corpus.manifest")
    (cycle,) = import_cycles(graph)
    assert {"streampack.corpus.manifest", "streampack.corpus.sources"} <= set(cycle)
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
    assert out.returncode == 0 and "--connect" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "streampack.cli", "no-such-command"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "invalid choice: 'no-such-command'" in out.stderr


def test_the_digest_oracle_does_not_import_what_it_checks():
    """``digest`` computes in process the stream the service must deliver: it shares
    the tail rule (``delivery.rank_share``) but none of the worker's or the producer's
    code, so a bug there cannot hide by being computed twice."""
    path = LIBRARY / "service" / "digest.py"
    service = {name for _, name, _ in _imported("streampack.service.digest", path)} & {
        n for n in NAMES if n.startswith("streampack.service.")
    }
    assert service <= {"streampack.service.delivery"}
