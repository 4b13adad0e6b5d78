"""Silent data corruption: every group's gradient is checked before it crosses groups.

The seed's chapter 9, and Megatron's reason to check gradients before its data-parallel
reduce: once a wrong gradient is averaged into every group, every replica and every later
checkpoint carries it, and fingerprints stay equal. So the cross-group all-reduce waits
(``ReplicateAllReduce(defer=True)``) until the groups have compared their gradients' norms:

1. each group takes the norm of its own gradient (its ranks' shards, reduced inside the group);
2. the groups exchange the norms through the managed process group, one slot per participant,
   so every group sees the same vector (:meth:`GradientCheck.check`);
3. :func:`judge`: a norm that is not finite, or above ``factor`` × the median of the others',
   is flagged. Then every group skips the step: it commits with no optimizer step, so no
   parameter anywhere takes the gradient and no group falls out of step;
4. attribution, as Megatron's RerunStateMachine does it: the flagged group recomputes its batch
   from the same state while a group that passed recomputes the flagged group's batch; a second
   exchange gives every group both norms and :func:`attribute` names the fault.

Every decision is a pure function of the exchanged vectors, so every rank of every group takes
the same branch and calls the same collectives in the same order.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchft import Manager

from protocol.events import Verdict
from trainer.collective_watch import CollectiveWatch
from trainer.telemetry import ProgressBeacon

DEFAULT_FACTOR = 10.0
"""Megatron's large-gradient check flags a norm ten times the usual one."""


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for norm in torch._foreach_norm(tensors):
        squares += norm.double() ** 2
    return squares


def shard_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of this rank's tensors."""
    return math.sqrt(_squares(tensors, tensors[0].device if tensors else torch.device("cpu")).item())


def group_norm(tensors: list[torch.Tensor], device: torch.device) -> float:
    """The 2-norm of the tensors of every rank of this group (each rank passes its shards): an
    all-reduce inside the group, which every rank of it must call."""
    squares = _squares(tensors, device)
    dist.all_reduce(squares)
    return math.sqrt(squares.item())


@dataclass(frozen=True)
class Judgement:
    """The exchanged norms, slot by slot, which slots failed the check, and the median norm of
    those that passed (``reference``)."""

    groups: list[int]
    norms: list[float]
    flagged: list[int]
    reference: float | None = None

    @property
    def clean(self) -> list[int]:
        return [slot for slot in range(len(self.groups)) if slot not in self.flagged]


def is_normal(norm: float, reference: float | None, factor: float) -> bool:
    """Finite, and not above ``factor`` × the reference (any finite norm is normal without one)."""
    return math.isfinite(norm) and (reference is None or norm <= factor * reference)


def against_others(norm: float, reference: float | None) -> str:
    """A flagged norm as a person reads it: its multiple of the others' median, or not finite."""
    return f"{norm / reference:.3g}x the others'" if reference and math.isfinite(norm) else "not finite"


def judge(groups: Sequence[int], norms: Sequence[float], factor: float) -> Judgement:
    """Flag each norm that is not finite or exceeds ``factor`` × the median of the others'
    finite norms. A norm far *below* the others is not flagged: corruption that shrinks a
    gradient does little harm to an average."""
    flagged = []
    for slot, norm in enumerate(norms):
        others = [n for other, n in enumerate(norms) if other != slot and math.isfinite(n)]
        if not is_normal(norm, statistics.median(others) if others else None, factor):
            flagged.append(slot)
    clean = [norms[slot] for slot in range(len(norms)) if slot not in flagged]
    return Judgement(list(groups), list(norms), flagged, statistics.median(clean) if clean else None)


def filled_slots(exchanged: Sequence[float], slots: int) -> list[tuple[int, int, float]]:
    """(slot, group, norm) of each slot a group filled, from the exchanged vector: norms first,
    then group + 1 (0 in a slot nobody filled: a participant that is healing sends zeros; its
    norm is no norm and must not be judged, or a healthy group would look 1000× its "peer")."""
    return [(slot, round(exchanged[slots + slot]) - 1, exchanged[slot]) for slot in range(slots)
            if round(exchanged[slots + slot]) > 0]


def checkers(flagged: Sequence[int], clean: Sequence[int]) -> dict[int, int | None]:
    """Which passing slot recomputes each flagged slot's batch: in turn, the same in every group."""
    return {slot: clean[i % len(clean)] if clean else None for i, slot in enumerate(flagged)}


def attribute(rerun_norm: float, checker_norm: float | None, reference: float | None, factor: float) -> Verdict:
    """The flagged group's rerun was normal: ``transient``. Abnormal again, and the checker's
    rerun of the same batch normal: ``persistent`` (the flagged group's hardware). Both abnormal,
    or nobody could check: ``data``, the batch itself."""
    if is_normal(rerun_norm, reference, factor):
        return "transient"
    if checker_norm is not None and is_normal(checker_norm, reference, factor):
        return "persistent"
    return "data"


