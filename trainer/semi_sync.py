"""Semi-synchronous training across groups: ``--sync localsgd`` and ``--sync diloco``.

Inside a group FSDP2 trains every step as with ``hsdp``; across groups nothing happens for H
inner steps, then one quorum and one all-reduce of each group's pseudo-gradient (the last synced
parameters minus its own), applied by an outer optimizer. That is torchft's ``DiLoCo``
(``torchft/local_sgd.py``): its optimizer hooks sync after every H-th inner step (one fragment of
the model every H/F steps when streaming), keep the last synced parameters and restore them when
a sync fails. ``localsgd`` is the same class with an outer SGD of rate 1 and no momentum, whose
new parameters are the groups' average, as LocalSGD's; torchft's own ``LocalSGD`` class keeps a
failed sync's unsynced progress, so once the data position rolls back the window's samples would
be trained a second time on top of it.

What this module adds to torchft's class, for what the service promises:

- the **window**: who trains what between two syncs. The quorum that opened it assigns it (its
  members, this group's slot among them and their count), so every group splits each inner step's
  global batch alike without asking anyone. With ``--batch-policy constant`` a window commits only
  when every group that trained it takes part in its sync (:func:`window_veto`); otherwise every
  group trains the window again, split among those left, and no sample is skipped. With
  ``shrink`` a missing group's shares are skipped, and counted.
- the **synced point**: the step count, data position and LR schedule of the last committed
  sync. A failed sync restores them, as torchft restores the parameters; a heal copies them.
- the **pseudo-gradient check** (``--sdc-check``): at each sync, after the all-reduce and before
  the commit, the groups exchange their pseudo-gradients' norms and judge them as the gradient
  check judges gradients (``trainer/gradient_check.py``); an abnormal one refuses the sync in
  every group, so nothing of it reaches the outer step and the window is trained again.
- **joining at a sync** (:meth:`SemiSync.join`): a group without a window (every group at its
  start, a restarted one) asks for a quorum at once and waits in it until the others reach their
  sync; there it heals from them, adds nothing to the sync's average
  (``FailFastManager.start_quorum``) and trains the next window with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from protocol.job import BatchPolicy
from trainer.checkpoint import SEMI_SYNC_KEY
from trainer.gradient_check import Incident
from trainer.job import SyncSettings
from trainer.pseudo_gradient_check import Decision, PseudoGradientCheck
from trainer.state import LiveState, TrainingPosition, digest, local, materialize_optimizer_state


class WindowIncomplete(RuntimeError):
    """A group that trained the window is missing from its sync: its shares were not trained."""


class PseudoGradientAbnormal(RuntimeError):
    """A group's pseudo-gradient failed the check: the sync is refused in every group."""


@dataclass(frozen=True)
class Window:
    """The inner steps between two syncs, as the quorum that opened them assigned them."""

    members: frozenset[str]
    """replica ids of the groups that train the window"""
    slot: int | None
    """this group's place among them (its participating rank); None: not one of them"""
    size: int
    """how many groups split each inner step's global batch"""
    shares_of: int | None = None
    """the group whose shares this one trains (None: its own; another while the pseudo-gradient
    check has it trade shares with a suspect)"""

    @classmethod
    def of(cls, quorum: Any) -> "Window":
        return cls(frozenset(quorum.replica_ids), quorum.replica_rank, quorum.replica_world_size)


def window_veto(policy: BatchPolicy, window: Window | None, sync_members: list[str]) -> str | None:
    """Why a sync may not commit its window (None: it may). With ``constant`` the window's global
    batches were split among its members: one missing from the sync took its shares with it."""
    if policy != "constant" or window is None or window.slot is None:
        return None
    missing = sorted(window.members - set(sync_members))
    if not missing:
        return None
    return (f"{', '.join(m.split(':')[0] for m in missing)} trained this window and is not at its sync: the window "
            "is trained again by the groups left (--batch-policy constant)")


def shared_members(window: Window | None, sync_members: list[str]) -> int:
    """Groups that trained the window and took part in its sync: whose shares it commits."""
    return len(window.members & set(sync_members)) if window is not None else 0


