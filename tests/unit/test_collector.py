"""The control plane's garbage-collector policy (service/controlplane/collector.py), on the real
CPython collector: survivors of a full pass are frozen, young cycles are still collected, and a
thaw hands the frozen ones back so cycles that died among them are reclaimed."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from service.controlplane.collector import frozen_survivors, thaw_forever


class Node:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_survivors_of_a_full_pass_are_frozen_young_cycles_are_collected_and_a_thaw_reclaims_the_rest():
    with frozen_survivors():
        old = Node()
        gc.collect()
        assert gc.get_freeze_count() > 0, "a full pass froze nothing"
        old_ref = weakref.ref(old)
        del old
        young = Node()
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None, "a cycle younger than the last full pass was not collected"
        assert old_ref() is not None, "a frozen cycle was walked by a later pass"

        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(thaw_forever(0.01), 0.2))
        gc.collect()
        assert old_ref() is None, "after a thaw the next full pass did not reclaim a cycle that died frozen"
        assert gc.get_freeze_count() > 0, "the pass after a thaw did not freeze its survivors again"
    assert gc.get_freeze_count() == 0, "leaving left objects frozen"
    gc.collect()
    assert gc.get_freeze_count() == 0, "a full pass outside still freezes"
