"""``python -m service.agent``: one replica group's agent."""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from protocol.settings import parse_settings
from service.agent.app import create_app
from service.agent.config import AgentSettings


def main() -> int:
    settings = parse_settings(AgentSettings, "agent", sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{settings.group}] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        listener = socket.create_server((settings.host, settings.port),
                                        family=socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    except OSError as err:
        print(f"agent: cannot listen on {settings.host}:{settings.port}: {err}; pick another --port", file=sys.stderr)
        return 2
    settings.port = listener.getsockname()[1]  # with --port 0, the one picked: the URL it registers
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
