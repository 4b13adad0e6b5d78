"""The control plane's client for the Lighthouse wrapper (``protocol/lighthouse.py`` on both sides)."""

from __future__ import annotations

import asyncio
import time

import httpx
from pydantic import ValidationError

from protocol.lighthouse import HEALTH_PATH, KILL_PATH, STATUS_PATH, LighthouseKill, LighthouseKilled, LighthouseStatus


class LighthouseUnreachable(Exception):
    """The wrapper did not answer, or not with a status: said in one line with its address."""


class LighthouseClient:
    def __init__(self, url: str, timeout_s: float, token: str):
        self.url = url
        self.client = httpx.AsyncClient(base_url=url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self._shared: asyncio.Future[LighthouseStatus] | None = None
        self._shared_at = 0.0

    async def recent_status(self, max_age_s: float) -> LighthouseStatus:
        """A status asked for at most ``max_age_s`` ago, one fetch shared by every caller meanwhile
        (a failure too: LighthouseUnreachable). For views that many clients poll: at hundreds of
        groups each status costs the Lighthouse a page of every member, from the same lock its
        quorums take, and one a viewer a second would add up. Measurements call :meth:`status`."""
        now = time.monotonic()
        if self._shared is None or (self._shared.done() and now - self._shared_at >= max_age_s):
            self._shared, self._shared_at = asyncio.ensure_future(self.status()), now
            self._shared.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if all hung up
        return await asyncio.shield(self._shared)  # a caller that hangs up does not cancel the others' fetch

    async def status(self) -> LighthouseStatus:
        try:
            response = (await self.client.get(STATUS_PATH)).raise_for_status()
            return LighthouseStatus.model_validate(response.json())
        except (httpx.HTTPError, ValueError, ValidationError) as err:
            raise LighthouseUnreachable(f"{self.url}: {err}") from None

    async def check_health(self) -> None:
        """Returns when the wrapper says its Lighthouse is healthy; raises LighthouseUnreachable otherwise."""
        try:
            (await self.client.get(HEALTH_PATH)).raise_for_status()
        except httpx.HTTPError as err:
            raise LighthouseUnreachable(f"{self.url}: {err}") from None

    async def kill(self, down_s: float) -> LighthouseKilled:
        """SIGKILL the Lighthouse through its wrapper (the Lighthouse drill's fault); the wrapper
        restarts it ``down_s`` later. LighthouseUnreachable carries the wrapper's reason."""
        try:
            response = await self.client.post(KILL_PATH, json=LighthouseKill(down_s=down_s).model_dump())
        except httpx.HTTPError as err:
            raise LighthouseUnreachable(f"{self.url}: {err}") from None
        if response.is_error:
            raise LighthouseUnreachable(f"{self.url} refused the kill: {_detail(response)}")
        return LighthouseKilled.model_validate(response.json())

    async def aclose(self) -> None:
        await self.client.aclose()


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
