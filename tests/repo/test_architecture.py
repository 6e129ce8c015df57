"""The tree shows three layers, each importing only downward: the library (``pagedkv``), the kit
(``pagedkv.testing``, with its strategies) and the tools (``pagedkv.cli``). No module imports itself
back through a cycle, the library runs without Hypothesis or pytest, no module is over ~450 lines,
one module runs properties (:mod:`pagedkv.testing.execute`) and nothing imports the pytest plugin."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pagedkv",)
MAX_LINES = 450
#: The modules that may touch check functions: the registry declares them, the core runs them.
RUNNERS = ("pagedkv.testing.execute", "pagedkv.testing.registry")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports (at any depth of the file: lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _layer(name: str) -> int:
    if name.startswith(("pagedkv.cli", "pagedkv.__main__")):
        return 2
    if name.startswith(("pagedkv.testing", "strategies")):
        return 1
    return 0


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    upward = [(m, t) for m, p in modules.items() for t in _imports(m, p, modules)
              if _layer(t) > _layer(m) and t != "pagedkv"]
    assert not upward, f"imports from a lower layer into a higher one: {upward}"


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {m: {t for t in _imports(m, p, modules) if t not in (m.rpartition(".")[0], "pagedkv")}
             for m, p in modules.items()}
    done: set[str] = set()

    def cycle_from(node: str, stack: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in done:
                found = cycle_from(nxt, stack + [nxt])
                if found:
                    return found
        done.add(node)
        return None

    for m in sorted(graph):
        cycle = None if m in done else cycle_from(m, [m])
        assert not cycle, f"import cycle: {' -> '.join(cycle)}"


def test_the_library_imports_without_hypothesis_or_pytest():
    code = ("import sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None; "
            "import pagedkv, pagedkv.backends.loop, pagedkv.backends.indexed, pagedkv.cache.paged_cache, pagedkv.attention.dense; "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_no_module_is_over_the_size_budget():
    big = {str(p.relative_to(ROOT)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split by concept): {big}"


def test_one_runner_calls_check_functions():
    """Only the execution core calls a property's check, and only the registry (and the check modules
    among themselves) import the check modules: every entry point goes through execute."""
    from pagedkv.testing.registry import check_functions

    checks = {f.__name__ for f in check_functions()}
    offenders = []
    for name, path in _modules().items():
        if name in RUNNERS or name.startswith("pagedkv.testing.properties"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedkv.testing.properties"):
                module = importlib.import_module(node.module)
                offenders += [f"{name} imports the check function {a.name}" for a in node.names
                              if getattr(getattr(module, a.name, None), "__name__", None) in checks]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("prop", "p", "property_"):
                offenders.append(f"{name} calls {node.func.value.id}.check (line {node.lineno})")
    assert not offenders, f"property runs outside pagedkv.testing.execute: {offenders}"


def test_nothing_imports_the_plugin():
    modules = _modules()
    importers = [m for m, p in modules.items() if "pagedkv.testing.plugin" in _imports(m, p, modules)
                 and m != "pagedkv.tools.baseline.gate"]  # the plugin's own second module (pytest_plugins)
    assert not importers, f"modules importing the pytest plugin (it is hooks only): {importers}"


def test_the_wheel_ships_no_top_level_strategies_and_the_face_is_the_same_modules():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["pagedkv*"]
    import strategies
    import strategies.batches

    import pagedkv.testing.strategies as source

    assert strategies.batches is source.batches and strategies.cases is source.cases
