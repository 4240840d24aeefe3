"""The Batch API's records: files and batches in one SQLite database (`BATCH_DIR/batches.db`, WAL).

Every call runs on one thread per process (`Store`'s executor: the one connection, the one writer,
off the event loop); the Ivy workers of one host share the database through SQLite's own locking
(a local filesystem: SQLite's locks do not hold over NFS). A job is run by the worker holding its
row lease (`claim`, `renew`): a lease expires LEASE_S after its last renewal, or at once when its
owner was a process of this host that no longer exists (an Ivy killed and started again takes its
jobs back without waiting).

A job's progress is the `done` table (its finished line numbers) and the committed length of its
output and error part files: `commit` appends the finished lines' output to those files, fsyncs
them and records the lines and the new lengths in one transaction, under the write lock and only
while the caller holds the lease; bytes past a committed length (a write the crash cut short) are
cut off before the next append. So every line is in the output exactly once, whatever is killed when.

Every file and batch has an owner (`tenant`: the keyed hash of the API key that created it,
`ivy.batches.service`; "" where no key was needed). The calls the routes make take the caller's
owner and treat another owner's row as missing; the runner's take none (it works on any job).
A database made before owners existed gets the column on opening, its rows owned by "" (no key).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LEASE_S = 30.0  # a job's lease lasts this long past its last renewal (renewed every LEASE_S / 6)
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")  # states a runner still has work in
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
         "cancelled_at")
STATUS_TIME = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
               "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
               "cancelled": "cancelled_at"}

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL, tenant TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT,
    errors TEXT, model TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    out_id TEXT NOT NULL, err_id TEXT NOT NULL, out_bytes INTEGER NOT NULL DEFAULT 0,
    err_bytes INTEGER NOT NULL DEFAULT 0, output_file_id TEXT, error_file_id TEXT,
    lease_owner TEXT, lease_until REAL, tenant TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS done (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
"""
# The tables as made before owners: `_open` adds what they lack (ALTER TABLE ... ADD COLUMN keeps the rows).
MIGRATIONS = (("files", "tenant", "TEXT NOT NULL DEFAULT ''"), ("batches", "tenant", "TEXT NOT NULL DEFAULT ''"))
INDEXES = """
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, seq);
"""
SECRET = "owner.key"  # BATCH_DIR's random key of the owners' HMACs (ivy.batches.service.owners)
ANY = None  # a call's `tenant` that matches every owner: the runner's and the store's own look-ups


class LeaseLost(Exception):
    """The job's lease is another worker's now: this one must stop writing for it."""


