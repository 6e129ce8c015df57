"""One exception hierarchy for pagedkv.

Every error the library raises on purpose derives from :class:`PagedKVError` *and* from the builtin
type the backend contract names (``IndexError``, ``ValueError``, ``TypeError``, ``RuntimeError``), so
callers can catch either the library's type or the builtin one.
"""


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class BlockIndexError(PagedKVError, IndexError):
    """A block id (or slot) that would be read or written lies outside ``[0, num_blocks)``."""


class ShapeError(PagedKVError, ValueError):
    """Shapes, lengths or table sizes that do not fit together (contract: ``ValueError``)."""


class DeviceMismatchError(PagedKVError, ValueError):
    """Tensors that must share a device do not (contract: ``ValueError``)."""


class DTypeMismatchError(PagedKVError, TypeError):
    """Tensors that must share a dtype do not, or a dtype is unsupported (contract: ``TypeError``)."""


class ArgumentTypeError(PagedKVError, TypeError):
    """An argument of the wrong kind: a float or bool where an int is required, a list where a tensor is."""


class ArgumentValueError(PagedKVError, ValueError):
    """An argument of the right kind whose value is out of range: a ``softcap`` below 0 or not finite, a
    ``window_left`` below -1, a non-finite ``scale``, an fp8 ``k_scale`` / ``v_scale`` that is not
    finite and > 0, ALiBi slopes or sinks that are not finite (sinks: or ``-inf``), a ``num_splits``
    below 1 (contract: ``ValueError``). Shapes that do not fit together are :class:`ShapeError`."""


class AllocatorError(PagedKVError, RuntimeError):
    """Base class of block-allocator errors; a failed allocator call changes no state."""


class OutOfBlocksError(AllocatorError):
    """Not enough free (or evictable) blocks for the request."""


class DoubleFreeError(AllocatorError, ValueError):
    """A block (or a sequence) was freed when it held no reference."""


class UnknownBlockError(AllocatorError, ValueError):
    """A block id outside the pool, or a sequence id the cache does not know."""


class InvariantError(PagedKVError, AssertionError):
    """A runtime consistency check (``check_invariants``) found the cache's or allocator's books wrong."""


class BackendError(PagedKVError, ValueError):
    """A backend name is unknown, a ``module:attr`` spec cannot be loaded, or an object breaks the contract."""


class BackendUnavailableError(BackendError):
    """A known backend cannot run here (for example Triton is not installed)."""


class CaseFileError(PagedKVError, ValueError):
    """A case file that is malformed, oversized, over the memory budget or names a backend a file may not
    name. ``field`` is the path of the offending field (``case.seqs[0].seq_len``; ``file`` for the bytes
    themselves), ``reason`` what is wrong with it; ``str()`` is ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str):
        super().__init__(field, reason)  # both in args: the error pickles (pytest-xdist, multiprocessing)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"
