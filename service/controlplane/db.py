"""SQLite history of the control plane: events, group transitions, drill reports.

One file, WAL mode, schema versioned with ``PRAGMA user_version``: a file written by an
older version is migrated forward on open; a newer one is refused with a clear error.

Every write runs in a transaction: alone, or inside :meth:`Store.transaction` with others, so a
batch of events, its accounting and the transitions it causes are stored together or not at all;
a failure rolls back and leaves the connection ready for the next one.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from protocol.events import EVENT_ADAPTER, Event

MIGRATIONS: list[str] = [
    """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        ts REAL NOT NULL,
        received REAL NOT NULL,
        grp INTEGER NOT NULL,
        rank INTEGER,
        type TEXT NOT NULL,
        step INTEGER,
        body TEXT NOT NULL
    );
    CREATE INDEX events_by_group_type ON events (grp, type, id);
    CREATE INDEX events_by_type ON events (type, id);
    CREATE TABLE transitions (
        id INTEGER PRIMARY KEY,
        grp INTEGER NOT NULL,
        state TEXT NOT NULL,
        reason TEXT,
        ts REAL NOT NULL
    );
    CREATE INDEX transitions_by_group ON transitions (grp, id);
    CREATE TABLE drills (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        grp INTEGER,
        status TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        report TEXT NOT NULL,
        error TEXT
    );
    CREATE TABLE ingest_stats (
        grp INTEGER PRIMARY KEY,
        agent_dropped INTEGER NOT NULL DEFAULT 0,
        rejected INTEGER NOT NULL DEFAULT 0
    );
    """,
    """
    ALTER TABLE events ADD COLUMN eid TEXT;
    CREATE UNIQUE INDEX events_by_eid ON events (eid) WHERE eid IS NOT NULL;
    ALTER TABLE ingest_stats ADD COLUMN duplicates INTEGER NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE agents (
        grp INTEGER PRIMARY KEY,
        url TEXT NOT NULL,
        ranks_per_group INTEGER,
        registered REAL NOT NULL,
        renewed REAL NOT NULL
    );
    """,
    """
    CREATE TABLE steps (
        step INTEGER PRIMARY KEY,
        quorum_id INTEGER NOT NULL,
        ts REAL NOT NULL,
        data_step INTEGER NOT NULL,
        global_batch INTEGER NOT NULL,
        step_samples INTEGER NOT NULL,
        consumed INTEGER NOT NULL
    );
    CREATE INDEX steps_by_data_step ON steps (data_step, step);
    CREATE TABLE coverage (
        data_step INTEGER PRIMARY KEY,
        planned INTEGER NOT NULL,
        once INTEGER NOT NULL,
        twice INTEGER NOT NULL,
        skipped INTEGER NOT NULL
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


class SchemaTooNew(RuntimeError):
    pass


class Store:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._depth = 0
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._migrate()

    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"{self.path} has schema version {version}, newer than this control plane's "
                               f"{SCHEMA_VERSION}; upgrade ftctl or use another --db")
        for number in range(version, SCHEMA_VERSION):
            self._conn.executescript(f"BEGIN; {MIGRATIONS[number]}; PRAGMA user_version = {number + 1}; COMMIT;")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """What is written inside is committed together, or rolled back together when anything
        raises; a transaction opened inside another joins it. Other threads wait meanwhile."""
        with self._lock:
            outer = self._depth == 0
            if outer:
                self._conn.execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
                    self._conn.execute("ROLLBACK")
                raise
            self._depth -= 1
            if outer:
                self._conn.execute("COMMIT")

    def _write(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self.transaction():
            return self._conn.execute(sql, tuple(args))

    # --- data coverage (service/controlplane/coverage.py)
    STEP_COLUMNS = "step, quorum_id, ts, data_step, global_batch, step_samples, consumed"

    def step_records(self, since_step: int | None = None, data_step: int | None = None) -> list[dict]:
        """Committed steps' records, in step order: from ``since_step`` on, or of one ``data_step``."""
        where, args = ("data_step = ?", [data_step]) if data_step is not None else ("step >= ?", [since_step or 0])
        return [dict(row) | {"consumed": bool(row["consumed"])}
                for row in self._rows(f"SELECT {self.STEP_COLUMNS} FROM steps WHERE {where} ORDER BY step", args)]

    def steps_since(self, ts: float) -> list[tuple[float, int]]:
        """(time, samples trained) of every committed step recorded from ``ts`` on, in step order."""
        return [(row["ts"], row["step_samples"]) for row in
                self._rows("SELECT ts, step_samples FROM steps WHERE ts >= ? ORDER BY step", [ts])]

    def replace_step_records(self, gone: list[int], record: Any) -> None:
        """Delete the records of the steps ``gone`` and store ``record`` (a coverage StepRecord)."""
        with self.transaction():
            self._conn.executemany("DELETE FROM steps WHERE step = ?", [(step,) for step in gone])
            self._conn.execute(f"INSERT OR REPLACE INTO steps ({self.STEP_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (record.step, record.quorum_id, record.ts, record.data_step, record.global_batch,
                                record.step_samples, int(record.consumed)))

    def set_coverage(self, data_step: int, planned: int, once: int, twice: int, skipped: int) -> None:
        self._write("INSERT OR REPLACE INTO coverage (data_step, planned, once, twice, skipped) VALUES (?, ?, ?, ?, ?)",
                    (data_step, planned, once, twice, skipped))

    def coverage_totals(self) -> dict[str, int]:
        row = self._rows("SELECT COALESCE(SUM(planned), 0) AS planned, COALESCE(SUM(once), 0) AS once, "
                         "COALESCE(SUM(twice), 0) AS twice, COALESCE(SUM(skipped), 0) AS skipped FROM coverage")[0]
        return dict(row)

    # --- events
    def add_events(self, events: list[Event]) -> list[int | None]:
        """Each event's row id; None for an event whose ``eid`` is stored already (a retry)."""
        now = time.time()
        ids: list[int | None] = []
        with self.transaction():
            for e in events:
                cur = self._conn.execute(
                    "INSERT INTO events (ts, received, grp, rank, type, step, body, eid) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (eid) WHERE eid IS NOT NULL DO NOTHING",
                    (e.ts, now, e.group, getattr(e, "rank", None), e.type, getattr(e, "step", None),
                     e.model_dump_json(), e.eid),
                )
                ids.append(cur.lastrowid if cur.rowcount else None)
        return ids

    def events(self, group: int | None = None, types: list[str] | None = None, since: float | None = None,
               after_id: int = 0, limit: int = 100, rank: int | None = None) -> list[dict]:
        where, args = ["id > ?"], [after_id]
        if group is not None:
            where.append("grp = ?"); args.append(group)
        if types:
            where.append(f"type IN ({','.join('?' * len(types))})"); args.extend(types)
        if since is not None:
            where.append("ts >= ?"); args.append(since)
        if rank is not None:
            where.append("rank = ?"); args.append(rank)
        rows = self._rows(f"SELECT id, body FROM events WHERE {' AND '.join(where)} ORDER BY id LIMIT ?",
                          [*args, limit])
        return [{"id": r["id"], **json.loads(r["body"])} for r in rows]

    def prune_events(self, older_than: float, keep_rows: int) -> int:
        """Delete events stamped before ``older_than`` and all but the newest ``keep_rows``; returns
        how many went. Transitions and drill reports stay: they are small and the board's history."""
        with self.transaction():
            gone = self._conn.execute("DELETE FROM events WHERE ts < ?", (older_than,)).rowcount
            gone += self._conn.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?",
                                       (keep_rows,)).rowcount
        return gone

    def newest_events(self, type_: str, limit: int) -> list[Event]:
        """The newest ``limit`` events of a type, oldest first."""
        rows = self._rows("SELECT body FROM events WHERE type = ? ORDER BY id DESC LIMIT ?", [type_, limit])
        return [EVENT_ADAPTER.validate_json(r["body"]) for r in reversed(rows)]

    def newest_start(self) -> Event | None:
        """The newest start event of any group's rank 0: the job as it runs now."""
        rows = self._rows("SELECT body FROM events WHERE type = 'start' AND rank = 0 ORDER BY id DESC LIMIT 1")
        return EVENT_ADAPTER.validate_json(rows[0]["body"]) if rows else None

    def count_by(self, type_: str, field: str) -> dict[str, int]:
        """How many events of a type have each value of a top-level field."""
        rows = self._rows("SELECT json_extract(body, ?) AS v, COUNT(*) AS n FROM events WHERE type = ? GROUP BY v",
                          [f"$.{field}", type_])
        return {r["v"]: r["n"] for r in rows}

    def latest_event(self, group: int, type_: str, rank: int | None = 0, where_json: str | None = None) -> Event | None:
        sql = "SELECT body FROM events WHERE grp = ? AND type = ?"
        args: list[Any] = [group, type_]
        if rank is not None:
            sql += " AND rank = ?"; args.append(rank)
        if where_json:
            sql += f" AND {where_json}"
        rows = self._rows(sql + " ORDER BY id DESC LIMIT 1", args)
        return EVENT_ADAPTER.validate_json(rows[0]["body"]) if rows else None

    def count_events(self, group: int, type_: str, where_json: str = "1") -> int:
        return self._rows(f"SELECT COUNT(*) FROM events WHERE grp = ? AND type = ? AND {where_json}",
                          [group, type_])[0][0]

    # --- transitions
    def add_transition(self, group: int, state: str, reason: str | None, ts: float) -> None:
        self._write("INSERT INTO transitions (grp, state, reason, ts) VALUES (?, ?, ?, ?)", (group, state, reason, ts))

    def transitions(self, group: int) -> list[dict]:
        return [dict(r) for r in self._rows(
            "SELECT state, reason, ts FROM transitions WHERE grp = ? ORDER BY id", [group])]

    # --- ingest accounting
    def record_ingest(self, group: int, agent_dropped: int, rejected: int, duplicates: int) -> None:
        self._write("INSERT INTO ingest_stats (grp, agent_dropped, rejected, duplicates) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(grp) DO UPDATE SET agent_dropped = excluded.agent_dropped, "
                    "rejected = rejected + excluded.rejected, duplicates = duplicates + excluded.duplicates",
                    (group, agent_dropped, rejected, duplicates))

    def ingest_stats(self) -> dict[int, dict]:
        return {r["grp"]: {"agent_dropped": r["agent_dropped"], "rejected": r["rejected"],
                           "duplicates": r["duplicates"]}
                for r in self._rows("SELECT * FROM ingest_stats")}

    # --- agents
    def register_agent(self, group: int, url: str, ranks_per_group: int | None, now: float) -> dict:
        """Record (or renew) the group's agent address; returns its row."""
        self._write("INSERT INTO agents (grp, url, ranks_per_group, registered, renewed) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(grp) DO UPDATE SET url = excluded.url, ranks_per_group = excluded.ranks_per_group, "
                    "renewed = excluded.renewed", (group, url, ranks_per_group, now, now))
        return dict(self._rows("SELECT * FROM agents WHERE grp = ?", [group])[0])

    def agents(self) -> list[dict]:
        return [dict(r) for r in self._rows("SELECT * FROM agents ORDER BY grp")]

    # --- drills
    def create_drill(self, kind: str, group: int | None, report: dict) -> int:
        now = time.time()
        return self._write("INSERT INTO drills (kind, grp, status, created, updated, report) "
                           "VALUES (?, ?, 'running', ?, ?, ?)", (kind, group, now, now, json.dumps(report))).lastrowid

    def update_drill(self, drill_id: int, status: str, report: dict, error: str | None = None) -> None:
        self._write("UPDATE drills SET status = ?, report = ?, error = ?, updated = ? WHERE id = ?",
                    (status, json.dumps(report), error, time.time(), drill_id))

    def drill(self, drill_id: int) -> dict | None:
        rows = self._rows("SELECT * FROM drills WHERE id = ?", [drill_id])
        return _drill_row(rows[0]) if rows else None

    def drills(self, limit: int = 100, kind: str | None = None, status: str | None = None) -> list[dict]:
        """The newest drills first, of one kind and status if given."""
        where, args = ["1"], []
        if kind is not None:
            where.append("kind = ?"); args.append(kind)
        if status is not None:
            where.append("status = ?"); args.append(status)
        return [_drill_row(r) for r in self._rows(
            f"SELECT * FROM drills WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?", [*args, limit])]

    def drill_counts(self) -> dict[tuple[str, str], int]:
        """How many drills there are of each (kind, status)."""
        return {(r["kind"], r["status"]): r["n"]
                for r in self._rows("SELECT kind, status, COUNT(*) AS n FROM drills GROUP BY kind, status")}

    def fail_running_drills(self, error: str) -> int:
        return self._write("UPDATE drills SET status = 'failed', error = ?, updated = ? WHERE status = 'running'",
                           (error, time.time())).rowcount


def _drill_row(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "kind": row["kind"], "group": row["grp"], "status": row["status"],
            "created": row["created"], "updated": row["updated"], "error": row["error"],
            "report": json.loads(row["report"])}
