"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import TypeVar

import grpc
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}


M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


# gRPC status from a Tulip -> HTTP status for our caller.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "replica_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
}


def from_grpc(e: grpc.aio.AioRpcError) -> APIError:
    status, code = GRPC_TO_HTTP.get(e.code(), (502, "upstream_error"))
    return APIError(status, f"inference server: {e.details()}", None, code)


def parse_body(model: type[M], body: bytes) -> M:
    """JSON bytes -> a validated pydantic model, or APIError(400) saying what is wrong."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors(), getattr(model, "input_kinds", None)) from None


EMBEDDING_INPUTS = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


def _validation_error(errs: list, input_kinds: str | None = None) -> APIError:
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if where and first.get("type") == "missing":
        return APIError(400, f"'{where}' is required", param)
    if param == "input":
        return APIError(400, f"'input' must be {input_kinds or EMBEDDING_INPUTS}", "input")
    return APIError(400, f"invalid value for '{where}': {first['msg']}" if where else first["msg"], param)


async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    e = _validation_error(exc.errors())
    return error_response(e.status, e.message, e.param, e.code)


async def _api_error_handler(request: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


def install(app) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
