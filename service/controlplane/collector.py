"""The cyclic garbage collector's full passes, kept off the request path.

At 1,000 groups the control plane holds about 340,000 objects that live as long as the job: the
metrics' children and their locks, the group views, the straggler windows, every agent's stream
and its coroutines. CPython walks all of them in each full (generation 2) pass, 100 to 180 ms on
this machine's two busy cores, and under ingest of 5,000 events a second it starts one every few
seconds: that pause, with the event loop stopped, was the p99 of ``GET /groups``.

After each full pass its survivors are frozen (``gc.freeze``): the next passes walk only what is
younger. Reference counting still frees frozen objects as usual; only a reference cycle that dies
among them waits, until the next thaw. Every ``thaw_every_s`` they are thawed, and the next full
pass walks everything once, reclaims such cycles and freezes the rest again: one long pause per
interval instead of one every few seconds, and memory bounded by what one interval leaks.
"""

from __future__ import annotations

import asyncio
import gc
from contextlib import contextmanager
from typing import Iterator


def _freeze_survivors(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


@contextmanager
def frozen_survivors() -> Iterator[None]:
    """While inside, every full pass freezes what survived it; on leaving, everything frozen is
    thawed so the collector sees it again."""
    gc.callbacks.append(_freeze_survivors)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_survivors)
        gc.unfreeze()


async def thaw_forever(every_s: float) -> None:
    """Hand the frozen objects back to the collector every ``every_s``; its next full pass
    reclaims the cycles that died among them and freezes the survivors again."""
    while True:
        await asyncio.sleep(every_s)
        gc.unfreeze()
