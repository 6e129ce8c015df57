"""Automatic mutants of kernel source: Python, Triton and PyTorch code, one small fault each.

:func:`generate` reads a source file, parses it with :mod:`ast` and, inside every function body,
proposes one edit per *site* with the operators of :mod:`pagedkv.tools.mutants.operators`
(:data:`OPERATORS`: boundaries, off-by-one, mask terms, guards, index arithmetic, widths, constants).

Edits are token-precise: the file is copied byte for byte except the mutated span, and a
replacement spanning several lines keeps the line count (it is parenthesised and padded with
newlines), so every line number, traceback and ``inspect.getsource`` of the mutant matches the
original. Docstrings, decorators, annotations, default values, f-strings and lines marked
``# pragma: no mutate`` are left alone; every mutant is re-parsed and dropped if it is not valid Python.

A mutant is *applied* in a child process only (:mod:`pagedkv.tools.mutants.kill_rates`): the mutated file
is written to a scratch directory and :data:`BOOTSTRAP` installs a meta-path finder that loads it under
the original module's name before anything imports that module. Triton's ``@triton.jit`` reads a
kernel's own source (``inspect.getsource``), so the mutated text must be a real file; the installed
file is never edited. This is why no existing engine fits: mutmut 3 rewrites functions into
trampolines (and skips decorated functions, every ``@triton.jit`` kernel), and cosmic-ray edits the
module on disk with generic operators (``+`` into each other arithmetic operator, no call-level edits).
"""

from __future__ import annotations

import ast
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedkv.tools.mutants.operators import LARGE_FINITE, OPERATORS, EditCollector, skip_defaults

__all__ = ["BOOTSTRAP", "LARGE_FINITE", "OPERATORS", "SourceMutant", "generate", "loaded_from", "module_name_for",
           "sample", "write_mutant"]


@dataclass(frozen=True)
class SourceMutant:
    """One mutant: the span ``[line:col, end_line:end_col)`` of ``file`` replaced by ``replacement``.

    Attributes:
        id: ``<file stem>-<n>`` with ``n`` the mutant's index in :func:`generate`'s order (stable while
            the file does not change). file: absolute path of the original. module: the import name the
            mutant replaces. line, col, end_line, end_col: 1-based lines, 0-based character columns.
        operator: one of :data:`OPERATORS`. function: qualified name of the enclosing function.
        before, after: the first mutated line, original and mutated (stripped).
        original, replacement: the span's text and its new text.
    """

    id: str
    file: str
    module: str
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    function: str
    before: str
    after: str
    original: str
    replacement: str

    @property
    def diff(self) -> str:
        """One line: ``L<line>: <span>  ->  <new span>`` (whitespace collapsed, 70 characters a side at most)."""
        def short(text):
            text = " ".join(text.split())
            return text if len(text) <= 70 else text[:67] + "..."
        old, new = self.original, self.replacement
        if len(old.strip()) <= 8 and "\n" not in old:  # an operator token: show it in its context
            line = Path(self.file).read_text().splitlines()[self.line - 1] if Path(self.file).is_file() else old
            lo, hi = max(0, self.col - 24), self.col + len(old) + 24
            old, new = line[lo:hi], line[lo:self.col] + new + line[self.col + len(old):hi]
        return f"L{self.line}: {short(old)}  ->  {short(new)}"

    def mutated_source(self, source: str | None = None) -> str:
        """The whole mutated file (``source``: the original text, read from :attr:`file` when omitted).

        Raises:
            ValueError: the span no longer holds :attr:`original` (the file changed since the mutants were
                generated: its offsets would splice the replacement into the wrong place).
        """
        text = Path(self.file).read_text() if source is None else source
        lines = text.splitlines(keepends=True)
        start = sum(len(x) for x in lines[: self.line - 1]) + self.col
        end = sum(len(x) for x in lines[: self.end_line - 1]) + self.end_col
        if text[start:end] != self.original:
            raise ValueError(f"{self.file} changed since mutant {self.id} was generated: line {self.line} no longer "
                             f"holds {self.original!r}; generate the mutants again")
        return text[:start] + self.replacement + text[end:]

    def to_dict(self) -> dict:
        """Plain data (JSON), :attr:`diff` included."""
        return {**asdict(self), "diff": self.diff}


