"""How a child's life is tied to its parent's, for the launcher, the zygote and a group's leader.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, not the process: use it
only in children forked by a thread that lives as long as its process (a main thread, or a
single-threaded process).
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child: receive ``sig`` when the parent dies, however it dies (Linux; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, sig)
