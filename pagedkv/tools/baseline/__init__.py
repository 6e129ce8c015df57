"""The code a refactor replaces, loaded as a second backend: a git revision, a source tree, a wheel.

A refactor is gated against the contract (the fp64 definition, the tolerance policy) *and* against
what the old code computed (:mod:`pagedkv.tools.baseline.drift`). The old code usually shares every module
name with the new one (``pagedkv.backends.triton`` at ``HEAD~1`` and in the working tree), so one
interpreter cannot import both: the baseline runs in a worker process of its own
(:mod:`pagedkv.tools.baseline.worker`) with its tree first on ``sys.path``, and
:class:`BaselineProxy` stands in for it here with the same ops and attributes.

Specs (:func:`load_baseline`; ``SPEC`` defaults to the candidate's own spec, e.g. ``indexed`` or
``my_engine.kv:backend``):

=========================  =========================================================================
``git:REV[:SPEC]``         revision ``REV`` of the git repository of the working directory (or of
                           ``$PAGEDKV_BASELINE_REPO``), extracted
                           once with ``git archive`` into ``<cache>/baselines/<sha>``
``path:DIR[:SPEC]``        a source tree, an unpacked wheel or an old ``site-packages`` (``DIR/src`` when
                           the module lives there)
``wheel:FILE.whl[:SPEC]``  a wheel, unpacked once into ``<cache>/baselines/wheel-<sha256>``
``SPEC``                   a plain backend spec (:func:`pagedkv.load_backend`), loaded in this process:
                           for a baseline whose module names differ from the candidate's
=========================  =========================================================================

``<cache>`` is ``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``.

Why a subprocess and not ``multiprocessing``'s spawn context: a spawned child unpickles its target
by importing the target's module, i.e. the parent's ``pagedkv``, before the baseline's tree could go
first on ``sys.path``; the two copies would then also register the same ``torch.library`` op names
(``pagedkv::write_kv``). The worker is started as a plain script that imports pagedkv only after the
path is set.

Tensors travel over the worker's stdin/stdout with ``torch.save`` / ``torch.load(weights_only=True)``
(views keep their strides and shared storage, so an interleaved K/V arena stays one arena). CUDA
tensors are serialized by torch the same way: copied to host memory, sent, and restored on the same
device in the worker, so the baseline runs on the candidate's device and its results come back
there. In-place ops (``scatter``, ``write_kv``) are reflected back: the worker returns every tensor
argument whose bits changed and the proxy copies it into the caller's tensor.

Errors: a pagedkv error raised by the baseline is raised here as the same type (from this process's
:mod:`pagedkv.errors`), chained to a :class:`BaselineError` holding the remote traceback; any other
exception is a :class:`BaselineError` naming the remote type, message and traceback. A worker that
dies (a segfault, an out-of-memory kill) raises :class:`BaselineError` with its exit status and the
end of its stderr; the next call starts a fresh worker.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

from pagedkv.errors import BackendError, PagedKVError

#: The ops a proxy forwards (the contract's).
OPS = ("scatter", "gather", "write_kv", "paged_attention")
PREFIXES = ("git:", "path:", "wheel:")
_BOOTSTRAP = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


class BaselineError(PagedKVError, RuntimeError):
    """The baseline failed: it cannot be loaded, it raised something that is not a pagedkv error (the
    message holds the remote traceback), or its worker process died."""


# -- where the baseline's code comes from ------------------------------------------------------------
def cache_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``."""
    if os.environ.get("PAGEDKV_CACHE_DIR"):
        return Path(os.environ["PAGEDKV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv"


def parse_spec(spec: str, candidate_spec: str | None = None) -> tuple[str, str, str]:
    """``(kind, location, backend_spec)`` of a baseline spec: kind ``"git"``, ``"path"``, ``"wheel"`` or
    ``"plain"`` (location ``""``); ``backend_spec`` is the spec after the location, else ``candidate_spec``.

    Raises:
        BackendError: an empty spec, a missing location, or no backend spec and no candidate spec.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise BackendError(f"baseline spec must be git:REV[:SPEC], path:DIR[:SPEC], wheel:FILE.whl[:SPEC] or a "
                           f"backend spec, got {spec!r}")
    spec = spec.strip()
    kind = next((p[:-1] for p in PREFIXES if spec.startswith(p)), "plain")
    if kind == "plain":
        return "plain", "", spec
    rest = spec[len(kind) + 1:]
    if kind == "wheel" and ".whl" in rest:
        cut = rest.index(".whl") + 4
        location, backend = rest[:cut], rest[cut + 1:] if rest[cut:cut + 1] == ":" else ""
    else:
        location, _, backend = rest.partition(":")
    if not location:
        raise BackendError(f"baseline spec {spec!r} names no {'revision' if kind == 'git' else kind} "
                           f"(expected {kind}:{'REV' if kind == 'git' else 'DIR' if kind == 'path' else 'FILE.whl'}"
                           f"[:SPEC])")
    backend = backend or candidate_spec
    if not backend:
        raise BackendError(f"baseline spec {spec!r} names no backend and there is no candidate spec to reuse; "
                           f"write {spec}:SPEC")
    return kind, location, backend


def _publish(build, dest: Path) -> Path:
    """Build a directory with ``build(tmp)`` next to ``dest`` and move it there atomically (two
    processes racing keep one copy)."""
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("")
        try:
            os.rename(tmp, dest)
        except OSError:  # another process published it first
            if not (dest / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def git_tree(rev: str, repo: str | Path | None = None) -> tuple[Path, str]:
    """``(tree, sha)``: revision ``rev`` of the repository containing ``repo`` (default:
    ``$PAGEDKV_BASELINE_REPO``, else the working directory), extracted with ``git archive`` into
    ``<cache>/baselines/<sha>`` (once per commit).

    Raises:
        BackendError: not a git repository, an unknown revision, or ``git`` is missing.
    """
    where = str(repo or os.environ.get("PAGEDKV_BASELINE_REPO") or Path.cwd())

    def git(*args: str, **kw) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", "-C", where, *args], capture_output=True, check=True, **kw)
        except FileNotFoundError:
            raise BackendError("baseline git:REV needs the git executable on PATH") from None
        except subprocess.CalledProcessError as exc:
            msg = exc.stderr.decode(errors="replace").strip().splitlines()
            raise BackendError(f"baseline git:{rev}: git {args[0]} failed in {where}: "
                               f"{msg[-1] if msg else exc}") from None
    sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").stdout.decode().strip()

    def build(tmp: Path) -> None:
        archive = tmp / ".archive.tar"
        git("archive", "--format=tar", "-o", str(archive), sha)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        archive.unlink()
    return _publish(build, cache_dir() / "baselines" / sha), sha


def wheel_tree(wheel: str | Path) -> Path:
    """A wheel unpacked into ``<cache>/baselines/wheel-<sha256 prefix>`` (once per file content).

    Raises:
        BackendError: the file does not exist or is not a zip archive.
    """
    path = Path(wheel)
    if not path.is_file():
        raise BackendError(f"baseline wheel {str(path)!r} does not exist")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:20]

    def build(tmp: Path) -> None:
        try:
            with zipfile.ZipFile(path) as z:
                z.extractall(tmp)  # zipfile drops absolute paths and '..' components
        except zipfile.BadZipFile as exc:
            raise BackendError(f"baseline wheel {str(path)!r} is not a zip archive: {exc}") from None
    return _publish(build, cache_dir() / "baselines" / f"wheel-{digest}")


def _import_root(tree: Path, backend_spec: str) -> Path:
    """``tree``, or ``tree/src`` when the spec's top-level module lives there (a src layout)."""
    top = backend_spec.split(":")[0].split(".")[0]
    from pagedkv.backends import BUILTIN

    if backend_spec in BUILTIN:
        top = "pagedkv"
    if not any((tree / name).exists() for name in (top, f"{top}.py")) and (tree / "src" / top).exists():
        return tree / "src"
    return tree


def resolve(spec: str, candidate_spec: str | None = None) -> tuple[str, Path | None, str, str]:
    """``(kind, tree, backend_spec, label)``: where a baseline's code is (extracting it if needed) and the
    spec to load there; ``label`` names it in reports (``git:HEAD~1 (3f2a9c1d0e4b)``).

    Raises:
        BackendError: see :func:`parse_spec`, :func:`git_tree`, :func:`wheel_tree`; a ``path:`` directory
            that does not exist.
    """
    kind, location, backend = parse_spec(spec, candidate_spec)
    if kind == "plain":
        return kind, None, backend, backend
    if kind == "git":
        tree, sha = git_tree(location)
        label = f"git:{location} ({sha[:12]})"
    elif kind == "wheel":
        tree, label = wheel_tree(location), f"wheel:{Path(location).name}"
    else:
        tree, label = Path(location).resolve(), f"path:{location}"
        if not tree.is_dir():
            raise BackendError(f"baseline path {location!r} is not a directory")
    return kind, _import_root(tree, backend), backend, label


# -- the proxy ------------------------------------------------------------------------------------------
class BaselineProxy:
    """The baseline backend, running in its own worker process (see the module docstring).

    Attributes:
        name: ``"<label>:<backend spec>"``, e.g. ``"git:HEAD~1 (3f2a9c1d0e4b):triton"``.
        spec: the baseline spec as given. tree: the directory first on the worker's ``sys.path``.
        origin: the file the worker loaded the backend from (proof of which code runs).
        FEATURES: the features the baseline declares; capabilities: its
            :class:`~pagedkv.backends.capabilities.Capabilities` when it declares one.
        scatter, gather, write_kv, paged_attention: present exactly when the baseline provides them.

    Raises (on construction):
        BackendError: the worker cannot start or cannot load the backend (the remote message).
    """

    def __init__(self, spec: str, tree: Path, backend_spec: str, label: str):
        self.spec, self.tree, self.backend_spec, self.label = spec, tree, backend_spec, label
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        info = self._start()
        self.name = f"{label}:{backend_spec}"
        self.origin, self.pagedkv_origin, self.baseline_name = info["origin"], info["pagedkv"], info["name"]
        self.FEATURES = frozenset(info["features"])
        caps = _capabilities(info.get("capabilities"))
        if caps is not None:
            self.capabilities = caps
        for op in info["ops"]:
            setattr(self, op, self._forward(op))
        atexit.register(self.close)

    def __repr__(self) -> str:
        return f"<BaselineProxy {self.name} from {self.origin}>"

    # -- the worker -------------------------------------------------------------------------------------
    def _start(self) -> dict:
        import torch

        worker = Path(__file__).with_name("worker.py")
        self._stderr = tempfile.TemporaryFile()
        argv = [sys.executable, "-c", _BOOTSTRAP, str(worker), str(self.tree), self.backend_spec, json.dumps(sys.path)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        reply = self._receive(torch, "loading the backend")
        if reply[0] != "ready":
            self.close()
            raise BackendError(f"baseline {self.spec!r}: loading {self.backend_spec!r} from {self.tree} failed: "
                               f"{reply[2]}: {reply[4]}")
        return json.loads(reply[1])

    def _receive(self, torch, doing: str):
        from pagedkv.tools.baseline.worker import read_message

        message = read_message(self._proc.stdout, torch)
        if message is None:
            raise self._died(doing)
        return message

    def _died(self, doing: str) -> BaselineError:
        proc, self._proc = self._proc, None
        code = proc.wait()
        how = f"exit status {code}" if code >= 0 else f"signal {-code}"
        try:
            import signal

            how = f"killed by {signal.Signals(-code).name}" if code < 0 else how
        except ValueError:
            pass
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-15:]
        return BaselineError(f"baseline worker for {self.spec!r} (pid {proc.pid}) died while {doing}: {how}"
                             + ("; its stderr ends:\n  " + "\n  ".join(tail) if tail else "; it wrote no stderr"))

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``op`` in the worker; mutated tensor arguments are copied back into ``args`` / ``kwargs``.

        Raises:
            the baseline's pagedkv error type (remote traceback chained), or BaselineError.
        """
        import torch

        from pagedkv.tools.baseline.worker import write_message

        with self._lock:
            if self._proc is None:
                self._start()
            try:
                write_message(self._proc.stdin, torch, ("call", op, tuple(args), dict(kwargs)))
            except (BrokenPipeError, OSError):
                raise self._died(f"receiving {op}") from None
            reply = self._receive(torch, f"running {op}")
        if reply[0] == "error":
            raise _remote_error(self.spec, op, *reply[1:])
        _, result, mutated = reply
        for key, value in mutated.items():
            target = args[key] if isinstance(key, int) else kwargs[key]
            target.copy_(value.to(target.device))
        return result

    def _forward(self, op: str):
        def forward(*args, **kwargs):
            return self.call(op, *args, **kwargs)
        forward.__name__ = forward.__qualname__ = op
        forward.__doc__ = f"The baseline's {op}, run in its worker process (see BaselineProxy)."
        return forward

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            import torch

            from pagedkv.tools.baseline.worker import write_message

            write_message(proc.stdin, torch, ("close",))
            proc.stdin.close()
            proc.wait(timeout=10)
        except Exception:
            proc.kill()
            proc.wait()


def _capabilities(data: dict | None):
    if not data:
        return None
    from pagedkv.backends.capabilities import Capabilities, Sizes

    try:
        fields = {k: Sizes(**v) if isinstance(v, dict) else v for k, v in data.items()}
        return Capabilities(**fields)
    except (TypeError, ValueError):  # a field this pagedkv does not know: the baseline's own space is unknown
        return None


def _remote_error(spec: str, op: str, module: str, qualname: str, args: tuple, message: str, tb: str) -> Exception:
    remote = BaselineError(f"baseline {spec!r} raised {qualname} in {op}: {message}\n"
                           f"remote traceback:\n{tb.rstrip()}")
    if module == "pagedkv.errors":
        import pagedkv.errors

        cls = getattr(pagedkv.errors, qualname, None)
        if isinstance(cls, type) and issubclass(cls, PagedKVError):
            try:
                exc = cls(*args)
            except TypeError:
                exc = cls(message)
            exc.__cause__ = remote
            return exc
    return remote


_LOADED: dict[tuple[str, str | None], Any] = {}


def load_baseline(spec: str, candidate_spec: str | None = None) -> Any:
    """The baseline backend ``spec`` names (see the module docstring), loaded once per
    ``(spec, candidate_spec)`` in this process.

    Args:
        spec: ``git:REV[:SPEC]``, ``path:DIR[:SPEC]``, ``wheel:FILE.whl[:SPEC]`` or a plain backend spec.
        candidate_spec: the candidate's spec, the default ``SPEC``.

    Returns:
        A :class:`BaselineProxy` (git, path, wheel), or the backend itself (plain spec).

    Raises:
        BackendError: the spec is malformed, the code cannot be found or extracted, or the backend
            cannot be loaded (the worker's message).
    """
    key = (spec, candidate_spec)
    if key not in _LOADED:
        kind, tree, backend, label = resolve(spec, candidate_spec)
        if kind == "plain":
            from pagedkv.backends import load_backend

            _LOADED[key] = load_backend(backend)
        else:
            _LOADED[key] = BaselineProxy(spec, tree, backend, label)
    return _LOADED[key]


def is_baseline_spec(spec: str | None) -> bool:
    """Whether ``spec`` names code outside this process's import path (``git:``, ``path:``, ``wheel:``)."""
    return isinstance(spec, str) and spec.strip().startswith(PREFIXES)


def close_all() -> None:
    """Stop every worker :func:`load_baseline` started."""
    for backend in _LOADED.values():
        if isinstance(backend, BaselineProxy):
            backend.close()
    _LOADED.clear()
