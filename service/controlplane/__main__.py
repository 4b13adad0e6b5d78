"""``python -m service.controlplane``: the control plane on uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from protocol.settings import parse_settings
from service.controlplane.app import create_app
from service.controlplane.settings import ControlPlaneSettings


def main() -> int:
    settings = parse_settings(ControlPlaneSettings, "controlplane", sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s controlplane %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                ws_max_size=settings.max_body_bytes)  # a batch on an agent's stream: as large as a POST's
    return 0


if __name__ == "__main__":
    sys.exit(main())
