"""The baseline's own process: load a backend from a tree put first on ``sys.path`` and serve its ops.

Started by :class:`pagedkv.tools.baseline.BaselineProxy` as
``python -c <bootstrap> THIS_FILE TREE SPEC PARENT_SYS_PATH_JSON``, never imported by the parent.
It imports nothing from pagedkv at module level: the ``pagedkv`` it loads is the one in ``TREE``
(a git revision, an unpacked wheel, an old site-packages), which shares every module name with the
parent's copy, so it must be the first ``pagedkv`` this interpreter imports.

Protocol (both directions): an 8-byte little-endian length, then a ``torch.save`` payload read
back with ``weights_only=True`` (tensors, tuples, lists, dicts, strings, numbers, ``None``).
The worker's real stdout/stdin are kept for the protocol; fd 1 is pointed at stderr so a stray
``print`` in the baseline cannot corrupt it.

- worker -> parent, once: ``("ready", info_json)`` or ``("error", type_module, type_name, args, message,
  traceback)`` when the backend cannot be loaded;
- parent -> worker: ``("call", op, args, kwargs)``; worker -> parent: ``("ok", result, mutated)``, where
  ``mutated`` maps the index (``int``) or name (``str``) of every tensor argument whose bits changed to its
  new value, or the ``("error", ...)`` tuple above;
- parent -> worker: ``("close",)``: exit 0.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
import sys
import traceback

OPS = ("scatter", "gather", "write_kv", "paged_attention")


def read_message(stream, torch):
    """One message from ``stream``, or ``None`` at end of file."""
    header = stream.read(8)
    if len(header) < 8:
        return None
    (size,) = struct.unpack("<Q", header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return torch.load(io.BytesIO(payload), weights_only=True)


def write_message(stream, torch, message) -> None:
    """``message`` framed onto ``stream`` (flushed)."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    data = buffer.getvalue()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _bits(torch, x):
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(width)


def _error(exc: BaseException) -> tuple:
    args = tuple(a for a in exc.args if isinstance(a, (str, int, float, bool)) or a is None)
    if len(args) != len(exc.args):
        args = (str(exc),)
    return ("error", type(exc).__module__, type(exc).__qualname__, args, str(exc), traceback.format_exc())


def _load(spec: str, tree: str):
    """The backend ``spec`` names, loaded with the tree's own ``pagedkv.load_backend`` (any pagedkv the
    path reaches when the tree has none); a relative ``.py`` path is looked up in the tree first."""
    module, sep, attr = spec.rpartition(":")
    path = module if sep else spec
    if tree and path.endswith(".py") and not os.path.isabs(path) and os.path.isfile(os.path.join(tree, path)):
        spec = os.path.join(tree, path) + (f":{attr}" if sep else "")
    from pagedkv.backends import load_backend

    return load_backend(spec)


def _capabilities(backend) -> dict | None:
    caps = getattr(backend, "capabilities", None)
    if caps is None or not dataclasses.is_dataclass(caps):
        return None

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(caps))


def _info(backend, spec: str) -> str:
    import inspect

    module = backend if inspect.ismodule(backend) else inspect.getmodule(backend)
    pagedkv = sys.modules.get("pagedkv")
    return json.dumps({
        "name": getattr(backend, "name", None) if isinstance(getattr(backend, "name", None), str) else spec,
        "ops": [op for op in OPS if callable(getattr(backend, op, None))],
        "features": sorted(getattr(backend, "FEATURES", ()) or ()),
        "capabilities": _capabilities(backend),
        "origin": getattr(module, "__file__", None),
        "pagedkv": getattr(pagedkv, "__file__", None),
        "pid": os.getpid(),
    })


def _serve(backend, torch, inp, out) -> int:
    while True:
        message = read_message(inp, torch)
        if message is None or message[0] == "close":
            return 0
        _, op, args, kwargs = message
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)] + \
            [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        before = {key: t.clone() for key, t in tensors}
        try:
            result = getattr(backend, op)(*args, **kwargs)
        except Exception as exc:
            write_message(out, torch, _error(exc))
            continue
        mutated = {key: t for key, t in tensors
                   if t.shape == before[key].shape and not torch.equal(_bits(torch, t), _bits(torch, before[key]))}
        write_message(out, torch, ("ok", result, mutated))


def main(argv: list[str]) -> int:
    tree, spec, parent_path = argv[0], argv[1], json.loads(argv[2])
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints go to stderr, the protocol keeps the original stdout
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = ([tree] if tree else []) + [p for p in parent_path if p and os.path.abspath(p) != here]
    import torch

    try:
        backend = _load(spec, tree)
    except Exception as exc:
        write_message(out, torch, _error(exc))
        return 1
    write_message(out, torch, ("ready", _info(backend, spec)))
    return _serve(backend, torch, inp, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