def module_name_for(path: str | Path) -> str:
    """The dotted import name of ``path``: its stem, prefixed by every enclosing package (a directory
    with ``__init__.py``); ``pkg/__init__.py`` is ``pkg``.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"--source {str(path)!r}: no such file")
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def generate(path: str | Path, *, module: str | None = None, operators: tuple[str, ...] | None = None,
             functions: tuple[str, ...] = ()) -> list[SourceMutant]:
    """Every mutant of the file at ``path``, in source order.

    Args:
        path: a Python source file (a Triton kernel module, a PyTorch backend, ...).
        module: the import name it is loaded under (default: :func:`module_name_for`).
        operators: only these kinds (default :data:`OPERATORS`).
        functions: only inside functions whose qualified name (``Class.method``) or name is one of these.

    Returns:
        The mutants; each parses, and keeps the file's line count.

    Raises:
        FileNotFoundError: no such file. SyntaxError: the file itself does not parse.
        ValueError: an unknown operator.
    """
    path = Path(path).resolve()
    wanted = tuple(operators or OPERATORS)
    unknown = set(wanted) - set(OPERATORS)
    if unknown:
        raise ValueError(f"operators: unknown {sorted(unknown)}; choose from {list(OPERATORS)}")
    module = module or module_name_for(path)
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    skip = skip_defaults(tree)
    collector = EditCollector(source)
    collector._stride_names = frozenset(n.id for n in ast.walk(tree)
                                        if isinstance(n, ast.Name) and n.id.startswith("stride_"))
    # parameters named stride_* count as siblings too
    collector._stride_names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                                for a in n.args.args if a.arg.startswith("stride_")}
    original_visit = collector.visit

    def visit(node):  # never descend into defaults, decorators, annotations
        if id(node) not in skip:
            return original_visit(node)
    collector.visit = visit
    collector.visit(tree)
    lines = source.splitlines()
    mutants, seen = [], set()
    for op, start, end, new, func in collector.edits:
        if (start, end, new) in seen:
            continue
        seen.add((start, end, new))
        line = source.count("\n", 0, start) + 1
        end_line = source.count("\n", 0, end) + 1
        col = start - (source.rfind("\n", 0, start) + 1)
        end_col = end - (source.rfind("\n", 0, end) + 1)
        mutated = source[:start] + new + source[end:]
        try:
            ast.parse(mutated)
        except SyntaxError:
            continue
        if mutated.count("\n") != source.count("\n"):
            continue
        after = mutated.splitlines()[line - 1]
        mutants.append(SourceMutant(f"{path.stem}-{len(mutants):04d}", str(path), module, line, col, end_line,
                                    end_col, op, func, lines[line - 1].strip(), after.strip(),
                                    source[start:end], new))
    return [m for m in mutants if m.operator in wanted and (
        not functions or m.function in functions or m.function.rsplit(".", 1)[-1] in functions)]


def sample(mutants: list[SourceMutant], count: int | None, seed: int = 0) -> list[SourceMutant]:
    """At most ``count`` mutants, drawn with ``seed`` round-robin over the operator kinds (each kind
    represented before any has two), returned in source order; ``None``: all of them."""
    if count is None or count >= len(mutants):
        return list(mutants)
    rng = random.Random(seed)
    by_op: dict[str, list[SourceMutant]] = {}
    for m in mutants:
        by_op.setdefault(m.operator, []).append(m)
    for group in by_op.values():
        rng.shuffle(group)
    chosen: list[SourceMutant] = []
    while len(chosen) < count:
        for op in OPERATORS:
            if by_op.get(op) and len(chosen) < count:
                chosen.append(by_op[op].pop())
    order = {m.id: i for i, m in enumerate(mutants)}
    return sorted(chosen, key=lambda m: order[m.id])


def write_mutant(mutant: SourceMutant, directory: str | Path) -> Path:
    """Write the mutated file to ``directory/<id>/<original file name>`` and return its path."""
    target = Path(directory) / mutant.id / Path(mutant.file).name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(mutant.mutated_source())
    return target


#: Python run first in a child (``python -c BOOTSTRAP MODULE PATH ...``): a meta-path finder that loads
#: ``PATH`` as ``MODULE`` (no import of the package under test before it is in place).
BOOTSTRAP = r'''
import importlib.abc, importlib.util, os, sys
class _MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name, path):
        self.name, self.path = name, path
    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        package = [os.path.dirname(self.original)] if os.path.basename(self.path) == "__init__.py" else None
        return importlib.util.spec_from_file_location(fullname, self.path, submodule_search_locations=package)
def install_mutant(name, path, original):
    if name in sys.modules:
        raise RuntimeError(f"{name} was imported before its mutant was installed")
    finder = _MutantFinder(name, path)
    finder.original = original
    sys.meta_path.insert(0, finder)
'''


def loaded_from(module: str) -> str | None:
    """The file ``module`` was loaded from in this process (``None``: not imported)."""
    import sys

    mod = sys.modules.get(module)
    return getattr(mod, "__file__", None) if mod is not None else None