def owner_id() -> str:
    """This process as a lease owner: host, pid and a nonce (a pid can come back after a restart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def owner_gone(owner: str) -> bool:
    """Whether a lease's owner is known dead: a process of this host that does not exist any more
    (or this very pid under another nonce: the process that held it was replaced by this one)."""
    host, _, rest = owner.partition(":")
    pid, _, _ = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True  # the caller compares owners first: same pid, other nonce
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Store:
    """The database, its calls run on one thread (`run`); paths of the files it names."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ivy-batch-db")
        self.db: sqlite3.Connection | None = None
        self.pool.submit(self._open).result()

    def _open(self) -> None:
        db = sqlite3.connect(self.root / "batches.db", timeout=30.0, isolation_level=None,
                             check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a process crash (fsync'd at checkpoints)
        db.executescript(SCHEMA)
        db.execute("BEGIN IMMEDIATE")  # one of the workers opening an old database at once adds the columns
        try:
            for table, column, decl in MIGRATIONS:
                if column not in {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.executescript(INDEXES)
        self.db = db

    def secret(self) -> bytes:
        """This directory's random key (32 bytes, `SECRET`), made on first use. Written whole under a
        temporary name and linked into place: workers starting at once all read the one that won."""
        path = self.root / SECRET
        if not path.exists():
            tmp = self.root / f"{SECRET}.{os.getpid()}.{os.urandom(4).hex()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails where another worker's is there already: that one is the key
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        key = path.read_bytes()
        if len(key) != 32:
            raise RuntimeError(f"{path} is not a 32-byte key ({len(key)} bytes): the batch directory's owner key "
                               "is damaged; its files and batches cannot be matched to API keys")
        return key

    async def run(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the database thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        def shut():
            if self.db is not None:
                self.db.close()
        self.pool.submit(shut).result()
        self.pool.shutdown()

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def part(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.part"

    # --- files -------------------------------------------------------------------------------------
    def add_file(self, file_id: str, size: int, filename: str, purpose: str, tenant: str) -> dict:
        now = int(time.time())
        self.db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, tenant) VALUES (?,?,?,?,?,?)",
                        (file_id, size, now, filename, purpose, tenant))
        return self.get_file(file_id, tenant)

    def get_file(self, file_id: str, tenant: str | None) -> dict | None:
        """The file `file_id` of owner `tenant` (any owner's: ANY); None where there is none."""
        row = self._get("files", file_id, tenant)
        return dict(row) if row else None

    def _get(self, table: str, row_id: str, tenant: str | None):
        if tenant is ANY:
            return self.db.execute(f"SELECT * FROM {table} WHERE id=?", (row_id,)).fetchone()
        return self.db.execute(f"SELECT * FROM {table} WHERE id=? AND tenant=?", (row_id, tenant)).fetchone()

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return self._page("files", tenant, "purpose=?" if purpose else "", (purpose,) if purpose else (), after,
                          limit)

    def delete_file(self, file_id: str, tenant: str) -> str | None:
        """Deletes the record of owner `tenant`'s file (the caller checked it is there and removes the
        bytes); returns the id of a batch still running on it instead, which keeps it."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute(f"SELECT id FROM batches WHERE input_file_id=? AND status IN {RUNNING}",
                                  (file_id,)).fetchone()
            if row is None:
                self.db.execute("DELETE FROM files WHERE id=? AND tenant=?", (file_id, tenant))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return row["id"] if row else None

    # --- batches -----------------------------------------------------------------------------------
    def add_batch(self, batch_id: str, endpoint: str, input_file_id: str, window: str, metadata: dict | None,
                  out_id: str, err_id: str, tenant: str) -> dict:
        now = int(time.time())
        self.db.execute(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at, "
            "expires_at, out_id, err_id, tenant) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (batch_id, endpoint, input_file_id, window, "validating", json.dumps(metadata) if metadata else None,
             now, now + 24 * 3600, out_id, err_id, tenant))
        return self.get_batch(batch_id, tenant)

    def get_batch(self, batch_id: str, tenant: str | None) -> dict | None:
        """The batch `batch_id` of owner `tenant` (any owner's: ANY); None where there is none."""
        row = self._get("batches", batch_id, tenant)
        return dict(row) if row else None

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        return self._page("batches", tenant, "", (), after, limit)

    def _page(self, table: str, tenant: str, where: str, args: tuple, after: str | None,
              limit: int) -> tuple[list[dict], bool]:
        """Owner `tenant`'s rows, newest first, those created before `after` (an id of theirs: another
        owner's is as unknown as a missing one, else its place would show), at most `limit`; and
        whether more follow."""
        conds, params = ["tenant=?", *([where] if where else [])], [tenant, *args]
        if after:
            conds.append(f"seq < COALESCE((SELECT seq FROM {table} WHERE id=? AND tenant=?), -1)")
            params += [after, tenant]
        sql = f"SELECT * FROM {table} WHERE " + " AND ".join(conds)
        rows = self.db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit + 1)).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, batch_id: str, tenant: str) -> dict | None:
        """Owner `tenant`'s running batch to `cancelling` (its runner finishes the cancel); others stay
        as they are. None where the owner has no such batch."""
        now = int(time.time())
        self.db.execute("UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=? AND tenant=? AND "
                        "status IN ('validating', 'in_progress')", (now, batch_id, tenant))
        return self.get_batch(batch_id, tenant)

    # --- the runner's calls ------------------------------------------------------------------------
    def claim(self, owner: str) -> dict | None:
        """The oldest batch with work left whose lease is free, expired or a dead process's, leased to
        `owner`; None when there is none."""
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            rows = self.db.execute(f"SELECT id, lease_owner, lease_until FROM batches WHERE status IN {RUNNING} "
                                   "ORDER BY seq").fetchall()
            for r in rows:
                held = r["lease_owner"]
                if held is None or held == owner or r["lease_until"] < now or owner_gone(held):
                    self.db.execute("UPDATE batches SET lease_owner=?, lease_until=? WHERE id=?",
                                    (owner, now + LEASE_S, r["id"]))
                    self.db.execute("COMMIT")
                    return self.get_batch(r["id"], ANY)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return None

    def renew(self, batch_id: str, owner: str) -> str:
        """The lease extended; returns the batch's status (LeaseLost where another worker holds it)."""
        cur = self.db.execute("UPDATE batches SET lease_until=? WHERE id=? AND lease_owner=?",
                              (time.time() + LEASE_S, batch_id, owner))
        if cur.rowcount != 1:
            raise LeaseLost(batch_id)
        return self.db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()["status"]

    def release(self, batch_id: str, owner: str) -> None:
        self.db.execute("UPDATE batches SET lease_owner=NULL, lease_until=NULL WHERE id=? AND lease_owner=?",
                        (batch_id, owner))

    def set_status(self, batch_id: str, owner: str, expect: str, status: str, **fields) -> dict:
        """The leased batch moved from status `expect` to `status` (its time stamp set) with `fields`;
        the batch as it is now (still another status where it had left `expect`: a cancel came first)."""
        sets = {"status": status, **fields}
        if status in STATUS_TIME:
            sets[STATUS_TIME[status]] = int(time.time())
        cols = ", ".join(f"{k}=?" for k in sets)
        cur = self.db.execute(f"UPDATE batches SET {cols} WHERE id=? AND lease_owner=? AND status=?",
                              (*sets.values(), batch_id, owner, expect))
        row = self.get_batch(batch_id, ANY)
        if cur.rowcount != 1 and (row is None or row["lease_owner"] != owner):
            raise LeaseLost(batch_id)
        return row

    def status(self, batch_id: str) -> str | None:
        row = self.db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
        return row["status"] if row else None

    def done_lines(self, batch_id: str) -> set[int]:
        return {r[0] for r in self.db.execute("SELECT line FROM done WHERE batch_id=?", (batch_id,))}

    def commit(self, batch_id: str, owner: str, results: list[tuple[int, bytes | None, bytes | None, int]]) -> str:
        """Finished lines (line number, output line, error line, tokens) appended to the part files and
        recorded, all or none (see the module docstring); returns the batch's status."""
        self.db.execute("BEGIN IMMEDIATE")  # the write lock: no other worker can claim the job meanwhile
        try:
            row = self.db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None or row["lease_owner"] != owner:
                raise LeaseLost(batch_id)
            out_bytes = _append(self.part(row["out_id"]), row["out_bytes"], [r[1] for r in results if r[1]])
            err_bytes = _append(self.part(row["err_id"]), row["err_bytes"], [r[2] for r in results if r[2]])
            self.db.executemany("INSERT INTO done (batch_id, line) VALUES (?, ?)",
                                [(batch_id, r[0]) for r in results])
            ok = sum(1 for r in results if r[1])
            self.db.execute("UPDATE batches SET out_bytes=?, err_bytes=?, completed=completed+?, failed=failed+?, "
                            "input_tokens=input_tokens+?, lease_until=? WHERE id=?",
                            (out_bytes, err_bytes, ok, len(results) - ok, sum(r[3] for r in results),
                             time.time() + LEASE_S, batch_id))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return row["status"]

    def finish(self, batch_id: str, owner: str, status: str) -> dict:
        """The job's part files made its output and error files (the error file only with errors in it),
        their records added and the batch set to `status`, in one transaction."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None or row["lease_owner"] != owner:
                raise LeaseLost(batch_id)
            ids = {}
            for kind, fid, size in (("output", row["out_id"], row["out_bytes"]), ("error", row["err_id"],
                                                                                   row["err_bytes"])):
                part, final = self.part(fid), self.path(fid)
                if part.exists():
                    with open(part, "r+b") as f:
                        f.truncate(size)  # an append past the last commit is not part of the output
                    os.replace(part, final)
                elif not final.exists():  # no line was ever written there
                    final.write_bytes(b"")
                if kind == "output" or size:
                    ids[f"{kind}_file_id"] = fid
                    self.db.execute("INSERT OR IGNORE INTO files (id, bytes, created_at, filename, purpose, tenant) "
                                    "VALUES (?,?,?,?,?,?)", (fid, size, int(time.time()), f"{batch_id}_{kind}.jsonl",
                                                             "batch_output", row["tenant"]))  # the batch's owner
                else:
                    final.unlink(missing_ok=True)
            now = int(time.time())
            stamps = {STATUS_TIME[status]: now}
            self.db.execute(f"UPDATE batches SET status=?, {', '.join(f'{k}=?' for k in (*ids, *stamps))}, "
                            "lease_owner=NULL, lease_until=NULL WHERE id=?",
                            (status, *ids.values(), *stamps.values(), batch_id))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return self.get_batch(batch_id, ANY)


def _append(path: Path, committed: int, lines: list[bytes]) -> int:
    """`lines` appended to `path` after its first `committed` bytes (anything after them cut off:
    an earlier write that was never committed), synced to disk; the new committed length."""
    if not lines and not path.exists():
        return committed
    with open(path, "ab") as f:
        if f.tell() != committed:
            f.truncate(committed)
            f.seek(committed)
        if lines:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
        return f.tell()
