"""The mutation operators of :mod:`pagedkv.tools.mutants.generate`: which edits a kernel's source gets.

:class:`EditCollector` walks a parsed module and proposes, inside every function body, one edit per
*site* for each operator that fits it; :func:`~pagedkv.tools.mutants.generate.generate` turns the
edits into mutants. The operators, kept apart from the mutant bookkeeping so the table of faults reads
in one place:

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

Follows the mutation-operator design of Offutt et al. ("An experimental determination of sufficient
mutant operators") restricted to the faults paged-attention kernels ship (vLLM, FlashInfer,
flash-attn): boundaries, masks, index arithmetic, widths and softmax constants.
"""

from __future__ import annotations

import ast
import re

#: Operator kinds, in report order.
OPERATORS = ("boundary", "off_by_one", "mask_term", "guard", "index", "int_width", "acc_dtype", "constant")

#: What ``float("-inf")`` becomes: finite, so a fully masked row's ``exp2(m - m)`` is 1, not NaN.
LARGE_FINITE = "1e30"
_LOG_CONSTANTS = (1.4426950408889634, 0.6931471805599453)  # log2(e), ln(2)
_PRAGMA = "pragma: no mutate"


class EditCollector(ast.NodeVisitor):
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


def skip_defaults(tree: ast.AST) -> set[int]:
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
