"""`BatchService`: the Batch API of one Ivy worker: its store and runner (with `--batch-dir`), its
routes (answering 404 "not enabled" without it), and the objects it answers with."""

from __future__ import annotations

import json

from ivy.batches.runner import Runner
from ivy.batches.store import Store
from ivy.errors import APIError
from ivy.routes.common import Context

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
        if cfg.batch_dir:
            self.store = Store(cfg.batch_dir)
            self.runner = Runner(self.store, {e: handlers[e] for e in ENDPOINTS}, cfg.batch_concurrency,
                                 cfg.max_batch_lines, cfg.max_request_mb << 20)

    def enabled(self) -> Store:
        """The store, or the 404 a server without --batch-dir answers every batch route with."""
        if self.store is None:
            raise APIError(404, "the Batch API is not enabled on this server: start Ivy with --batch-dir DIR "
                           "(IVY_BATCH_DIR) to store batch files and jobs there", None, "batch_api_not_enabled")
        return self.store

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
