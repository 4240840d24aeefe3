"""`POST /v1/files`' upload: a multipart/form-data body (a `purpose` field and a `file` part, as the
`openai` client sends them) streamed to disk, never held whole in memory, and bounded.

Starlette's `request.form()` would spool the file (to memory, then a temporary file) with no limit on
its size and hand it over only once the whole body is read; here python-multipart's streaming parser
(the one Starlette uses) feeds the file part straight into the data directory, a MiB at a time off
the event loop, and the upload stops with a 413 at the first byte over `--max-batch-file-mb`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header

from ivy.errors import APIError

FLUSH = 1 << 20  # bytes of the file part buffered before they are written (off the loop)
MAX_FIELD = 4096  # a form field other than the file (purpose, expires_after[...]) is at most this long
DRAIN = 1 << 20  # past the limit, this much more of the body is read (and dropped) so the client gets the 413


def file_object(row: dict) -> dict:
    """OpenAI's FileObject of a `files` record."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


class Upload:
    """One multipart body's parse: form fields kept (small), the `file` part written to `dest`."""

    def __init__(self, content_type: str, dest: Path, limit: int):
        kind, params = parse_options_header(content_type)
        if kind != b"multipart/form-data" or not params.get(b"boundary"):
            raise APIError(400, "POST /v1/files takes multipart/form-data with a 'file' part and a 'purpose' "
                           "field (the openai client's files.create)", "file")
        self.dest, self.limit = dest, limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.buf = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._field, self._value = b"", b""
        self._name: str | None = None
        self._value_buf = bytearray()
        self._is_file = False
        self.error: APIError | None = None
        self.parser = MultipartParser(params[b"boundary"], {
            "on_part_begin": self._begin, "on_header_field": self._hfield, "on_header_value": self._hvalue,
            "on_header_end": self._hend, "on_headers_finished": self._hdone, "on_part_data": self._data,
            "on_part_end": self._end})
        self.out = None

    async def feed(self, stream) -> None:
        """Read the whole body from `stream` (Starlette's request.stream()), writing the file part."""
        self.out = await asyncio.to_thread(open, self.dest, "wb")
        try:
            drained = 0
            async for chunk in stream:
                if self.error is not None:  # a 413: a client still sending when the reply comes may not read it
                    drained += len(chunk)
                    if drained > DRAIN:
                        break
                    continue
                try:
                    self.parser.write(chunk)
                except APIError:
                    raise
                except Exception as e:  # python-multipart's MultipartParseError and kin
                    raise APIError(400, f"malformed multipart body: {e}", "file") from None
                if self.error is not None and self.error.status != 413:
                    raise self.error
                if len(self.buf) >= FLUSH:
                    await self._flush()
            if self.error is not None:
                raise self.error
            try:
                self.parser.finalize()
            except Exception as e:
                raise APIError(400, f"malformed multipart body: {e}", "file") from None
            await self._flush()
        finally:
            await asyncio.to_thread(self.out.close)

    async def _flush(self) -> None:
        if self.buf:
            data, self.buf = bytes(self.buf), bytearray()
            await asyncio.to_thread(self.out.write, data)

    # the parser's callbacks (synchronous, on the loop: they only copy bytes)
    def _begin(self) -> None:
        self._headers, self._name, self._is_file, self._value_buf = {}, None, False, bytearray()

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _hend(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _hdone(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.filename is not None:
                self.error = APIError(400, "more than one 'file' part: upload one file per request", "file")
            self._is_file = True
            self.filename = params.get(b"filename", b"file").decode("utf-8", "replace") or "file"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.size += end - start
            if self.size > self.limit and self.error is None:
                self.error = APIError(413, f"file over the limit of {self.limit >> 20} MiB (--max-batch-file-mb)",
                                      "file", "file_too_large")
            if self.error is None:
                self.buf += data[start:end]
        else:
            self._value_buf += data[start:end]
            if len(self._value_buf) > MAX_FIELD and self.error is None:
                self.error = APIError(400, f"form field '{self._name}' is over {MAX_FIELD} bytes", self._name)

    def _end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value_buf.decode("utf-8", "replace")


async def receive(request, dest: Path, limit: int) -> tuple[str, str, int]:
    """The upload of `request` into `dest`: (purpose, filename, bytes); an APIError (the partial file
    removed) when the body is not a usable upload."""
    up = Upload(request.headers.get("content-type", ""), dest, limit)
    try:
        await up.feed(request.stream())
        if up.filename is None:
            raise APIError(400, "'file' is required: a multipart part named 'file'", "file")
        purpose = up.fields.get("purpose")
        if not purpose:
            raise APIError(400, "'purpose' is required; this server takes purpose 'batch'", "purpose")
        if purpose != "batch":
            raise APIError(400, f"purpose '{purpose}' is not served here: this server stores files for the Batch "
                           "API only (purpose 'batch')", "purpose")
    except BaseException:
        await asyncio.to_thread(lambda: os.path.exists(dest) and os.unlink(dest))
        raise
    return purpose, up.filename, up.size
