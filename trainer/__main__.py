"""``python -m trainer``: launches torchrun for one replica group, or, under torchrun, trains."""

import time

PROCESS_START = time.time()  # before the heavy imports: the startup split starts here

import os  # noqa: E402
import sys  # noqa: E402

from protocol.settings import fail, parse_settings  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None, process_start: float = PROCESS_START, forked: bool = False) -> int:
    """``process_start``: where the startup split starts; ``forked``: a rank forked by a zygote
    (:mod:`trainer.zygote`), whose split starts at the fork."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_settings(TrainerConfig, "trainer", argv)
    try:
        if not cfg.check and ("TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ):
            from trainer.train import run

            return run(cfg, process_start, forked)
        from trainer.launch import launch

        launch(cfg, argv)
    except ConfigError as err:
        fail("trainer", str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
