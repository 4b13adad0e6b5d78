"""Event retention: SQLite keeps the events of ``--event-retention-s`` and at most
``--event-retention-rows`` of them, so the file (whose freed pages are reused) and every query
over it stay bounded however long the job runs and however many groups it has."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

from service.controlplane.db import Store

log = logging.getLogger("controlplane.retention")
PRUNE_EVERY_S = 60.0


async def prune_forever(store: Store, retention_s: float, keep_rows: int, every_s: float = PRUNE_EVERY_S) -> None:
    """Delete what is past retention every ``every_s``, off the event loop."""
    while True:
        try:
            gone = await asyncio.to_thread(store.prune_events, time.time() - retention_s, keep_rows)
            if gone:
                log.info("deleted %d events past retention", gone)
        except sqlite3.Error as err:  # a full or failing disk: the next round tries again
            log.warning("could not delete old events: %s", err)
        await asyncio.sleep(every_s)
