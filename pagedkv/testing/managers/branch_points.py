"""Branch points: system prompts cut from earlier requests' prompts, so that later requests share a run ending
inside a prompt (a message edited and resent, a beam, a tree of thoughts), not only at a system prompt's end
(1-9 tokens). Beside a Mamba group the cut decides which cached state a hit needs: a chunk's end, a checkpoint
exported one block below it, a decode step's boundary (the state promise, :meth:`~.machine.ManagerMachine.state_hit`).
So about half the cuts fall a few tokens past a state the earlier request's steps wrote: every such state is asked for
where retention keeps it, and under sparse retention one it drops is there to be wrongly hit (the retention promise,
:meth:`~.machine.ManagerMachine.check_state_retained`). Some cuts count back from the prompt's end instead (its last
message edited and resent): a sibling then shares all of the prompt but its last block or two, which is where the
states kept only for the prompt's replay boundaries lie (vLLM's ``reachable_block_mask`` pins them under sparse
retention; the segments do not).

:class:`BranchPoints` is mixed into the machines :func:`~.machine.machine_for` builds for layouts with a Mamba
group; its rule is drawn under the state promise (:attr:`~.machine.ManagerMachine.state_window`) or the replay
promise (:attr:`~.machine.ManagerMachine.replay_window`: fine-grained hits, where a cut from the prompt's end asks for
its replay boundary's state). Machines without a Mamba group keep their rules, so their derandomized searches draw
what they drew before. Nothing reaches the manager: the requests built on a branch point record their prompts, so a
program file replays in any machine.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, precondition, rule


class BranchPoints:
    """The rule ``branch_point`` (see the module); reads the machine's ``branchable`` prompts."""

    systems = Bundle("systems")

    @precondition(lambda self: (self.state_window or self.replay_window) and any(self.branchable.values()))
    @rule(target=systems, pick=st.integers(0, 7), cut=st.integers(1, 15), state=st.integers(-3, 3))
    def branch_point(self, pick: int, cut: int, state: int) -> list[int]:
        """An earlier request's prompt (its text before any input; ``pick`` back from the newest) cut ``cut`` tokens
        past its start (``state`` 0), ``cut`` tokens short of its end (``state`` below 0; one token at least), or
        ``cut`` tokens past a boundary whose Mamba state its steps wrote and retention keeps (under sparse retention:
        wrote on a block boundary, kept or not; ``state`` back from the newest of them; from the start where it wrote
        none): a system prompt for requests to come. Past a state, a later request's hit needs exactly that state: the
        one below it if it is lost or retention dropped it."""
        rids = [rid for rid, prompt in self.branchable.items() if prompt]
        rid = rids[-1 - pick % len(rids)]
        prompt = self.branchable[rid]
        if state < 0:  # its last message edited and resent: all but its last ``cut`` tokens
            return prompt[:max(1, len(prompt) - cut)]
        states = self.branch_states.get(rid) if state > 0 else None
        return prompt[:(states[-1 - (state - 1) % len(states)] if states else 0) + cut]
