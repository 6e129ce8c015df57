"""The tree shows four layers, each importing only downward: the library (``pagedkv`` outside the three
below), the gate (``pagedkv.testing``, with its strategies), the tools that use the gate
(``pagedkv.tools``) and the command line (``pagedkv.cli``). No module imports itself back through a
cycle, the library runs without Hypothesis or pytest, the plugin imports no torch until asked, one
module runs properties (:mod:`pagedkv.testing.execute`) and nothing imports the pytest plugin."""

from __future__ import annotations

import ast
import re
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: layer of a module by its name's prefix (the longest matching prefix wins); anything else is the library
LAYERS = {"pagedkv.testing": 1, "strategies": 1, "pagedkv.tools": 2, "pagedkv.cli": 3, "pagedkv.__main__": 3}
LAYER_NAMES = ("library", "gate", "tools", "cli")
#: The modules that may touch check functions: the registry declares them, the core runs them.
RUNNERS = ("pagedkv.testing.execute", "pagedkv.testing.registry")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Every project module by its import name (the strategies' source under the name the wheel gives it)."""
    out = {}
    for folder, package in (("pagedkv", "pagedkv"), ("strategies", "pagedkv.testing.strategies")):
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
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


def layer(name: str) -> int:
    """0 library, 1 gate, 2 tools, 3 cli."""
    matches = [prefix for prefix in LAYERS if name == prefix or name.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else 0


def wrong_way_imports(root: Path = ROOT) -> list[str]:
    """``"a (gate) imports b (tools)"`` for every import from a lower layer into a higher one."""
    modules = _modules(root)
    return [f"{m} ({LAYER_NAMES[layer(m)]}) imports {t} ({LAYER_NAMES[layer(t)]})"
            for m, p in sorted(modules.items()) for t in sorted(_imports(m, p, modules))
            if layer(t) > layer(m) and t != "pagedkv"]


def test_no_module_imports_a_higher_layer():
    assert not wrong_way_imports(), "imports against the layers:\n" + "\n".join(wrong_way_imports())


def test_a_planted_wrong_way_import_is_found(tmp_path):
    """The check itself bites: one lazy import of a tool from inside the gate, one of the gate from the library."""
    for folder in ("pagedkv", "strategies"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    execute = tmp_path / "pagedkv" / "testing" / "execute.py"
    execute.write_text(execute.read_text() + "\n\ndef _planted():\n    from pagedkv.tools.mutants import backends\n")
    allocator = tmp_path / "pagedkv" / "cache" / "allocator.py"
    allocator.write_text(allocator.read_text() + "\nimport pagedkv.testing.compare\n")
    found = {line.split(" imports ")[0] + " -> " + line.split(" imports ")[1].split(".")[1] for line in
             wrong_way_imports(tmp_path)}
    assert found == {"pagedkv.cache.allocator (library) -> testing", "pagedkv.testing.execute (gate) -> tools"}, found


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
            "import pagedkv, pagedkv.backends.loop, pagedkv.backends.indexed, pagedkv.cache.paged_cache, "
            "pagedkv.attention.dense; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_plugin_imports_no_torch_until_asked():
    """What every pytest start pays where pagedkv is installed (``python -X importtime`` lists each import)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pagedkv.testing.plugin"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "pagedkv.testing.plugin" in imported
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "numpy", "hypothesis", "triton")]
    assert not heavy, f"importing the plugin imports {heavy[:5]}"


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
    importers = [m for m, p in modules.items() if "pagedkv.testing.plugin" in _imports(m, p, modules)]
    assert not importers, f"modules importing the pytest plugin (it is hooks only): {importers}"


def test_the_wheel_lists_every_package_and_ships_no_top_level_strategies():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert set(config["packages"]) == on_disk, (set(config["packages"]) ^ on_disk)
    assert not any(p == "strategies" or p.startswith("strategies.") for p in config["packages"])
    assert config["package-dir"] == {"pagedkv.testing.strategies": "strategies"}


def test_plain_strategies_in_a_checkout_is_the_kits_package():
    import strategies
    import strategies.batches

    import pagedkv.testing.strategies as source

    assert strategies is source and strategies.batches is source.batches


def test_private_hypothesis_api_is_used_in_one_adapter_module():
    """Hypothesis's private names (``hypothesis.internal``, ``_hypothesis_internal_*``, underscored
    attributes of its public objects) stand in :mod:`pagedkv.testing.hypothesis_internals` only."""
    private = re.compile(r"hypothesis\.internal|_hypothesis_internal|\b(?:settings|hypothesis)\._[a-z]")
    users = sorted(name for name, path in _modules().items()
                   if name != "pagedkv.testing.hypothesis_internals" and private.search(path.read_text()))
    assert not users, f"modules using Hypothesis's private API outside the adapter: {users}"


def test_one_module_sets_the_health_check_policy():
    """Every settings object the kit and its tools run under is built by :mod:`pagedkv.testing.settings`,
    so a property cannot pass one entry point and fail another on a health check."""
    users = sorted(name for name, path in _modules().items()
                   if name != "pagedkv.testing.settings" and "suppress_health_check" in path.read_text())
    assert not users, f"modules choosing health checks of their own: {users}"
