"""Branch points: system prompts cut from earlier requests' prompts, so that later requests share a run ending
inside a prompt (a message edited and resent, a beam, a tree of thoughts), not only at a system prompt's end
(1-9 tokens). Beside a Mamba group the cut decides which cached state a hit needs: a chunk's end, a checkpoint
exported one block below it, a decode step's boundary (the state promise, :meth:`~.machine.ManagerMachine.state_hit`).

:class:`BranchPoints` is mixed into the machines :func:`~.machine.machine_for` builds for layouts with a Mamba
group; its rule is drawn under the state promise only (:attr:`~.machine.ManagerMachine.state_window`). Machines
without a Mamba group keep their rules, so their derandomized searches draw what they drew before. Nothing reaches
the manager: the requests built on a branch point record their prompts, so a program file replays in any machine.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, precondition, rule


class BranchPoints:
    """The rule ``branch_point`` (see the module); reads the machine's ``branchable`` prompts."""

    systems = Bundle("systems")

    @precondition(lambda self: self.state_window and any(self.branchable.values()))
    @rule(target=systems, pick=st.integers(0, 7), cut=st.integers(1, 15))
    def branch_point(self, pick: int, cut: int) -> list[int]:
        """The first ``cut`` tokens of an earlier request's prompt (its text before any input; ``pick`` back from
        the newest), a system prompt for requests to come."""
        prompts = [prompt for prompt in self.branchable.values() if prompt]
        return prompts[-1 - pick % len(prompts)][:cut]
