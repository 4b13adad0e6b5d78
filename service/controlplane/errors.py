"""The control plane's domain errors, and the one place that maps them to HTTP.

They are raised where the decision is made (the agent client, group control, the drills,
the goodput projection) and say in one line what is wrong and what to do. A router never
picks a status code for them: :func:`install` answers each with its ``status`` and
``{"detail": message}``.
"""

from __future__ import annotations

from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class DomainError(Exception):
    status: ClassVar[int] = 400


class UnknownGroup(DomainError):
    status = 404


class UnknownDrill(DomainError):
    status = 404


class GroupStateConflict(DomainError):
    """The command does not fit the group's state: kill of a down group, rejoin of a running one."""

    status = 409


class DrillConflict(DomainError):
    """A drill runs and holds the groups, or the job is not in a state a new drill can start from."""

    status = 409


class DrillFailed(DomainError):
    """A running drill cannot go on: a phase timed out, or the job left the state it needs."""

    status = 409


class AgentConflict(DomainError):
    """The agent refused the command: the group's processes are not in the state it needs."""

    status = 409


class UnprovenAgent(DomainError):
    """A registration's address did not prove it holds the group's token (it did not answer the
    challenge, or answered for another address or token): the group keeps its agent."""

    status = 403


class NothingMeasured(DomainError):
    """No drill has measured what a projection needs yet."""

    status = 409


class TooManyGroups(DomainError):
    """A group number at or past ``--max-groups``: the bound on what the control plane keeps per group."""

    status = 409


class InvalidQuery(DomainError):
    status = 422


class NoAgent(DomainError):
    """No agent is registered for the group."""

    status = 503


class StorageUnavailable(DomainError):
    """SQLite refused a write (a full or failing disk): nothing of the request was stored."""

    status = 503


class Overloaded(DomainError):
    """More events wait to be stored than the control plane holds: the sender keeps them and tries later."""

    status = 503


class AgentUnreachable(DomainError):
    """The agent did not answer, or answered with an error of its own."""

    status = 502


def install(app: FastAPI) -> None:
    async def answer(request: Request, err: DomainError) -> JSONResponse:
        return JSONResponse(status_code=err.status, content={"detail": str(err)})

    app.add_exception_handler(DomainError, answer)
