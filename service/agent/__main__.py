"""``python -m service.agent``: one replica group's agent."""

from __future__ import annotations

import logging
import sys

import uvicorn

from protocol.settings import parse_settings
from service.agent.app import create_app
from service.agent.config import AgentSettings


def main() -> int:
    settings = parse_settings(AgentSettings, "agent", sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{settings.group}] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
