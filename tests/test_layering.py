"""The package's layering, read from its source with `ast` (nothing is imported):

1. a module under graphopt/kernels/ imports nothing of graphopt outside graphopt.kernels and
   graphopt.hardware, at module level or inside a function (one test per kernel module, so every
   offender is reported);
2. no file in graphopt/ is longer than MAX_LINES;
3. the module-level imports (those that run when a module is imported: not inside a function, nor
   under `if TYPE_CHECKING:`) form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphopt"
MAX_LINES = 800
KERNEL_LAYERS = ("graphopt.kernels", "graphopt.hardware")  # what a kernel module may import


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _absolute(module: str | None, level: int, importer: str) -> str:
    """The absolute name of `from <level dots><module> import ...` written in module `importer`."""
    if not level:
        return module or ""
    package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The graphopt modules an import statement loads: `import a.b` loads a.b; `from a import b`
    loads a.b where that is a module, else a (b is then a name defined in a). Each comes with the
    packages above it that Python initializes first, except those that hold the importer (they
    are initialized before the importer runs): a package's __init__ importing its own submodules
    is no cycle, but importing a submodule of another package runs that package's __init__. What
    the statement names counts always (`from graphopt import __version__` reads graphopt's
    __init__)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _absolute(node.module, node.level, importer)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    held = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    targets = set()
    for name in names:
        if name != "graphopt" and not name.startswith("graphopt."):
            continue
        parts = name.split(".")
        targets.add(name)  # named by the statement: counts even where it holds the importer
        targets.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in held)
    return sorted(targets)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, *, module_level: bool) -> list[tuple[int, str]]:
    """(line, imported graphopt module) of every import in `module`; module_level: only those run
    when the module is imported (function bodies and `if TYPE_CHECKING:` blocks left out)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level and isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(ast.Module(body=[orelse], type_ignores=[]))
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((child.lineno, target) for target in _targets(child, module))
            visit(child)

    visit(ast.parse(MODULES[module].read_text(), filename=str(MODULES[module])))
    return found


KERNEL_MODULES = [name for name in MODULES if name == "graphopt.kernels" or name.startswith("graphopt.kernels.")]


def _allowed_in_kernels(target: str) -> bool:
    return any(target == layer or target.startswith(layer + ".") for layer in KERNEL_LAYERS)


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_modules_import_only_kernels_and_hardware(module):
    offenders = [f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
                 for line, target in _imports(module, module_level=False) if not _allowed_in_kernels(target)]
    assert not offenders, ("kernels may import only graphopt.kernels and graphopt.hardware:\n  "
                           + "\n  ".join(offenders))


def test_no_file_in_the_package_is_longer_than_the_limit():
    too_long = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            lines = len(path.read_text(errors="replace").splitlines())
            if lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"files over {MAX_LINES} lines: {too_long}"


def import_cycles() -> list[list[str]]:
    """The cycles of the module-level import graph: its strongly connected components with more than
    one module (or a module importing itself), each sorted."""
    graph = {name: sorted({t for _, t in _imports(name, module_level=True) if t in MODULES}) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            connect(name)
    return sorted(cycles)


def test_module_level_imports_form_no_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles among module-level imports:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_imports_inside_functions_and_resolves_submodules():
    """The checks above rest on this reading of the source: the launchers' imports of their kernel
    modules are seen, `from graphopt.kernels import fp4` is the module graphopt.kernels.fp4, and an
    import inside a function counts for the kernels rule but not for the cycle rule."""
    every = {t for _, t in _imports("graphopt.ops.quantized_linear", module_level=False)}
    module_level = {t for _, t in _imports("graphopt.ops.quantized_linear", module_level=True)}
    assert "graphopt.kernels.fp4" in every and "graphopt.kernels.fp4" not in module_level
    assert "graphopt.kernels.fp4.configs" in {t for _, t in _imports("graphopt.kernels.fp4", module_level=True)}
    # another package's submodule brings that package's __init__; the importer's own packages do not count
    assert {"graphopt.kernels", "graphopt.kernels.fp4", "graphopt.hardware"} <= {
        t for _, t in _imports("graphopt.cost.fp4", module_level=True)}
    assert "graphopt.kernels.q4" not in {t for _, t in _imports("graphopt.kernels.q4.tune", module_level=True)}
    # a name from the package's own __init__ (`from graphopt import __version__`) is an import of it
    node = ast.parse("from graphopt import __version__").body[0]
    assert _targets(node, "graphopt.kernels.tuning") == ["graphopt"]
    assert _absolute("x", 1, "graphopt.kernels.fp4") == "graphopt.kernels.fp4.x"
    assert _absolute(None, 2, "graphopt.kernels.fp4.tune") == "graphopt.kernels"
