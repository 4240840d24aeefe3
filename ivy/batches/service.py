"""`BatchService`: the Batch API of one Ivy worker: its store and runner (with `--batch-dir`), its
routes (answering 404 "not enabled" without it), the objects it answers with, and whose they are.

With --api-keys, each file and batch belongs to the key that created it (and a batch's output and
error files to the batch's): the routes answer another key's object exactly as a missing one (404
with the same message), leave it out of lists, and refuse it as a batch's input. The store keeps
not the key but its owner id, HMAC-SHA256(the batch directory's random 32-byte key, the API key):
a copy of `batches.db` alone (a backup, a bug report) does not let anyone test guesses of the keys
against it offline, as a plain SHA-256 of a short or reused key would; and the id is stable while
the key and the directory are. Without --api-keys every caller is the one owner "" (no key), which
also owns the rows of a database made before owners existed."""

from __future__ import annotations

import hashlib
import hmac
import json

from ivy.batches.runner import Runner
from ivy.batches.store import Store
from ivy.errors import APIError
from ivy.front import CALL
from ivy.routes.common import Context

NO_KEY = ""  # the owner of what is made without an API key (no --api-keys)

ENDPOINTS = ("/v1/embeddings", "/v1/rerank", "/v1/score")  # the routes a batch's lines can go to
MULTIPART_SLACK = 1 << 20  # a /v1/files body may exceed its file's limit by this much (the form around it)


def batch_object(row: dict) -> dict:
    """OpenAI's Batch object of a `batches` record."""
    tokens = row["input_tokens"]
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        "model": row["model"],
        "usage": {"input_tokens": tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": tokens},
    }


class BatchService:
    """See the module docstring. `handlers`: the app's fast handlers by path (Front's), of which the
    batch endpoints' are the ones a job's lines run through."""

    def __init__(self, ctx: Context, handlers: dict):
        cfg = ctx.cfg
        self.cfg = cfg
        self.store = self.runner = None
        self.owners: dict[str, str] = {}  # API key: its owner id, made once (a request only looks it up)
        if cfg.batch_dir:
            self.store = Store(cfg.batch_dir)
            secret = self.store.secret() if cfg.api_keys else b""
            self.owners = {k: hmac.new(secret, k.encode(), hashlib.sha256).hexdigest() for k in cfg.api_keys}
            self.runner = Runner(self.store, {e: handlers[e] for e in ENDPOINTS}, cfg.batch_concurrency,
                                 cfg.max_batch_lines, cfg.max_request_mb << 20)

    def enabled(self) -> Store:
        """The store, or the 404 a server without --batch-dir answers every batch route with."""
        if self.store is None:
            raise APIError(404, "the Batch API is not enabled on this server: start Ivy with --batch-dir DIR "
                           "(IVY_BATCH_DIR) to store batch files and jobs there", None, "batch_api_not_enabled")
        return self.store

    def owner(self) -> str:
        """The owner id of the request being handled: its API key's (Front.authorized set it), or NO_KEY."""
        call = CALL.get()
        key = call.api_key if call is not None else None
        return NO_KEY if key is None else self.owners[key]

    def body_limits(self) -> dict[str, int]:
        """Front's body limit per path where it is not --max-request-mb's: an upload's."""
        return {"/v1/files": (self.cfg.max_batch_file_mb << 20) + MULTIPART_SLACK}

    def start(self) -> None:
        if self.runner is not None:
            self.runner.start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.close()
            self.store.close()
