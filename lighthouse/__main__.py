"""``python -m lighthouse``: torchft's Lighthouse, kept alive, with a JSON API beside it."""

from __future__ import annotations

import logging
import sys

import uvicorn

from lighthouse.app import create_app
from lighthouse.config import LighthouseSettings
from lighthouse.supervisor import LighthouseSupervisor
from protocol.settings import parse_settings


def main() -> int:
    settings = parse_settings(LighthouseSettings, "lighthouse", sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lighthouse %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(settings, LighthouseSupervisor(settings))
    uvicorn.run(app, host=settings.api_host, port=settings.api_port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