@dataclass(frozen=True)
class SyncOutcome:
    """What one sync did (a join is a sync too: the one that gave the group its window)."""

    step: int
    """inner steps committed after it"""
    outer_step: int
    """torchft's step after it: syncs committed"""
    committed: bool
    joined: bool
    fragment: int
    seconds: float
    bytes: int
    """this rank's pseudo-gradient sent into the all-reduce"""
    drift: float | None
    """norm of this group's pseudo-gradient: how far it moved from the last synced parameters"""
    window: Window | None
    """the window the sync opened"""
    healed: bool
    members_at_sync: int
    error: str | None
    skipped: bool = False
    """the window's samples were found abnormal (a ``data`` verdict): they count as trained by
    nobody and the synced point moved past them"""
    incidents: list[Incident] = field(default_factory=list)
    """the pseudo-gradient check's verdicts at this sync (``trainer/pseudo_gradient_check.py``)"""
    checked_step: int = 0
    """the step the judged window started from"""

    def mine(self, group: int) -> Incident | None:
        return next((i for i in self.incidents if i.group == group), None)


class OuterSGD(torch.optim.SGD):
    """torch's SGD as DiLoCo's outer optimizer, taking no step on a pseudo-gradient of zeros: a
    sync where every group joined without training (all of them back from a checkpoint), where
    SGD's momentum alone would move the parameters away from the checkpoint's. ``in_group``
    (set once the group's process group exists) makes the group's ranks agree."""

    in_group: Callable[[bool], bool] | None = None

    def step(self, closure: Any = None) -> Any:
        if self.in_group is not None:
            moved = any(p.grad is not None and bool(local(p.grad).any()) for g in self.param_groups for p in g["params"])
            if not self.in_group(moved):
                return None
        return super().step(closure)


