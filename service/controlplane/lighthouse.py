"""The control plane's client for the Lighthouse wrapper (``protocol/lighthouse.py`` on both sides)."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from protocol.lighthouse import HEALTH_PATH, STATUS_PATH, LighthouseStatus


class LighthouseUnreachable(Exception):
    """The wrapper did not answer, or not with a status: said in one line with its address."""


class LighthouseClient:
    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.client = httpx.AsyncClient(base_url=url, timeout=timeout_s)

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

    async def aclose(self) -> None:
        await self.client.aclose()
