"""The rejection property: an op called with one argument broken raises the contract's error naming
that argument, and writes nothing (the faults: :mod:`pagedkv.testing.cases.invalid_call`)."""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.testing.cases.invalid_call import InvalidCall
from pagedkv.testing.compare import Mismatch, bits, require


def check_rejected(backend: Any, call: InvalidCall, device: str = "cpu", *,
                   check_message: bool = True) -> BaseException:
    """Run ``call`` on ``backend``: it must raise ``call.expected`` (a message naming ``call.spec.argument``
    when ``check_message``) and leave both pools bit-identical. Returns the exception raised.

    Raises:
        Mismatch: no error, the wrong error type, a message not naming the argument, or a pool changed.
        MissingOp: the backend lacks ``call.op``.
    """
    fn = require(backend, call.op)
    args, kwargs, (k_cache, v_cache) = call.arguments(device)
    k_before, v_before = bits(k_cache.cpu()).clone(), bits(v_cache.cpu()).clone()
    try:
        fn(*args, **kwargs)
    except call.expected as exc:
        raised: BaseException = exc
    except Exception as exc:  # noqa: BLE001 - the wrong type is the finding
        raise Mismatch(f"{call.op} with {call.fault} ({call.spec.doc}) raised {type(exc).__name__}: {exc}; "
                       f"the contract requires {call.spec.expected}") from exc
    else:
        raise Mismatch(f"{call.op} with {call.fault} ({call.spec.doc}) raised nothing; the contract requires "
                       f"{call.spec.expected}")
    for name, pool, before in (("k_cache", k_cache, k_before), ("v_cache", v_cache, v_before)):
        after = bits(pool.cpu())
        if not torch.equal(after, before):
            where = torch.nonzero((after != before).flatten(2).any(2))[0].tolist()
            raise Mismatch(f"{call.op} with {call.fault} raised {type(raised).__name__} but had already written "
                           f"{name} at block {where[0]}, offset {where[1]}", {"block": where[0]})
    if check_message and call.spec.argument not in str(raised):
        raise Mismatch(f"{call.op} with {call.fault}: the {type(raised).__name__} message does not name the argument "
                       f"{call.spec.argument!r}: {raised}")
    return raised
