"""A live peer serving a heal, in its own process, for tests/unit/test_heal_transport.py.

    python tests/heal_source.py STEP MIB

Serves :func:`state` (the same in every process: a seeded ``MIB`` MiB of fp32) as step
``STEP`` on loopback, prints its heal address, and serves until it is killed.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch


def state(mib: int) -> dict:
    generator = torch.Generator().manual_seed(7)
    return {"user": {"model": {f"w{i}": torch.randn(2**18, generator=generator) for i in range(mib)}},
            "torchft": {"step": 1}}


if __name__ == "__main__":
    from trainer.heal_transport import StreamTransport

    step, mib = int(sys.argv[1]), int(sys.argv[2])
    transport = StreamTransport(timedelta(seconds=30), "127.0.0.1")
    transport.send_checkpoint([1], step, state(mib), timedelta(seconds=30))
    print(transport.metadata(), flush=True)
    while True:
        time.sleep(60)
