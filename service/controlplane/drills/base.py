"""What every drill kind is: a request, a report, its preconditions against the board, its run.

A drill kind is one module of this package holding one :class:`Drill` subclass; defining the
subclass registers it (``__init_subclass__``), and the package imports every module in it. The
router, the runner, ``ftctl drill``'s options, the terminal table, the metrics' label values and
the page all read the registry (``service.controlplane.drills.DRILLS``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.events import Event, not_a_bool
from service.controlplane.bus import StoredEvent
from service.controlplane.drills.context import DrillContext, DrillServices
from service.controlplane.drills.rows import Row
from service.controlplane.drills.timeline import FaultTimeline
from service.controlplane.errors import DrillConflict

MAX_ID = 1_000_000
"""No group or rank number beyond this exists (a job has at most thousands of groups)."""


class DrillBody(BaseModel):
    """Every drill's request: no unknown field, no number that is not finite, no boolean taken for
    a number (``true`` is not group 1). ``kind`` names the
    drill; ``timeout_s`` (where a kind has it) bounds each phase."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and field.annotation is not bool:
                    not_a_bool(value)
        return data

    @property
    def groups(self) -> list[int]:
        """The groups the request names (each must exist): its ``group``, if it has one."""
        group = getattr(self, "group", None)
        return [] if group is None else [group]


TimeoutField = Field(None, gt=0, le=3600, description="seconds per phase (default: the control plane's)")
GroupField = Field(ge=0, le=MAX_ID, description="the group to fault")


@dataclass(frozen=True)
class FaultClass:
    """A fault class of the detection matrix this drill measures, and its report's key for
    "trains again" (the detection time is every report's ``detect_s``)."""

    name: str
    resume_key: str


@dataclass(frozen=True)
class Prepared:
    """What a drill's preconditions gave: the group it holds (if one) and its first report."""

    group: int | None
    report: BaseModel


class Drill(ABC):
    """One drill kind. Subclasses set ``kind``, ``Request``, ``Report`` (and ``fault_class`` if
    they measure one of the detection matrix's classes), check their preconditions in
    :meth:`prepare` (one-line :class:`DrillConflict` s), and run in :meth:`run`; the runner
    persists the report as it goes and ends the drill ``failed`` on a timeout or a domain error."""

    kind: ClassVar[str]
    Request: ClassVar[type[DrillBody]]
    Report: ClassVar[type[BaseModel]]
    fault_class: ClassVar[FaultClass | None] = None
    summary: ClassVar[str]
    registry: ClassVar[dict[str, type["Drill"]]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            if cls.kind in Drill.registry:
                raise TypeError(f"two drills named {cls.kind!r}: {Drill.registry[cls.kind].__name__}, {cls.__name__}")
            Drill.registry[cls.kind] = cls

    def __init__(self, ctx: DrillContext, request: DrillBody, report: BaseModel):
        self.ctx = ctx
        self.request = request
        self.r = report
        self.timeout_s = getattr(request, "timeout_s", None) or ctx.settings.drill_timeout_s

    @classmethod
    def title(cls, drill: dict) -> str:
        """The report table's title, after ``drill N ·`` and before its status."""
        return drill["kind"]

    @classmethod
    @abstractmethod
    def rows(cls, report: dict) -> list[Row]:
        """The report as ``what | value`` rows for the terminal (``ftctl drill``)."""

    @classmethod
    def problem(cls, report: dict) -> str | None:
        """What a drill that ran to its end still shows wrong (``ftctl drill`` exits 1 with it):
        by default, groups that hold different state afterwards (or were never compared)."""
        if "fingerprints_equal" in report and not report["fingerprints_equal"]:
            return "groups hold different state afterwards"
        return None

    @classmethod
    @abstractmethod
    def prepare(cls, request: DrillBody, services: DrillServices) -> Prepared:
        """Check the request against the board now; the group held and the report to fill."""

    @abstractmethod
    async def run(self) -> None:
        """Make the fault and measure it, setting ``self.r.phase`` as it goes."""

    def observe(self, e: Event) -> None:
        """Fold one event of the job into what the drill measures (default: nothing)."""

    def fill(self) -> None:
        """Copy what the drill's observers know into the report (default: it writes it directly)."""

    async def until(self, queue: asyncio.Queue[StoredEvent], reached: Callable[[], bool], what: str,
                    timeout_s: float | None = None) -> None:
        """Observe events until ``reached()``; a :class:`TimeoutError` naming ``what`` if it is not
        within the phase's timeout. The report is filled and saved either way it returns."""
        if not reached():
            await self.ctx.bus.wait_for(queue, lambda e: (self.observe(e), reached())[1],
                                        timeout_s or self.timeout_s, what)
        self.fill()
        self.ctx.save()

    @asynccontextmanager
    async def observing(self) -> AsyncIterator[None]:
        """Every event of the job goes to :meth:`observe` in the background while the block runs."""
        queue = self.ctx.bus.subscribe()

        async def consume() -> None:
            while True:
                self.observe((await queue.get()).event)

        consumer = asyncio.create_task(consume())
        try:
            yield
        finally:
            consumer.cancel()
            self.ctx.bus.unsubscribe(queue)

    async def watch(self, queue: asyncio.Queue[StoredEvent], phase: str, seconds: float) -> None:
        """Phase ``phase``: observe every event for ``seconds``."""
        self.r.phase = phase
        self.ctx.save()
        try:
            await self.ctx.bus.wait_for(queue, lambda e: (self.observe(e), False)[1], seconds, phase)
        except TimeoutError:
            pass


def require_rank(services: DrillServices, group: int, rank: int | None) -> None:
    ranks = services.settings.ranks_per_group
    if rank is not None and rank >= ranks:
        raise DrillConflict(f"group {group} has ranks 0..{ranks - 1}, not {rank}")


def require_training_with_another(services: DrillServices, group: int, what: str) -> None:
    """``group`` and at least one other group must be training: ``what`` compares them."""
    services.control.board.require_up(group)
    training = services.control.board.training()
    if group not in training or len(training) < 2:
        raise DrillConflict(f"{what} needs group {group} and another group training; training now: "
                            f"{', '.join(map(str, training)) or 'none'}")


def require_survivors(services: DrillServices, group: int) -> frozenset[int]:
    """The groups that keep training through a fault of ``group``: at least one."""
    survivors = FaultTimeline.survivors_of(group, services.control.board.views)
    if not survivors:
        raise DrillConflict(f"no other group is training: a fault of group {group} would stop the job, not drill it")
    return survivors
