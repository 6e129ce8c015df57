"""The rejection property: an op called with one argument broken raises the contract's error naming
that argument, and writes nothing (the faults: :mod:`pagedkv.testing.cases.invalid_call`)."""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.testing.cases.invalid_call import InvalidCall
from pagedkv.testing.compare import Mismatch, MissingOp, bits, require


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


def csr_metadata_rejected(backend: Any, case: Any, device: str = "cpu") -> None:
    """A CSR candidate's ``paged_attention`` with each fault of :data:`~pagedkv.testing.cases.csr.CSR_FAULTS`
    that fits the case's metadata (indptr not monotone or not starting at 0, a last page length of 0 or past
    the page size, indices past the pool, a row longer than its pages, ...) raises the builtin type the
    contract names for it (``ValueError`` / ``IndexError``: a third-party kernel is judged on those, never on
    pagedkv's own subclasses), with a message naming the faulty argument, and writes neither pool. The same
    rule as :func:`check_rejected` for the padded-table faults.

    Raises:
        Mismatch: no error, the wrong type, a message not naming the argument, or a pool changed.
        MissingOp: the backend takes padded tables.
    """
    from pagedkv.testing.cases.csr import CSR_FAULTS, csr_from_case

    call = getattr(backend, "paged_attention_csr", None)
    if call is None:
        raise MissingOp(f"{getattr(backend, 'name', backend)} does not provide a CSR paged_attention")
    k_cache, v_cache = case.caches(device)
    query, qsl = case.query(device), case.query_start_loc(device)
    valid = csr_from_case(case, device)
    pools = [(name, pool, bits(pool.cpu()).clone()) for name, pool in (("k_cache", k_cache), ("v_cache", v_cache))]
    for fault in CSR_FAULTS:
        if not fault.applies(valid):
            continue
        bad = fault.breaks(valid, case.geometry.num_blocks)
        what = f"paged_attention with {fault.name}"
        try:
            call(query, k_cache, v_cache, bad.kv_indptr, bad.kv_indices, bad.kv_last_page_len, qsl)
        except fault.error as exc:
            raised: BaseException = exc
        except Exception as exc:  # noqa: BLE001 - the wrong type is the finding
            raise Mismatch(f"{what} raised {type(exc).__name__}: {exc}; the contract requires "
                           f"{fault.error.__name__} naming {fault.argument}") from exc
        else:
            raise Mismatch(f"{what} raised nothing; the contract requires {fault.error.__name__} naming "
                           f"{fault.argument}")
        if fault.argument not in str(raised):
            raise Mismatch(f"{what}: the {type(raised).__name__} message does not name the argument "
                           f"{fault.argument!r}: {raised}")
        for name, pool, before in pools:
            if not torch.equal(bits(pool.cpu()), before):
                raise Mismatch(f"{what} raised {type(raised).__name__} but had already written {name}")
