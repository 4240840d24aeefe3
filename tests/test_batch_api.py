"""OpenAI's Batch API on Ivy (ivy/batches), end to end with the official `openai` client against a real
Ivy and Tulip on loopback (the default model on the CPU): files, batches, the output and error files,
cancel, list, validation, the upload limit, a job that survives its Ivy being killed (SIGKILL), and
with --api-keys each key's files and batches hidden from the others (on a database made before owners)."""

import json
import signal
import sqlite3
import time

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Proc, free_port, http_status, metric

TERMINAL = ("completed", "failed", "cancelled", "expired")


class IvyProc:
    """One Ivy with a batch directory, which a test can kill and start again on the same directory."""

    def __init__(self, tmp, target: str, data, *args: str):
        self.tmp, self.target, self.data, self.args = tmp, target, data, args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.proc = Proc(["-m", "ivy", "--port", str(self.port), "--tulip", self.target, "--batch-dir", str(self.data),
                          "--max-batch-file-mb", "1", "--batch-concurrency", "4", *self.args], self.tmp)
        self.proc.wait_for(lambda: http_status(self.url + "/ready") == 200, timeout=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A Tulip and an Ivy, started side by side (Ivy is ready once the Tulip answers): (Ivy, Tulip's metrics URL)."""
    tmp = tmp_path_factory.mktemp("batch")
    port, metrics_port = free_port(), free_port()
    tulip = Proc(["-m", "tulip", "--model", "default", "--port", str(port), "--device", "cpu",
                  "--metrics-port", str(metrics_port)], tmp)
    try:
        server = IvyProc(tmp, f"127.0.0.1:{port}", tmp / "data")
        yield server, f"http://127.0.0.1:{metrics_port}/metrics"
        server.proc.stop()
        assert "Traceback" not in server.proc.output()
    finally:
        tulip.stop()


@pytest.fixture(scope="module")
def ivy(stack):
    return stack[0]


@pytest.fixture(scope="module")
def client(ivy):
    return openai.OpenAI(base_url=ivy.url + "/v1", api_key="unused", max_retries=0)


def line(cid: str, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def submit(client, lines: list[str], endpoint: str = "/v1/embeddings"):
    f = client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"test": "batch_api"})


def wait(client, batch_id: str, until=lambda b: b.status in TERMINAL, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.05)


def jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_embeddings_batch_end_to_end(client, stack):
    """Output vectors equal a direct /v1/embeddings call's; bad lines and refused bodies land in the
    error file, each alone; the lines reach Tulip as batch-priority work."""
    texts = [[f"tulip number {i}", "roses in the garden"] for i in range(12)]
    lines = [line(f"req-{i}", {"input": t}) for i, t in enumerate(texts)]
    lines += ["this line is not json", line("no-input", {"inputs": "x"}),
              line("no-model", {"input": "x", "model": "nope"})]
    batch_seconds = lambda: metric(httpx.get(stack[1]).text,  # noqa: E731
                                   "tulip_priority_queue_seconds_count", priority="batch")
    before = batch_seconds()
    b = submit(client, lines)
    assert b.status == "validating" and b.metadata == {"test": "batch_api"} and b.endpoint == "/v1/embeddings"
    b = wait(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (15, 12, 3)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.usage.input_tokens > 0
    assert batch_seconds() - before >= 12  # every good line went to Tulip as batch work
    out = {o["custom_id"]: o for o in jsonl(client, b.output_file_id)}
    assert sorted(out) == sorted(f"req-{i}" for i in range(12))
    for i, t in enumerate(texts):
        o = out[f"req-{i}"]
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        direct = client.embeddings.create(input=t, model="all-MiniLM-L6-v2")
        got = np.array([d["embedding"] for d in o["response"]["body"]["data"]])
        want = np.array([d.embedding for d in direct.data])
        np.testing.assert_allclose(got, want, atol=1e-5)
    errs = jsonl(client, b.error_file_id)
    assert len(errs) == 3
    bad_json = next(e for e in errs if e["custom_id"] is None)
    assert bad_json["response"] is None and bad_json["error"]["code"] == "invalid_json_line"
    by_id = {e["custom_id"]: e["response"] for e in errs if e["custom_id"]}
    assert by_id["no-input"]["status_code"] == 400 and by_id["no-input"]["body"]["error"]["param"] == "input"
    assert by_id["no-model"]["status_code"] == 404 and by_id["no-model"]["body"]["error"]["code"] == "model_not_found"
    f = client.files.retrieve(b.output_file_id)
    assert f.purpose == "batch_output" and f.bytes == len(client.files.content(b.output_file_id).content)


def test_rerank_and_score_batches(client):
    rr = [line("rr", {"query": "flowers", "documents": ["a tulip", "a tax form"]}, "/v1/rerank")]
    sc = [line("sc", {"text_1": "flowers", "text_2": ["a tulip", "a tax form"]}, "/v1/score")]
    b1, b2 = submit(client, rr, "/v1/rerank"), submit(client, sc, "/v1/score")
    b1, b2 = wait(client, b1.id), wait(client, b2.id)
    assert b1.status == b2.status == "completed" and b1.request_counts.completed == b2.request_counts.completed == 1
    ranked = jsonl(client, b1.output_file_id)[0]["response"]["body"]["results"]
    assert ranked[0]["index"] == 0
    scores = [d["score"] for d in jsonl(client, b2.output_file_id)[0]["response"]["body"]["data"]]
    assert scores[0] > scores[1]


def test_validation_failures(client):
    dup = [line("a", {"input": "x"}), line("b", {"input": "y"}), line("a", {"input": "z"}),
           line("c", {"input": "w"}, url="/v1/rerank")]
    b = wait(client, submit(client, dup).id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    codes = {(e.code, e.line) for e in b.errors.data}
    assert codes == {("duplicate_custom_id", 3), ("mismatched_endpoint", 4)}
    b = wait(client, submit(client, ["id,text", "1,hello"]).id)  # a CSV, not JSONL
    assert b.status == "failed" and [e.code for e in b.errors.data] == ["invalid_file_format"]
    with pytest.raises(openai.BadRequestError, match="not served by this server's batches"):
        f = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not served"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_upload_limit_is_a_413(client, ivy):
    for size in (1536 << 10, 4 << 20):  # over --max-batch-file-mb 1: found while streaming, then by Content-Length
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        assert e.value.status_code == 413
    assert not [p for p in (ivy.data / "files").iterdir() if p.suffix == ".upload"]  # no partial upload kept


def test_cancel_list_and_delete(client):
    b = submit(client, [line(f"c{i}", {"input": [f"text {i} " * 30] * 4}) for i in range(400)])
    wait(client, b.id, lambda b: b.request_counts.completed > 0)
    t0 = time.monotonic()
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = wait(client, b.id, timeout=10)
    assert b.status == "cancelled" and b.cancelled_at and time.monotonic() - t0 < 5
    assert 0 < b.request_counts.completed < 400
    assert len(jsonl(client, b.output_file_id)) == b.request_counts.completed  # the finished lines are kept
    done = wait(client, submit(client, [line("one", {"input": "x"})]).id)
    with pytest.raises(openai.ConflictError, match="only a validating or in_progress batch"):
        client.batches.cancel(done.id)
    newest = [x.id for x in client.batches.list(limit=100).data]
    paged = [x.id for x in client.batches.list(limit=2)]  # the client follows `after` page by page
    assert paged == newest and len(newest) >= 5 and newest.index(b.id) > 0
    assert client.files.delete(b.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(b.output_file_id)


def test_ivy_killed_mid_job_resumes_exactly_once(client, ivy):
    n = 160
    b = submit(client, [line(f"k{i}", {"input": f"sentence {i} " * 15}) for i in range(n)])
    seen = wait(client, b.id, lambda b: b.request_counts.completed >= 10).request_counts.completed
    assert seen < n
    ivy.proc.p.send_signal(signal.SIGKILL)
    ivy.proc.p.wait()
    ivy.start()
    resumed = client.batches.retrieve(b.id)
    assert resumed.request_counts.completed >= seen  # committed progress survived the kill
    b = wait(client, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (n, 0)
    ids = [o["custom_id"] for o in jsonl(client, b.output_file_id)]
    assert sorted(ids) == sorted(f"k{i}" for i in range(n))  # every line exactly once
    assert b.error_file_id is None


def test_without_batch_dir_the_routes_say_so():
    """No --batch-dir: every batch route is a 404 saying how to turn the API on (the routes alone, in-process)."""
    import asyncio
    from types import SimpleNamespace

    from fastapi import FastAPI

    from ivy import errors
    from ivy.batches import BatchService
    from ivy.batches.routes import routes
    from ivy.config import IvyConfig

    app = FastAPI()
    errors.install(app)
    app.include_router(routes(BatchService(SimpleNamespace(cfg=IvyConfig(tulip=("127.0.0.1:1",))), {})).router)

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ivy") as c:
            return await c.get("/v1/batches"), await c.post("/v1/files", files={"file": ("a", b"x")})

    for r in asyncio.run(get()):
        assert r.status_code == 404 and r.json()["error"]["code"] == "batch_api_not_enabled"
        assert "--batch-dir" in r.json()["error"]["message"]


# The schema of the databases made before files and batches had owners (ivy/batches/store.py until
# 2026-12-06): an Ivy must still open them, their rows belonging to "no key".
OLD_SCHEMA = """
CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL);
CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT,
    errors TEXT, model TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    out_id TEXT NOT NULL, err_id TEXT NOT NULL, out_bytes INTEGER NOT NULL DEFAULT 0,
    err_bytes INTEGER NOT NULL DEFAULT 0, output_file_id TEXT, error_file_id TEXT,
    lease_owner TEXT, lease_until REAL);
CREATE TABLE done (batch_id TEXT NOT NULL, line INTEGER NOT NULL, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
INSERT INTO files (id, bytes, created_at, filename, purpose) VALUES ('file-old', 2, 1, 'old.jsonl', 'batch');
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, out_id, err_id)
    VALUES ('batch_old', '/v1/embeddings', 'file-old', '24h', 'completed', 1, 2, 'file-o', 'file-e');
"""


# the two callers' API keys (k1 and k2 in the tests)
KEYS = {"k1": "sk-tenant-one-7c1f9e2a4b6d", "k2": "sk-tenant-two-3e8a0d5c9f17"}


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory):
    """A second Ivy on the same Tulip, with --api-keys k1 and k2, on a batch directory whose database has
    the schema from before owners: ({key: its openai client}, the batch directory)."""
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "data" / "files").mkdir(parents=True)
    (tmp / "data" / "files" / "file-old").write_bytes(b"{}")
    with sqlite3.connect(tmp / "data" / "batches.db") as db:
        db.executescript(OLD_SCHEMA)
    server = IvyProc(tmp, stack[0].target, tmp / "data", "--api-keys", KEYS["k1"], "--api-keys", KEYS["k2"])
    yield {k: openai.OpenAI(base_url=server.url + "/v1", api_key=v, max_retries=0) for k, v in KEYS.items()}, tmp / "data"
    server.proc.stop()
    assert "Traceback" not in server.proc.output()


def test_keys_see_only_their_own_files_and_batches(keyed):
    """k2 gets exactly a missing object's 404 for each of k1's files and batches, on every route, and
    cannot run a batch on k1's file; k1 still can do all of it. The rows of the old database belong to
    no key: neither key sees them."""
    clients, data = keyed
    k1, k2 = clients["k1"], clients["k2"]
    done = wait(k1, submit(k1, [line("one", {"input": "x"})]).id)
    assert done.status == "completed"
    running = submit(k1, [line(f"r{i}", {"input": [f"text {i} " * 30] * 4}) for i in range(400)])
    f = k1.files.retrieve(done.input_file_id)

    def missing(call, *args):
        with pytest.raises(openai.NotFoundError) as e:
            call(*args)
        return e.value.status_code, e.value.body

    for kind, obj_id, calls in (
            ("File", f.id, (k2.files.retrieve, k2.files.content, k2.files.delete)),
            ("File", done.output_file_id, (k2.files.retrieve, k2.files.content, k2.files.delete)),
            ("Batch", done.id, (k2.batches.retrieve, k2.batches.cancel)),
            ("Batch", running.id, (k2.batches.retrieve, k2.batches.cancel))):
        nowhere = missing(calls[0], obj_id[:-4] + "0000")  # an id that exists nowhere: the answer to match
        for call in calls:
            assert missing(call, obj_id) == (nowhere[0], {**nowhere[1], "message": nowhere[1]["message"].replace(
                obj_id[:-4] + "0000", obj_id)}), (call, kind)
    with pytest.raises(openai.BadRequestError, match=f"No such File object: {f.id}"):
        k2.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert k2.batches.list().data == [] and k2.files.list().data == []
    for old in ("file-old", "batch_old"):
        for client in (k1, k2):
            missing(client.files.retrieve if old.startswith("file") else client.batches.retrieve, old)
    assert {x.id for x in k1.files.list()} >= {f.id, done.output_file_id} and "file-old" not in {
        x.id for x in k1.files.list()}
    assert [x.id for x in k1.batches.list()] == [running.id, done.id]
    assert k1.batches.cancel(running.id).status in ("cancelling", "cancelled")  # still the owner's to cancel
    assert len(jsonl(k1, done.output_file_id)) == 1
    again = wait(k1, k1.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert again.status == "completed" and again.request_counts.completed == 1
    wait(k1, running.id)
    assert k1.files.delete(done.output_file_id).deleted
    assert (data / "owner.key").stat().st_mode & 0o777 == 0o600  # the owners' HMAC key, readable by Ivy's user only
    stored = b"".join(p.read_bytes() for p in data.glob("batches.db*"))  # the database and its WAL
    # owners are kept as HMACs, never as the keys (keys long enough not to turn up in a binary file by chance)
    assert all(key.encode() not in stored for key in KEYS.values())


def test_store_migrates_and_a_cursor_is_no_oracle(tmp_path):
    """In-process: an old database gets the owner column, its rows owned by "" (no key); a list's
    `after` naming another owner's id pages as one naming no object does (its place is not shown)."""
    from ivy.batches.store import ANY, Store

    with sqlite3.connect(tmp_path / "batches.db") as db:
        db.executescript(OLD_SCHEMA)
    st = Store(tmp_path)
    try:
        assert st.get_file("file-old", "")["filename"] == "old.jsonl" and st.get_batch("batch_old", "") is not None
        assert st.get_file("file-old", "a") is None and st.get_batch("batch_old", ANY)["tenant"] == ""
        for fid, owner in (("file-b1", "b"), ("file-a1", "a"), ("file-b2", "b")):
            st.add_file(fid, 1, "x.jsonl", "batch", owner)
        assert [r["id"] for r in st.list_files("b", None, None, 10)[0]] == ["file-b2", "file-b1"]
        assert st.list_files("b", None, "file-a1", 10) == st.list_files("b", None, "file-none", 10) == ([], False)
        assert st.delete_file("file-a1", "b") is None and st.get_file("file-a1", "a") is not None
        st.close()
        st = Store(tmp_path)  # opened again: already migrated
        assert st.get_file("file-a1", "a") is not None
    finally:
        st.close()
