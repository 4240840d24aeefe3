"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; on the text-embeddings-inference
routes in TEI's (`TEIError`)."""

from __future__ import annotations

import re
from typing import TypeVar

import grpc
import msgspec
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}


M = TypeVar("M", bound=msgspec.Struct)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> bytes:
        """The error's JSON body: OpenAI's shape."""
        return error_body(self.status, self.message, self.param, self.code)


class TEIError(APIError):
    """An error on a text-embeddings-inference route (ivy/routes/tei.py), in TEI's shape and statuses:
    {"error": message, "error_type": kind}, the kind as TEI writes its ErrorType: a request TEI would
    call invalid is a 422 ("Validation"; an empty batch: 400 "Empty"), a full queue 429 ("Overloaded"),
    no reachable replica 503 ("Unhealthy"), a replica's failure 424 ("Backend"); a deadline stays a 504
    ("Backend"), an unknown model a 404 and a request too large a 413 ("Validation")."""

    def __init__(self, e: APIError):
        status, kind = e.status, "Validation"
        if status == 400:
            status, kind = (400, "Empty") if e.code == "empty" else (422, "Validation")
        elif status == 429:
            kind = "Overloaded"
        elif status == 503:
            kind = "Unhealthy"
        elif status == 502:
            status, kind = 424, "Backend"
        elif status >= 500:
            kind = "Backend"
        super().__init__(status, e.message, e.param, e.code)
        self.kind = kind

    def body(self) -> bytes:
        return orjson.dumps({"error": self.message, "error_type": self.kind})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")  # 405, 415, ...
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


RETRY_AFTER = {429: "1", 503: "1"}  # seconds a client should wait before it tries again


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    return _response(status, error_body(status, message, param, code))


def _response(status: int, body: bytes) -> Response:
    headers = {"Retry-After": RETRY_AFTER[status]} if status in RETRY_AFTER else None
    return Response(body, status_code=status, media_type="application/json", headers=headers)


# gRPC status from a Tulip -> HTTP status for our caller.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.OUT_OF_RANGE: (413, "request_too_large"),  # more than a replica can ever take: split it
    grpc.StatusCode.UNAVAILABLE: (503, "replica_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
}


def from_grpc(e: grpc.aio.AioRpcError) -> APIError:
    """A Tulip's status as our caller's error. Tulip's own messages (validation, limits) are passed
    on; gRPC's transport text (addresses, resolver and connection errors) is not: it says nothing a
    caller can act on and names internal hosts."""
    status, code = GRPC_TO_HTTP.get(e.code(), (502, "upstream_error"))
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or status == 502:
        return APIError(status, "no inference server could take the request; retry shortly", None, code)
    return APIError(status, f"inference server: {e.details()}", None, code)


_DECODERS: dict[type, msgspec.json.Decoder] = {}
_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def parse_body(model: type[M], body: bytes) -> M:
    """JSON bytes -> the typed request, in one pass (msgspec), or APIError(400) saying what is wrong."""
    dec = _DECODERS.get(model)
    if dec is None:
        dec = _DECODERS[model] = msgspec.json.Decoder(model)
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        raise _decode_error(str(e), getattr(model, "input_kinds", None)) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec recurses per nesting level
        raise APIError(400, "request body is nested too deeply") from None


EMBEDDING_INPUTS = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


def input_kind_error(input_kinds: str | None = None) -> APIError:
    return APIError(400, f"'input' must be {input_kinds or EMBEDDING_INPUTS}", "input")


def _decode_error(msg: str, input_kinds: str | None) -> APIError:
    """A msgspec ValidationError's text ("Expected `int | null`, got `str` - at `$.dimensions`") as
    the 400 the pydantic models gave: the field named, its first path component as `param`."""
    if m := _MISSING.match(msg):
        return APIError(400, f"'{m.group(1)}' is required", m.group(1))
    m = _AT.match(msg)
    if m is None or not m.group(2):  # the body itself
        if m is None and msg.startswith("Expected `object`"):
            return APIError(400, "request body must be a JSON object")
        return APIError(400, msg if m is None else m.group(1))
    what, where = m.group(1), m.group(2)
    param = re.split(r"[.\[]", where, maxsplit=1)[0]
    if param == "input":
        return input_kind_error(input_kinds)
    return APIError(400, f"invalid value for '{where}': {what}", param)


def _validation_error(errs: list) -> APIError:
    """FastAPI's own validation (path and query parameters) as an OpenAI-shaped 400."""
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if where and first.get("type") == "missing":
        return APIError(400, f"'{where}' is required", param)
    return APIError(400, f"invalid value for '{where}': {first['msg']}" if where else first["msg"], param)


async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    e = _validation_error(exc.errors())
    return error_response(e.status, e.message, e.param, e.code)


async def _api_error_handler(request: Request, exc: APIError) -> Response:
    return _response(exc.status, exc.body())


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


def install(app) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
