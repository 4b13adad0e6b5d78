"""The gradient check of ``--sync localsgd|diloco``: each group's pseudo-gradient, judged at its sync.

With ``hsdp`` a step's gradient is checked before it crosses groups and a flagged group's batch
is recomputed at once (``trainer/gradient_check.py``). Here what crosses groups is a window's
pseudo-gradient (the last synced parameters minus the group's own after H inner steps), and
recomputing it is training the window again, which a refused sync does anyway. So:

1. at each sync, after the all-reduce and before the commit, the groups exchange their
   pseudo-gradients' norms (a SUM all-reduce, one slot per participant, the gradient check's
   layout plus each one's slot in the window the sync opens) and :func:`judge` them;
2. a flagged group refuses the sync in every group: nothing of it reaches the outer step, every
   group goes back to the synced state and trains the window again. The flagged group becomes a
   :class:`Suspect` and a group that passed its *checker*: in the retrained window the two swap
   their shares of every global batch (the window's samples are still trained once);
3. at the next sync their norms give the verdict (:func:`window_verdict`): the suspect normal on
   the checker's shares and the checker normal on its shares is ``transient`` (the sync commits);
   the suspect abnormal again while the checker is normal on its shares is ``persistent`` (its
   hardware: the sync is refused, the group quarantined); the checker abnormal on the suspect's
   shares is ``data`` (the window's samples themselves: the window is skipped, its samples
   counted skipped, as a batch the gradient check blames).

:meth:`PseudoGradientCheck.decide` is a pure function of the exchanged vector and the suspects,
so every group (and a group that joined at the sync, which heals the suspects with the rest of
the synced point) takes the same decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from protocol.events import Verdict
from trainer.gradient_check import Incident, Judgement, against_others, checkers, filled_slots, judge


@dataclass(frozen=True)
class Suspect:
    """A group whose pseudo-gradient was flagged at a sync, and the group that trains its shares
    in the window trained again (None: no group passed to check it)."""

    group: int
    slot: int
    """its slot in the retrained window (the checker trains this one's shares)"""
    checker: int | None
    checker_slot: int | None
    norms: dict[int, float]
    reference: float | None


def window_verdict(flagged_again: bool, checker_flagged: bool | None) -> Verdict:
    """The suspect's verdict from the retrained window, where it trained the checker's shares
    and the checker its own (``checker_flagged`` None: nobody checked, it trained its own again)."""
    if checker_flagged:
        return "data"  # its shares are abnormal wherever they are trained
    if not flagged_again:
        return "transient"
    return "persistent" if checker_flagged is False else "data"


def described(judgement: Judgement) -> str:
    """The flagged groups' norms, as a person reads them."""
    return "; ".join(f"group {judgement.groups[i]}'s pseudo-gradient norm is "
                     f"{against_others(judgement.norms[i], judgement.reference)}" for i in judgement.flagged)


@dataclass(frozen=True)
class Decision:
    """What one sync's check decided, the same in every group."""

    refused: str | None = None
    """why the sync may not commit (None: it may)"""
    incidents: list[Incident] = field(default_factory=list)
    """the verdicts on the last sync's suspects (the new ones are the check's :attr:`suspects`)"""

    @property
    def skip_window(self) -> bool:
        """A window's samples themselves were found abnormal: it is not trained again."""
        return any(i.verdict == "data" for i in self.incidents)


class PseudoGradientCheck:
    """One group's side of the check; its suspects travel with the synced point (:meth:`state`)."""

    def __init__(self, group: int, factor: float):
        self.group = group
        self.factor = factor
        self.suspects: list[Suspect] = []

    def sent(self, slots: int, slot: int | None, drift: float | None, next_slot: int | None) -> list[float]:
        """This group's part of the exchange: in its participating slot, its drift, its group + 1
        and its slot + 1 in the next window (all zeros when it has no drift: it joined)."""
        sent = [0.0] * (3 * slots)
        if slot is not None and drift is not None and next_slot is not None:
            sent[slot], sent[slots + slot], sent[2 * slots + slot] = drift, float(self.group + 1), float(next_slot + 1)
        return sent

    def decide(self, exchanged: list[float] | None) -> Decision:
        """Judge the exchanged norms against the suspects; keep the new suspects. ``exchanged``
        None: the exchange failed (the sync fails anyway) and the suspects lapse, unjudged."""
        if exchanged is None:
            self.suspects = []
            return Decision()
        slots = len(exchanged) // 3
        filled = filled_slots(exchanged, slots)
        next_slot = {group: round(exchanged[2 * slots + slot]) - 1 for slot, group, _ in filled}
        judgement = judge([g for _, g, _ in filled], [n for _, _, n in filled], self.factor)
        norm_of = dict(zip(judgement.groups, judgement.norms))
        flagged = {judgement.groups[i] for i in judgement.flagged}
        incidents = [Incident(
            group=s.group, norms=s.norms, reference=s.reference, rerun_norm=norm_of[s.group], checker_group=s.checker,
            checker_norm=norm_of.get(s.checker) if s.checker is not None else None,
            verdict=window_verdict(s.group in flagged, None if s.checker is None else s.checker in flagged))
            for s in self.suspects if s.group in norm_of and (s.checker is None or s.checker in norm_of)]
        explained = {i.group for i in incidents} | {i.checker_group for i in incidents}
        new = [i for i in judgement.flagged if judgement.groups[i] not in explained]
        assigned = checkers(new, [i for i in judgement.clean if judgement.groups[i] not in explained])
        taken: set[int] = set()
        self.suspects = []
        for i in new:
            checker = assigned[i] if assigned[i] not in taken else None  # a checker swaps with one suspect only
            taken.add(checker)
            group, checker_group = judgement.groups[i], None if checker is None else judgement.groups[checker]
            self.suspects.append(Suspect(
                group=group, slot=next_slot[group], checker=checker_group,
                checker_slot=None if checker_group is None else next_slot[checker_group],
                norms=norm_of, reference=judgement.reference))
        refused = None
        if judgement.flagged:
            refused = described(judgement) + (": the window is skipped (its samples are abnormal in any group)"
                                              if any(i.verdict == "data" for i in incidents)
                                              else ": the sync is refused in every group and the window trained again")
        return Decision(refused, incidents)

    def traded(self) -> tuple[int, int] | None:
        """Whose shares this group trains in the window the last decision opened, as (slot,
        group), when it is a suspect or a checker: the two trade theirs. None: its own."""
        for s in self.suspects:
            if s.checker is not None and self.group == s.group:
                return s.checker_slot, s.checker
            if self.group == s.checker:
                return s.slot, s.group
        return None

    def state(self) -> list[dict]:
        return [asdict(s) for s in self.suspects]

    def load_state(self, state: list[dict]) -> None:
        self.suspects = [Suspect(**s | {"norms": {int(g): n for g, n in s["norms"].items()}}) for s in state]
