"""Backend registry: the project's own backends by name, and candidates loaded from ``module:attr``.

A backend is any object (module, class instance, ...) with a ``name`` and the contract's four ops:
``scatter``, ``gather``, ``write_kv``, ``paged_attention`` (see ``docs/contract.md``). A candidate may
omit ops; :func:`missing_ops` says which.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from ..errors import BackendError, BackendUnavailableError

OPS = ("scatter", "gather", "write_kv", "paged_attention")
BUILTIN = ("loop", "indexed", "triton")

# Positional parameters each op must accept, in order (the contract's signatures).
OP_PARAMS = {
    "scatter": ("cache", "block_table", "values", "start"),
    "gather": ("cache", "block_table", "seq_len"),
    "write_kv": ("k_cache", "v_cache", "key", "value", "slot_mapping"),
    "paged_attention": ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "scale"),
}


def get_backend(name: str) -> Any:
    """Return one of the project's backends: ``"loop"``, ``"indexed"`` or ``"triton"``.

    Raises:
        BackendError: unknown name.
        BackendUnavailableError: ``"triton"`` when Triton is not importable here.
    """
    if name not in BUILTIN:
        raise BackendError(f"unknown backend {name!r}; built-in backends are {list(BUILTIN)}")
    if name == "triton":
        try:
            return importlib.import_module(".triton", __name__)
        except ImportError as exc:
            raise BackendUnavailableError(f"backend 'triton' needs the triton package: {exc}") from exc
    return importlib.import_module(f".{name}", __name__)


def available_backends() -> list[str]:
    """Names of the built-in backends usable on this machine (``triton`` only when importable)."""
    names = []
    for name in BUILTIN:
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def load_backend(spec: str) -> Any:
    """Load the implementation under test from ``"pkg.module"`` or ``"pkg.module:attr"``.

    A built-in name (``"loop"``, ``"indexed"``, ``"triton"``) is accepted too. ``attr`` may name a
    module-level backend object, a class (instantiated with no arguments) or a factory function
    (called with no arguments). The result gets a ``name`` (the spec) when it has none.

    Raises:
        BackendError: the module cannot be imported, ``attr`` does not exist, or the object has none
            of the contract's ops.
    """
    if spec in BUILTIN:
        return get_backend(spec)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"cannot import backend module {module_name!r} (from {spec!r}): {exc}") from exc
    obj: Any = module
    if attr:
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
        except AttributeError as exc:
            raise BackendError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})") from exc
        if inspect.isclass(obj) or (inspect.isfunction(obj) and not any(hasattr(obj, op) for op in OPS)
                                    and obj.__name__ not in OPS):
            obj = obj()
    if not any(callable(getattr(obj, op, None)) for op in OPS):
        raise BackendError(f"{spec!r} provides none of the contract's ops {list(OPS)}")
    if not isinstance(getattr(obj, "name", None), str):
        try:
            obj.name = spec
        except (AttributeError, TypeError):
            pass
    return obj


def missing_ops(backend: Any) -> dict[str, str]:
    """``{op: reason}`` for every contract op ``backend`` lacks or cannot be called as the contract says."""
    problems = {}
    for op in OPS:
        fn = getattr(backend, op, None)
        if fn is None:
            problems[op] = f"{backend_name(backend)} has no {op!r}"
            continue
        if not callable(fn):
            problems[op] = f"{backend_name(backend)}.{op} is not callable"
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(*OP_PARAMS[op])
        except TypeError as exc:
            problems[op] = (f"{backend_name(backend)}.{op}{sig} cannot be called as "
                            f"{op}({', '.join(OP_PARAMS[op])}): {exc}")
    return problems


def backend_name(backend: Any) -> str:
    """The backend's ``name`` attribute, or its module/type name."""
    name = getattr(backend, "name", None)
    if isinstance(name, str):
        return name
    return backend.__name__ if isinstance(backend, ModuleType) else type(backend).__name__
