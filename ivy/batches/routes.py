"""The Batch API's HTTP routes, in the shapes the official `openai` client sends and parses:
`POST /v1/files` (multipart, purpose `batch`), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`; `POST /v1/batches`, `GET /v1/batches`
(`after`, `limit`), `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`. Each reads and writes
the caller's own objects only (`BatchService.owner`): another owner's answers as a missing one."""

from __future__ import annotations

import asyncio
import os
from typing import Union

import msgspec
from fastapi import Query, Request
from starlette.responses import FileResponse

from ivy import errors
from ivy.batches import files
from ivy.batches.service import ENDPOINTS, BatchService, batch_object
from ivy.errors import APIError
from ivy.routes.common import Routes


class BatchCreate(msgspec.Struct, forbid_unknown_fields=False):
    """POST /v1/batches' body (OpenAI's; `output_expires_after` is taken and not applied: outputs
    stay until deleted)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Union[dict[str, str], None] = None
    output_expires_after: Union[dict, None] = None


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def check_metadata(md: dict[str, str] | None) -> None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if md is None:
        return
    if len(md) > 16:
        raise APIError(400, f"'metadata' has {len(md)} keys; at most 16 are accepted", "metadata")
    for k, v in md.items():
        if len(k) > 64 or len(v) > 512:
            raise APIError(400, f"metadata key '{k[:64]}': keys are at most 64 characters, values 512", "metadata")


def page(rows: list[dict], more: bool, shape) -> dict:
    data = [shape(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def routes(svc: BatchService) -> Routes:
    out = Routes()
    r = out.router

    def no_file(file_id: str) -> APIError:  # a missing file's answer, and another owner's
        return APIError(404, f"No such File object: {file_id}", "id", "file_not_found")

    def no_batch(batch_id: str) -> APIError:
        return APIError(404, f"No such Batch object: {batch_id}", "id", "batch_not_found")

    async def file_row(file_id: str) -> dict:
        st = svc.enabled()
        row = await st.run(st.get_file, file_id, svc.owner())
        if row is None:
            raise no_file(file_id)
        return row

    async def batch_row(batch_id: str) -> dict:
        st = svc.enabled()
        row = await st.run(st.get_batch, batch_id, svc.owner())
        if row is None:
            raise no_batch(batch_id)
        return row

    @r.post("/v1/files")
    async def upload_file(request: Request):
        st = svc.enabled()
        file_id = new_id("file-")
        tmp = st.files_dir / f"{file_id}.upload"
        _, filename, size = await files.receive(request, tmp, svc.cfg.max_batch_file_mb << 20)
        await asyncio.to_thread(os.replace, tmp, st.path(file_id))
        return files.file_object(await st.run(st.add_file, file_id, size, filename, "batch", svc.owner()))

    @r.get("/v1/files")
    async def list_files(purpose: Union[str, None] = None, after: Union[str, None] = None,
                         limit: int = Query(100, ge=1, le=10000)):
        st = svc.enabled()
        rows, more = await st.run(st.list_files, svc.owner(), purpose, after, limit)
        return page(rows, more, files.file_object)

    @r.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return files.file_object(await file_row(file_id))

    @r.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        row = await file_row(file_id)
        path = svc.store.path(file_id)
        if not await asyncio.to_thread(path.exists):
            raise no_file(file_id)  # deleted meanwhile
        return FileResponse(path, media_type="application/jsonl", filename=row["filename"])

    @r.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        await file_row(file_id)
        st = svc.store
        running = await st.run(st.delete_file, file_id, svc.owner())
        if running is not None:
            raise APIError(409, f"file {file_id} is the input of batch {running}, which is still running; cancel "
                           "it or wait for it to end", "id", "file_in_use")
        await asyncio.to_thread(st.path(file_id).unlink, True)
        return {"id": file_id, "object": "file", "deleted": True}

    @r.post("/v1/batches")
    async def create_batch(request: Request):
        st = svc.enabled()
        req = errors.parse_body(BatchCreate, await request.body())
        if req.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint '{req.endpoint}' is not served by this server's batches; they take "
                           f"{', '.join(ENDPOINTS)}", "endpoint", "invalid_endpoint")
        if req.completion_window != "24h":
            raise APIError(400, f"completion_window must be '24h', got '{req.completion_window}'",
                           "completion_window")
        check_metadata(req.metadata)
        f = await st.run(st.get_file, req.input_file_id, svc.owner())  # another owner's: as missing
        if f is None:
            raise APIError(400, f"No such File object: {req.input_file_id}", "input_file_id", "file_not_found")
        if f["purpose"] != "batch":
            raise APIError(400, f"file {req.input_file_id} has purpose '{f['purpose']}'; a batch's input needs "
                           "purpose 'batch'", "input_file_id")
        row = await st.run(st.add_batch, new_id("batch_"), req.endpoint, req.input_file_id, req.completion_window,
                           req.metadata, new_id("file-"), new_id("file-"), svc.owner())
        svc.runner.poke()
        return batch_object(row)

    @r.get("/v1/batches")
    async def list_batches(after: Union[str, None] = None, limit: int = Query(20, ge=1, le=100)):
        st = svc.enabled()
        rows, more = await st.run(st.list_batches, svc.owner(), after, limit)
        return page(rows, more, batch_object)

    @r.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return batch_object(await batch_row(batch_id))

    @r.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        await batch_row(batch_id)
        st = svc.store
        row = await st.run(st.cancel, batch_id, svc.owner())
        if row is None:
            raise no_batch(batch_id)
        if row["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {batch_id} is {row['status']}: only a validating or in_progress batch "
                           "can be cancelled", "id", "batch_not_cancellable")
        svc.runner.poke(batch_id)
        return batch_object(row)

    return out
