"""Automatic mutants of kernel source: Python, Triton and PyTorch code, one small fault each.

:func:`generate` reads a source file, parses it with :mod:`ast` and, inside every function body,
proposes one edit per *site* with operators that fit kernels (:data:`OPERATORS`):

=============  ================================================================================
operator       edit
=============  ================================================================================
``boundary``   ``<`` / ``<=`` and ``>`` / ``>=`` swapped (masks, loop bounds, tile guards)
``off_by_one`` ``x + 1`` / ``x - 1``: the sign flipped, or the ``1`` dropped (offsets, block counts)
``mask_term``  ``a & b`` -> ``a``, -> ``b``; ``a and b`` likewise (a dropped mask term)
``guard``      ``tl.where(c, x, y)`` / ``torch.where`` -> ``x``, -> ``y``; ``tl.maximum(a, b)``,
               ``minimum``, ``max``, ``min`` -> ``a``, -> ``b``; ``tl.load`` / ``tl.store`` without
               ``mask=`` (and ``other=``)
``index``      ``//`` / ``%`` swapped (block index vs slot), a ``stride_*`` argument replaced by
               its sibling (``stride_kb`` -> ``stride_ks``), ``.stride(i)``, ``.size(i)``,
               ``.shape[i]`` -> ``i + 1`` (or ``i - 1``), operands of ``a - b`` swapped
``int_width``  ``tl.int64`` / ``torch.int64`` -> ``int32``; ``.long()`` -> ``.int()``
``acc_dtype``  ``float32`` -> ``float16``, ``float64`` -> ``float32``; ``.float()`` -> ``.half()``,
               ``.double()`` -> ``.float()``
``constant``   ``float("-inf")`` / ``math.inf`` -> a large finite value, log2(e) and ln(2) -> ``1.0``,
               ``0`` / ``1`` swapped, other numbers ``k`` -> ``k + 1`` (ints) or ``2 * k`` (floats),
               a factor ``a * s`` or ``a / s`` dropped (scales, ``LOG2E``)
=============  ================================================================================

Edits are token-precise: the file is copied byte for byte except the mutated span, and a
replacement spanning several lines keeps the line count (it is parenthesised and padded with
newlines), so every line number, traceback and ``inspect.getsource`` of the mutant matches the
original. Docstrings, decorators, annotations, default values, f-strings and lines marked
``# pragma: no mutate`` are left alone; every mutant is re-parsed and dropped if it is not valid Python.

A mutant is *applied* in a child process only (:mod:`pagedkv.testing.mutants.kill_rates`): the mutated file
is written to a scratch directory and :data:`BOOTSTRAP` installs a meta-path finder that loads it under
the original module's name before anything imports that module. Triton's ``@triton.jit`` reads a
kernel's own source (``inspect.getsource``), so the mutated text must be a real file; the installed
file is never edited. This is why no existing engine fits: mutmut 3 rewrites functions into
trampolines (and skips decorated functions, every ``@triton.jit`` kernel), and cosmic-ray edits the
module on disk with generic operators (``+`` into each other arithmetic operator, no call-level edits).

Follows the mutation-operator design of Offutt et al. ("An experimental determination of sufficient
mutant operators") restricted to the faults paged-attention kernels ship (vLLM, FlashInfer,
flash-attn): boundaries, masks, index arithmetic, widths and softmax constants.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

#: Operator kinds, in report order.
OPERATORS = ("boundary", "off_by_one", "mask_term", "guard", "index", "int_width", "acc_dtype", "constant")

#: What ``float("-inf")`` becomes: finite, so a fully masked row's ``exp2(m - m)`` is 1, not NaN.
LARGE_FINITE = "1e30"
_LOG_CONSTANTS = (1.4426950408889634, 0.6931471805599453)  # log2(e), ln(2)
_PRAGMA = "pragma: no mutate"


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
        """The whole mutated file (``source``: the original text, read from :attr:`file` when omitted)."""
        text = Path(self.file).read_text() if source is None else source
        lines = text.splitlines(keepends=True)
        start = sum(len(x) for x in lines[: self.line - 1]) + self.col
        end = sum(len(x) for x in lines[: self.end_line - 1]) + self.end_col
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


# -- edits ------------------------------------------------------------------------------------------------
class _Collector(ast.NodeVisitor):
    """Walks a module and records ``(operator, start, end, replacement, function)`` edits (absolute
    character offsets into the source)."""

    def __init__(self, source: str):
        self.src = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.edits: list[tuple[str, int, int, str, str]] = []
        self.func: list[str] = []
        self.skip_lines = {i + 1 for i, line in enumerate(self.lines) if _PRAGMA in line}

    # positions: ast columns are UTF-8 byte offsets
    def _off(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self._off(node.lineno, node.col_offset), self._off(node.end_lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> str:
        a, b = self.span(node)
        return self.src[a:b]

    def add(self, op: str, start: int, end: int, new: str) -> None:
        if not self.func:
            return
        first = self.src.count("\n", 0, start) + 1
        last = self.src.count("\n", 0, end) + 1
        if self.skip_lines & set(range(first, last + 1)):
            return
        old = self.src[start:end]
        newlines = old.count("\n") - new.count("\n")
        if newlines > 0:  # keep every later line where it was
            new = f"({new}{chr(10) * newlines})"
        elif newlines < 0:
            new = " ".join(new.split())
        if new != old:
            self.edits.append((op, start, end, new, ".".join(self.func)))

    def replace_node(self, op: str, node: ast.AST, child: ast.AST | str) -> None:
        """``node`` replaced by ``child``'s text (parenthesised unless it is an atom)."""
        a, b = self.span(node)
        if isinstance(child, str):
            new = child
        else:
            new = self.text(child)
            if not isinstance(child, (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript)):
                new = f"({new})"
        self.add(op, a, b, new)

    def op_token(self, left: ast.AST, right: ast.AST, pattern: str) -> tuple[int, int] | None:
        """Offsets of the operator token matching ``pattern`` between ``left`` and ``right``."""
        a, b = self.span(left)[1], self.span(right)[0]
        m = re.search(pattern, self.src[a:b])
        return (a + m.start(), a + m.end()) if m else None

    # structure: where to look
    def visit_FunctionDef(self, node):
        for deco in node.decorator_list:  # never mutated
            del deco
        self.func.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        for stmt in body:
            self.visit(stmt)
        self.func.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.func.append(node.name)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(stmt)
        self.func.pop()

    def visit_JoinedStr(self, node):  # messages: not kernel behaviour
        return

    def visit_AnnAssign(self, node):  # the annotation is not code that runs
        if node.value is not None:
            self.visit(node.value)

    # operators
    def visit_Compare(self, node):
        swaps = {ast.Lt: ("<", r"<(?![<=])", "<="), ast.LtE: ("<=", r"<=", "<"),
                 ast.Gt: (">", r"(?<![-])>(?![>=])", ">="), ast.GtE: (">=", r">=", ">")}
        prev = node.left
        for op, right in zip(node.ops, node.comparators):
            if type(op) in swaps:
                _, pattern, new = swaps[type(op)]
                pos = self.op_token(prev, right, pattern)
                if pos:
                    self.add("boundary", *pos, new)
            prev = right
        self.generic_visit(node)

    def visit_BinOp(self, node):
        one = lambda n: isinstance(n, ast.Constant) and type(n.value) is int and n.value == 1  # noqa: E731
        if isinstance(node.op, (ast.Add, ast.Sub)) and one(node.right):
            pos = self.op_token(node.left, node.right, r"[+-]")
            if pos:
                self.add("off_by_one", *pos, "-" if isinstance(node.op, ast.Add) else "+")
            self.replace_node("off_by_one", node, node.left)
        if isinstance(node.op, ast.BitAnd):
            self.replace_node("mask_term", node, node.left)
            self.replace_node("mask_term", node, node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            pos = self.op_token(node.left, node.right, r"//|%")
            if pos:
                self.add("index", *pos, "%" if isinstance(node.op, ast.FloorDiv) else "//")
        if isinstance(node.op, ast.Sub) and not isinstance(node.left, ast.Constant) \
                and not isinstance(node.right, ast.Constant):
            a, _ = self.span(node.left)
            _, b = self.span(node.right)
            gap = self.src[self.span(node.left)[1]: self.span(node.right)[0]]
            self.add("index", a, b, f"{self.text(node.right)}{gap}{self.text(node.left)}")
        if isinstance(node.op, (ast.Mult, ast.Div)) and not isinstance(node.right, ast.Constant):
            self.replace_node("constant", node, node.left)
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        if isinstance(node.op, ast.And) and len(node.values) == 2:
            self.replace_node("mask_term", node, node.values[0])
            self.replace_node("mask_term", node, node.values[1])
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        args = node.args
        if attr == "where" and len(args) == 3 and not node.keywords:
            self.replace_node("guard", node, args[1])
            self.replace_node("guard", node, args[2])
        elif attr in ("maximum", "minimum", "max", "min", "fmax", "fmin") and len(args) == 2 and not node.keywords:
            self.replace_node("guard", node, args[0])
            self.replace_node("guard", node, args[1])
        elif attr in ("load", "store") and isinstance(func, ast.Attribute) and \
                any(k.arg == "mask" for k in node.keywords):
            kept = [self.text(a) for a in args]
            kept += [self.text(k) for k in node.keywords if k.arg not in ("mask", "other")]
            a, b = self.span(node)
            self.add("guard", a, b, f"{self.text(func)}({', '.join(kept)})")
        if isinstance(func, ast.Attribute) and not args and not node.keywords:
            widths = {"long": ("int_width", "int"), "float": ("acc_dtype", "half"), "double": ("acc_dtype", "float")}
            if func.attr in widths:
                op, new = widths[func.attr]
                a, b = self.span(func)
                self.add(op, b - len(func.attr), b, new)
        if isinstance(func, ast.Attribute) and func.attr in ("stride", "size") and len(args) == 1:
            self._index_constant(args[0])
        if isinstance(func, ast.Name) and func.id == "float" and len(args) == 1 \
                and isinstance(args[0], ast.Constant) and args[0].value in ("-inf", "inf"):
            self.replace_node("constant", node, ("-" if args[0].value == "-inf" else "") + LARGE_FINITE)
            return
        self.generic_visit(node)

    def _index_constant(self, node) -> None:
        if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 3:
            new = node.value + 1 if node.value < 3 else node.value - 1
            self.add("index", *self.span(node), str(new))

    def visit_Subscript(self, node):
        if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            self._index_constant(node.slice)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        dtypes = {"int64": ("int_width", "int32"), "float32": ("acc_dtype", "float16"),
                  "float64": ("acc_dtype", "float32")}
        if isinstance(node.value, ast.Name) and node.value.id in ("tl", "torch", "np") and node.attr in dtypes:
            op, new = dtypes[node.attr]
            a, b = self.span(node)
            self.add(op, b - len(node.attr), b, new)
        if isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr == "inf":
            self.replace_node("constant", node, LARGE_FINITE)
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id.startswith("stride_") and isinstance(node.ctx, ast.Load):
            siblings = sorted(n for n in self._stride_names if n[:-1] == node.id[:-1] and n != node.id)
            if siblings:
                self.add("index", *self.span(node), siblings[0])
        if node.id == "LOG2E" and isinstance(node.ctx, ast.Load):
            self.replace_node("constant", node, "1.0")

    def visit_Constant(self, node):
        value = node.value
        if type(value) is bool or not isinstance(value, (int, float)):
            return
        if isinstance(value, float) and any(abs(value - c) < 1e-6 for c in _LOG_CONSTANTS):
            new = "1.0"
        elif value in (0, 1):
            new = ("1" if value == 0 else "0") if type(value) is int else ("1.0" if value == 0 else "0.0")
        elif type(value) is int:
            new = str(value + 1)
        else:
            new = repr(2 * value)
        self.replace_node("constant", node, new)

    _stride_names: frozenset = frozenset()


def _skip_defaults(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: parameter defaults, decorators, annotations."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots = [*node.args.defaults, *[d for d in node.args.kw_defaults if d], *node.decorator_list]
            roots += [a.annotation for a in (*node.args.args, *node.args.kwonlyargs) if a.annotation]
            if node.returns:
                roots.append(node.returns)
            for root in roots:
                ids.update(id(n) for n in ast.walk(root))
    return ids


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
    skip = _skip_defaults(tree)
    collector = _Collector(source)
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
