"""``python -m trainer``: launches torchrun for one replica group, or, under torchrun, trains."""

import time

PROCESS_START = time.time()  # before the heavy imports: the startup split starts here

import os  # noqa: E402
import sys  # noqa: E402

from protocol.settings import fail, parse_settings  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402


def main() -> int:
    cfg = parse_settings(TrainerConfig, "trainer", sys.argv[1:])
    try:
        if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
            from trainer.train import run

            return run(cfg, PROCESS_START)
        from trainer.launch import launch

        launch(cfg, sys.argv[1:])
    except ConfigError as err:
        fail("trainer", str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
