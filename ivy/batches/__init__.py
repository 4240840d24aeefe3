"""OpenAI's Batch API on Ivy (issue 50): `POST /v1/files` (purpose `batch`), `/v1/batches` for
`/v1/embeddings`, `/v1/rerank` and `/v1/score`, as the official `openai` client calls them.

- `store`: the job and file records in SQLite (WAL) under `--batch-dir`, one writer thread per
  process, row leases so that one Ivy worker runs a job;
- `files`: uploads streamed to disk (bounded by `--max-batch-file-mb`), the file objects;
- `validate`: an input file's checks before a job runs (OpenAI's `errors` shape);
- `runner`: the asyncio task in each Ivy worker that runs a job's lines through the HTTP routes'
  own handlers at batch priority, committing progress as it goes (a restart resumes);
- `routes`: the HTTP routes (404 "batch API not enabled" without `--batch-dir`).
"""

from ivy.batches.service import BatchService

__all__ = ["BatchService"]