class SemiSync:
    """torchft's DiLoCo over this group's model, and the window and synced point around it.

    Built before the checkpoint is loaded (the outer optimizer's state is in it), attached to the
    Manager once that exists (:meth:`attach`)."""

    def __init__(self, settings: SyncSettings, model: torch.nn.Module, inner: Any, schedulers: Any,
                 position: TrainingPosition, live: LiveState, policy: BatchPolicy, group: int,
                 check_factor: float | None):
        """``check_factor``: the pseudo-gradient check's factor (``--sdc-factor``); None: off."""
        self.settings = settings
        self.group = group
        self.check = PseudoGradientCheck(group, check_factor) if check_factor is not None else None
        self.decision = Decision()
        self.model = model
        self.inner = inner
        self.schedulers = schedulers
        self.position = position
        self.live = live
        self.policy = policy
        self.fragments = fragment_model(model, settings.fragments)
        rate, momentum = (1.0, 0.0) if settings.mode == "localsgd" else (settings.outer_lr, settings.outer_momentum)
        self.outer = [OuterSGD([p for p in f.parameters() if p.requires_grad], lr=rate, momentum=momentum,
                               nesterov=momentum > 0) for f in self.fragments]
        materialize_optimizer_state(self.outer)  # a heal or a checkpoint load copies into it
        self.names = {p: name for name, p in model.named_parameters()}
        self.step = 0
        self.synced = self._point()
        self.window: Window | None = None
        self.local = 0  # inner steps since the last sync
        self.diloco: Any = None
        self.manager: Any = None
        self._sync_start: float | None = None
        self._drift: float | None = None
        self._outer_before = 0
        self._applied_before = 0.0

    # --- building
    def attach(self, manager: Any, internals: Any, beacon: Any,
               group_norm: Callable[[list[torch.Tensor]], float],
               tamper: Callable[[torch.Tensor], bool] = lambda tensor: False) -> None:
        """Wrap the inner optimizer in torchft's DiLoCo (its hooks sync every H inner steps).
        ``internals``: the Manager's :class:`trainer.fault_tolerance.ManagerInternals`;
        ``tamper``: a drill's corruption, given each parameter shard before a sync until it
        took one (where a bad chip's would land in the pseudo-gradient)."""
        from torchft.local_sgd import DiLoCo

        self.manager, self.internals, self.beacon, self.group_norm = manager, internals, beacon, group_norm
        self.tamper = tamper
        for outer in self.outer:
            outer.in_group = lambda moved: group_norm([torch.tensor([float(moved)])]) > 0
        self.inner.register_step_post_hook(self._after_inner_step)  # runs before DiLoCo's own post hook
        self.diloco = DiLoCo(manager, self.fragments, self.inner, self.outer, sync_every=self.settings.sync_every)
        self.diloco.__enter__()
        manager.register_state_dict_fn("semi_sync", self._load_state, self._state)
        manager.commit_veto = self._veto

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)

    # --- the state a heal copies and a checkpoint keeps
    def _point(self) -> dict[str, Any]:
        return {"step": self.step, "position": self.position.state_dict(), "lr_scheduler": self.schedulers.state_dict()}

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "synced": self.synced, "suspects": self.check.state() if self.check else []}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.synced = state["synced"]
        if self.check is not None:
            self.check.load_state(state.get("suspects", []))  # none from a peer of an earlier version

    def checkpoint_state(self) -> dict[str, Any]:
        """Saved at a committed sync, where the live state is the synced point: the outer
        optimizer's state by parameter name, the step count, and as the model the last synced
        parameters (a streaming fragment not synced at this sync has moved on locally)."""
        state: dict[str, Any] = {SEMI_SYNC_KEY: {"step": self.step}, "outer_optimizer": {
            self.names[p]: {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
            for opt in self.outer for p in opt.state}}
        if self.diloco is not None:
            synced = self.diloco_globals
            state["model"] = {name: _as_dtensor(synced[name], p) for name, p in self.model.named_parameters()}
        return state

    def restore_checkpoint(self, state: dict[str, Any]) -> None:
        self.step = int(state[SEMI_SYNC_KEY]["step"])
        self.synced = self._point()

    @property
    def diloco_globals(self) -> dict[str, torch.Tensor]:
        """The last synced parameters (local shards), by name: torchft's backup of each fragment."""
        return {name: t for fragment in self.diloco._fragments for name, t in fragment.original_parameters.items()}

    def fingerprint(self) -> str:
        """A digest of the last synced parameters and the outer optimizer's state: after a
        committed sync the same in every group (their inner optimizers' states differ)."""
        outer = [t for opt in self.outer for p in opt.state for t in opt.state[p].values() if torch.is_tensor(t)]
        return digest([*self.diloco_globals.values(), *map(local, outer)])

    # --- the loop's side
    @property
    def synced_now(self) -> bool:
        """The last inner step ended with a sync (:meth:`settle` it)."""
        return self.local == self.settings.every

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Inner optimizer post-hook, before DiLoCo's (which may sync, and serve a heal from this
        state): the step is taken, so the step count, data position and schedule move on; before
        a sync, its timing starts."""
        self.schedulers.step()
        self.position.data_step += 1
        self.step += 1
        self.local += 1
        if self.synced_now:  # the window's last step: a drill's corruption lands, the drift is measured
            with torch.no_grad():
                any(self.tamper(local(p)) for p in self.model.parameters())
            synced = self.diloco_globals
            self._drift = self.group_norm([synced[name].to(local(p).device) - local(p).detach()
                                           for name, p in self.model.named_parameters() if name in synced])
            self._start_sync()

    def _start_sync(self) -> None:
        """Before a sync: note where it starts from and start timing it."""
        self._outer_before, self._applied_before = self.manager.current_step(), self.live.last_applied_at
        self.decision = Decision()
        self.beacon.enter("allreduce")  # waiting on other groups: never this group's hang
        self._sync_start = time.perf_counter()

    def join(self) -> None:
        """Sync now, without having trained (torchft 0.2.0's DiLoCo syncs in its optimizer hooks
        when its count of inner steps reaches H/F): a group joins the others at their sync."""
        self.diloco._local_step = self.diloco._sync_every - 1
        self.diloco._step_pre_hook(self.inner, (), {})
        self._drift = None  # nothing trained: no pseudo-gradient of its own to judge or show
        self._start_sync()
        self.diloco._step_post_hook(self.inner, (), {})

    def settle(self, joined: bool) -> SyncOutcome:
        """After a sync: a committed one moves the synced point here; a failed one goes back to it
        (torchft restored the parameters). Either way the sync's quorum opens the next window."""
        seconds = time.perf_counter() - self._sync_start if self._sync_start is not None else 0.0
        self.beacon.enter("compute")
        step_before = self._outer_before
        committed = self.manager.current_step() > step_before
        error = self.manager.errored()
        window_before, checked_step = self.window, int(self.synced["step"])
        if committed:
            self.synced = self._point()
        else:
            self.step = checked_step
            self.live.restore_schedule({"lr_scheduler": self.synced["lr_scheduler"],
                                         "position": self.synced["position"]})
            if self.decision.skip_window:
                self._skip_window()
        quorum = self.internals.quorum
        self.window = Window.of(quorum) if quorum is not None else None
        if self.window is not None and self.check is not None and (traded := self.check.traded()) is not None:
            self.window = replace(self.window, slot=traded[0], shares_of=traded[1])
        self.local = 0
        fragment = step_before % len(self.fragments)
        return SyncOutcome(
            step=self.step, outer_step=self.manager.current_step(), committed=committed, joined=joined,
            fragment=fragment, seconds=seconds, bytes=sum(local(p).nbytes for p in self.fragments[fragment].parameters()),
            drift=self._drift, window=self.window,
            healed=self.live.last_applied_at != self._applied_before,
            members_at_sync=shared_members(window_before, self.internals.quorum_members),
            error=repr(error.original_exception) if error is not None else None,
            skipped=self.decision.skip_window, incidents=self.decision.incidents, checked_step=checked_step)

    def _skip_window(self) -> None:
        """Past the window from the synced point, with nothing trained: the step count, the data
        position and the schedule move on as its steps would have moved them."""
        for _ in range(self.settings.every):
            self.schedulers.step()
        self.step += self.settings.every
        self.position.data_step += self.settings.every
        self.synced = self._point()

    def _veto(self) -> Exception | None:
        """Called in every group's ``should_commit`` of a sync, after its all-reduce: the
        pseudo-gradients' norms are exchanged first, in every group alike (a collective), and
        judged; the window's own veto comes before the check's."""
        if self.check is not None:
            self.decision = self.check.decide(self._exchange_drifts())
        why = window_veto(self.policy, self.window, self.internals.quorum_members)
        if why:
            return WindowIncomplete(why)
        if self.decision.refused:
            return PseudoGradientAbnormal(self.decision.refused)
        return None

    def _exchange_drifts(self) -> list[float] | None:
        """A SUM all-reduce over the sync's participants of what :meth:`PseudoGradientCheck.sent`
        puts in each one's slot (a group that joined sends zeros, as torchft sends for a healing
        one); None when it failed."""
        slots = self.manager.num_participants()
        slot = self.manager.participating_rank() if self.manager.is_participating() else None
        quorum = self.internals.quorum
        sent = self.check.sent(slots, slot, self._drift, quorum.replica_rank if quorum is not None else None)
        tensor = torch.tensor(sent, dtype=torch.float64, device=next(self.model.parameters()).device)
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return None if self.manager.errored() else tensor.tolist()


def fragment_model(model: torch.nn.Module, fragments: int) -> list[torch.nn.Module]:
    """The model cut into ``fragments`` for streaming DiLoCo, as torchtitan's torchft experiment
    cuts it (embeddings, the layers in even runs, norm and output)."""
    if fragments == 1:
        return [model]
    from torchtitan.experiments.torchft.config import FaultTolerance
    from torchtitan.experiments.torchft.diloco.utils import fragment_llm

    return fragment_llm(model, FaultTolerance(num_fragments=fragments), len(model.layers))


def _as_dtensor(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``shard`` (a local shard) as a DTensor placed as ``like``, sharing its storage."""
    if not isinstance(like, DTensor):
        return shard
    return DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())