@dataclass(frozen=True)
class Incident:
    """One flagged group's attribution, as every group computed it."""

    group: int
    norms: dict[int, float]
    reference: float | None
    rerun_norm: float
    checker_group: int | None
    checker_norm: float | None
    verdict: Verdict


@dataclass(frozen=True)
class CheckResult:
    """``passed``: the gradients may cross groups. Otherwise the step is skipped everywhere
    and ``incidents`` says why. ``decided`` is False when an exchange failed: the step fails
    its commit anyway, as after any collective error."""

    passed: bool
    incidents: list[Incident]
    decided: bool = True
    wait_s: float = 0.0
    rerun_s: float = 0.0

    def mine(self, group: int) -> Incident | None:
        return next((i for i in self.incidents if i.group == group), None)

    @property
    def verdict(self) -> Verdict | None:
        """``data`` when an incident blamed the batch itself (retrying it would fail again), else
        the first incident's; None when nothing was flagged."""
        verdicts = [i.verdict for i in self.incidents]
        return "data" if "data" in verdicts else (verdicts[0] if verdicts else None)


class GradientCheck:
    """The cross-group norm check of one rank; see the module's docstring."""

    def __init__(self, manager: Manager, group: int, device: torch.device, beacon: ProgressBeacon,
                 factor: float = DEFAULT_FACTOR, watch: CollectiveWatch | None = None):
        self.manager = manager
        self.group = group
        self.device = device
        self.beacon = beacon
        self.factor = factor
        self.watch = watch
        self._wait_s = 0.0

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        """Waiting on the other groups (the quorum, an exchange): timed, and the beacon says so,
        for it is never this group's hang."""
        start = time.perf_counter()
        self.beacon.enter("allreduce")
        try:
            yield
        finally:
            self.beacon.enter("compute")
            self._wait_s += time.perf_counter() - start

    def _exchange(self, values: list[float]) -> list[float] | None:
        """SUM-all-reduce across the participating groups (a group not participating sends zeros)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self._waiting():
            work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)  # waits for the step's quorum
            with self.watch.waiting() if self.watch else nullcontext():
                work.wait()
        return None if self.manager.errored() else tensor.tolist()

    def _result(self, start: float, passed: bool, incidents: list[Incident] | None) -> CheckResult:
        wait_s, self._wait_s = self._wait_s, 0.0
        reran = bool(incidents)  # reruns happen only to attribute an incident
        return CheckResult(passed, incidents or [], decided=incidents is not None, wait_s=wait_s,
                           rerun_s=time.perf_counter() - start - wait_s if reran else 0.0)

    def check(self, norm: float, rerun: Callable[[int, int], float]) -> CheckResult:
        """Exchange this group's gradient norm with the others' and judge them. The optimizer
        must only be stepped, and the gradients only cross groups, if the result ``passed``.

        ``rerun(group, slot)`` recomputes, from the current state, the gradient of this rank's
        part of the batch that group ``group`` (participating rank ``slot``) trained at the step
        being checked, and returns the group's norm of it."""
        start = time.perf_counter()
        with self._waiting():  # the async quorum settles here
            slot, slots = self.manager.participating_rank(), self.manager.num_participants()
            if not self.manager.is_participating():
                slot = None  # healing: counted among the participants, but torchft sends zeros for it
        sent = [0.0] * (2 * slots)
        if slot is not None:
            sent[slot], sent[slots + slot] = norm, float(self.group + 1)
        got = self._exchange(sent)
        if got is None:
            return self._result(start, False, None)
        filled = filled_slots(got, slots)
        judgement = judge([g for _, g, _ in filled], [n for _, _, n in filled], self.factor)
        if not judgement.flagged:
            return self._result(start, True, [])
        mine = next((i for i, (s, _, _) in enumerate(filled) if s == slot), None)
        return self._result(start, False, self._attribute(judgement, [s for s, _, _ in filled], mine, rerun))

    def _attribute(self, j: Judgement, slots: list[int], mine: int | None,
                   rerun: Callable[[int, int], float]) -> list[Incident] | None:
        """``slots``: each judged group's participating rank; ``mine``: this group's position
        among the judged (None: it sent no norm)."""
        assigned = checkers(j.flagged, j.clean)
        count = len(j.flagged)
        sent = [0.0] * (2 * count)
        for i, flagged in enumerate(j.flagged):
            if mine == flagged:
                sent[i] = rerun(self.group, slots[flagged])
            if mine is not None and mine == assigned[flagged]:
                sent[count + i] = rerun(j.groups[flagged], slots[flagged])
        got = self._exchange(sent)
        if got is None:
            return None
        norms = dict(zip(j.groups, j.norms))
        incidents = []
        for i, flagged in enumerate(j.flagged):
            checker = assigned[flagged]
            checker_norm = got[count + i] if checker is not None else None
            incidents.append(Incident(
                group=j.groups[flagged], norms=norms, reference=j.reference, rerun_norm=got[i],
                checker_group=j.groups[checker] if checker is not None else None, checker_norm=checker_norm,
                verdict=attribute(got[i], checker_norm, j.reference, self.factor)))
        return incidents
