"""Backend registry: the project's own backends by name, and candidates loaded from ``module:attr``.

A backend is any object (module, class instance, ...) with a ``name`` and the contract's four ops:
``scatter``, ``gather``, ``write_kv``, ``paged_attention`` (the Protocol
:class:`pagedkv.backends.contract.PagedKVBackend`; ``docs/contract.md``). A candidate may omit ops;
:func:`missing_ops` says which.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from pagedkv.backends.contract import OPS, PagedKVBackend
from pagedkv.errors import BackendError, BackendUnavailableError

BUILTIN = ("loop", "indexed", "triton")

# Positional parameters each op must accept, in order: the contract's signatures, read from the Protocol.
OP_PARAMS = {op: tuple(inspect.signature(getattr(PagedKVBackend, op)).parameters)[1:] for op in OPS}


#: ``paged_attention``'s positional parameters for a backend declaring ``page_table="csr"`` (FlashInfer's
#: page metadata instead of padded block tables; :mod:`pagedkv.csr`).
CSR_ATTENTION_PARAMS = ("query", "k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_last_page_len",
                        "query_start_loc")


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
            return importlib.import_module(".triton.backend", __name__)
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


def _import(module_name: str, spec: str) -> ModuleType:
    """Import ``module_name`` (dotted name, or a path to a ``.py`` file)."""
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise BackendError(f"backend file {module_name!r} does not exist (from {spec!r})")
        mod_name = f"_pagedkv_candidate_{path.stem}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[mod_name]
            raise BackendError(f"importing backend file {module_name!r} (from {spec!r}) failed: "
                               f"{type(exc).__name__}: {exc}{_hint(exc)}") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"cannot import backend module {module_name!r} (from {spec!r}): {exc}"
                           f"{_path_hint(exc, module_name)}") from exc
    except Exception as exc:  # the module itself raised on import: say what, in one line
        raise BackendError(f"importing backend module {module_name!r} (from {spec!r}) failed: "
                           f"{type(exc).__name__}: {exc}{_hint(exc)}") from exc


def _path_hint(exc: ImportError, module_name: str) -> str:
    """Where the module's top package sits in the working directory but is not importable: why, and the fixes
    (the ``pytest`` console script, unlike ``python -m pytest`` and ``python -c``, leaves the working directory
    off ``sys.path``)."""
    top = module_name.split(".")[0]
    if not (isinstance(exc, ModuleNotFoundError) and exc.name == top
            and (Path(top).is_dir() or Path(f"{top}.py").is_file())):
        return ""
    return (f"; {top!r} is in the working directory, which is not on sys.path here (the pytest console script "
            f"leaves it off): install your package (pip install -e .), run python -m pytest, or set "
            f"pythonpath = [\".\"] in your pytest configuration")


def _hint(exc: Exception) -> str:
    """For a misspelled :class:`~pagedkv.backends.capabilities.Capabilities` (or ``Sizes``) field: the known ones."""
    import dataclasses
    import difflib

    match = re.search(r"\b(Capabilities|Sizes).__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
    if not match:
        return ""
    from pagedkv.backends import capabilities

    known = [f.name for f in dataclasses.fields(getattr(capabilities, match.group(1)))]
    close = difflib.get_close_matches(match.group(2), known, n=1)
    return (f" (did you mean {close[0]!r}?" if close else " (") + f" {match.group(1)} fields: {', '.join(known)})"


def _materialize(obj: Any, spec: str) -> Any:
    """A class is instantiated and a factory function called, both with no arguments; anything else is
    the backend itself (a module, an instance, a namespace)."""
    if inspect.isclass(obj):
        what = f"class {obj.__qualname__}"
    elif (inspect.isfunction(obj) or inspect.ismethod(obj)) and obj.__name__ not in OPS \
            and not any(hasattr(obj, op) for op in OPS):
        what = f"factory {obj.__qualname__}()"
    else:
        return obj
    try:
        return obj()
    except TypeError as exc:
        module = spec.rpartition(":")[0] or spec
        hint = (f"; a cache_manager factory is found by its name: point the spec at what holds it ({module!r}, or "
                f"an object with a cache_manager attribute)" if obj.__name__ == "cache_manager" else "")
        raise BackendError(f"{spec!r}: {what} must be callable with no arguments to build the backend "
                           f"(or point the spec at an instance){hint}: {exc}") from exc
    except Exception as exc:
        raise BackendError(f"{spec!r}: building the backend with {what} failed: {type(exc).__name__}: {exc}") from exc


def load_backend(spec: str, *, required: tuple[str, ...] | list[str] = ()) -> Any:
    """Load the implementation under test from a spec and check it against the contract.

    Specs:
        ``"loop"`` / ``"indexed"`` / ``"triton"`` (built-in), ``"pkg.module"`` (the module is the
        backend), ``"pkg.module:attr"`` or ``"pkg.module:attr.sub"`` (an object in it), and
        ``"path/to/file.py"`` or ``"path/to/file.py:attr"``. ``attr`` may be a backend object
        (module, instance, namespace), a class (instantiated with no arguments) or a factory
        function (called with no arguments).

    Checks (see ``docs/contract.md``):
        every op present (``scatter``, ``gather``, ``write_kv``, ``paged_attention``) is callable
        with the contract's positional arguments; at least one op is present; every op in
        ``required`` is present. Missing ops are allowed: the properties that need them are
        skipped with a reason naming the op (:func:`missing_ops`). The result gets a ``name`` (the
        spec) when it has none.

    Args:
        spec: see above.
        required: ops that must be present (for example ``("gather",)``).

    Returns:
        The backend object.

    Raises:
        BackendError: the module or file cannot be imported, ``attr`` does not exist, a class or
            factory needs arguments or fails, an op has the wrong signature or is not callable, the
            object has none of the ops, or a ``required`` op is missing. The message names the spec,
            the op and the expected call.
    """
    if spec in BUILTIN:
        return get_backend(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise BackendError(f"backend spec must be 'pkg.module' or 'pkg.module:attr', got {spec!r}")
    text = spec.strip()
    module_name, sep, attr = text.rpartition(":")
    if not sep or re.fullmatch(r"[A-Za-z]", module_name):  # no attr (or only a Windows drive letter)
        module_name, attr = text, ""
    obj: Any = _import(module_name, spec)
    if attr:
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise BackendError(f"{module_name!r} has no attribute {attr!r} (from {spec!r})") from None
        obj = _materialize(obj, spec)
    problems = missing_ops(obj)
    present = [op for op in OPS if op not in problems or not problems[op].startswith(_NO)]
    alone = ("cache_manager", "merge_attn_states")  # a cache manager, or a merge of attention states, alone is one too
    if not present and not any(callable(getattr(obj, op, None)) for op in alone):
        raise BackendError(f"{spec!r} provides none of the contract's ops {list(OPS)} "
                           f"(a {type(obj).__name__}; point the spec at the backend object)")
    broken = {op: why for op, why in problems.items() if not why.startswith(_NO)}
    if broken:
        raise BackendError(f"{spec!r} breaks the backend contract: " + "; ".join(broken.values()))
    absent = [op for op in required if op in problems]
    if absent:
        raise BackendError(f"{spec!r} lacks required op(s) {absent}: " + "; ".join(problems[op] for op in absent))
    if not isinstance(getattr(obj, "name", None), str):
        try:
            obj.name = spec
        except (AttributeError, TypeError):
            pass
    if "triton" in sys.modules:  # a candidate's own interpreted kernels too (pagedkv.backends.interpreter)
        from pagedkv.backends.interpreter import wrap_interpreted_launches

        wrap_interpreted_launches()
    return obj


_NO = "no op "  # prefix of a missing_ops reason for an op that is absent (not broken)


def missing_ops(backend: Any) -> dict[str, str]:
    """``{op: reason}`` for every contract op ``backend`` lacks or cannot be called as the contract says.

    A reason starting with ``"no op "`` means the op is absent (its properties are skipped); any other
    reason means the op is present but broken (not callable, or a signature that cannot take the
    contract's positional arguments, for example a missing parameter or an extra required one).

    Args:
        backend: any object.

    Returns:
        ``{}`` when the backend provides all four ops as the contract says.
    """
    problems = {}
    name = backend_name(backend)
    from pagedkv.backends.capabilities import capabilities_of

    try:
        csr = capabilities_of(backend).page_table == "csr"
    except (TypeError, ValueError):
        csr = False  # a malformed declaration is reported where the declared space is read
    for op in OPS:
        fn = getattr(backend, op, None)
        params = CSR_ATTENTION_PARAMS if csr and op == "paged_attention" else OP_PARAMS[op]
        expected = f"{op}({', '.join(params)})"
        if fn is None:
            problems[op] = f"{_NO}{op!r}: {name} does not provide {expected}"
            continue
        if not callable(fn):
            problems[op] = f"{name}.{op} is a {type(fn).__name__}, not callable as {expected}"
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: trust it
        try:
            sig.bind(*params)
        except TypeError as exc:
            problems[op] = f"{name}.{op}{sig} cannot be called as {expected}: {exc}"
    return problems


def backend_features(backend: Any) -> frozenset:
    """The optional attention features ``backend`` declares in its ``FEATURES`` (``"window"``, ``"softcap"``,
    ``"alibi"``, ``"sinks"``, ``"fp8"``; see ``docs/contract.md``); a backend without ``FEATURES`` declares none.
    """
    return frozenset(getattr(backend, "FEATURES", ()) or ())


def backend_name(backend: Any) -> str:
    """The backend's ``name`` attribute, or its module/type name."""
    name = getattr(backend, "name", None)
    if isinstance(name, str):
        return name
    return backend.__name__ if isinstance(backend, ModuleType) else type(backend).__name__
