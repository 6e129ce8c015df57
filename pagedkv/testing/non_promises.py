"""Declared non-promises: properties a backend does not promise, by design, each with its reason.

A real kernel may not promise a property the suite checks: vLLM's ``unified_attention`` outside its
batch-invariant mode differs by an ulp between a request alone and the same request in a batch; a
split-K kernel is not bit-exact across split counts. It says so on its capabilities::

    Capabilities(non_promises={
        "a_request_alone_equals_the_same_request_in_a_batch":
            "not batch invariant: the split heuristic depends on the batch",
    })

Such a property still runs. When it fails, the failure is a *finding*: reported (``XFAIL``) with its
case file, replay command and the declared reason, listed in the summary and the JSON verdict, and it
never fails the run. When it passes it counts as judged, like any property.
"""

from __future__ import annotations

from typing import Any


def known_properties() -> list[str]:
    """The names a non-promise may use: every registered property (:mod:`pagedkv.testing.registry`)."""
    from pagedkv.testing.registry import properties

    return list(properties())


def check_non_promises(caps: Any) -> None:
    """Check that every name in ``caps.non_promises`` is a registered property.

    Raises:
        ValueError: a name the suite does not know, with the known names.
    """
    known = known_properties()
    unknown = [name for name, _ in caps.non_promises if name not in known]
    if unknown:
        raise ValueError(f"Capabilities.non_promises: unknown propert{'y' if len(unknown) == 1 else 'ies'} "
                         f"{unknown}; known: {', '.join(known)}")


def finding_reason(reason: str, outcome: Any) -> str:
    """The ``xfail`` reason of a failed non-promised property: the declared reason, the failure's first
    line and the replay command of its case file."""
    failure = outcome.failures[0]
    return (f"finding (declared non-promise: {reason}): {failure.first_line}"
            + (f"; replay: {failure.replay}" if failure.replay else ""))
