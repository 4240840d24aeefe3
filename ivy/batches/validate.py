"""A batch input file's lines and checks: what fails a batch at validation (OpenAI's `errors` shape:
{"code", "message", "param", "line"}) and what fails one line only (its entry in the error file).

The file fails as a whole when it has no lines (`empty_file`), when none of its lines is a JSON object
(`invalid_file_format`: not JSONL), when a line's `url` is not the batch's endpoint
(`mismatched_endpoint`), when two lines share a `custom_id` (`duplicate_custom_id`: the output could
not be matched to them) or when it has more lines than `--max-batch-lines` (`too_many_lines`).
A line that is not JSON, lacks a `custom_id`, `method` POST, `url` or an object `body`, or is longer
than `--max-request-mb`, fails alone (`line_error`): one bad line never fails the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import orjson

MAX_ERRORS = 100  # validation errors listed per batch (the first ones)


def lines(path: Path, max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, its bytes, None where it is over `max_line` bytes) of each non-blank line,
    read a line at a time (a long line is skipped in pieces, never held whole)."""
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(max_line + 1)
            if not raw:
                return
            n += 1
            if len(raw) > max_line and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 20)
                yield n, None
                continue
            if raw.strip():
                yield n, raw


def error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def check(path: Path, endpoint: str, max_lines: int, max_line: int) -> tuple[int, list[dict]]:
    """(the number of requests, the validation errors: none where the batch can run)."""
    if not path.exists():
        return 0, [error("file_not_found", "the input file's content is gone (deleted)", None, "input_file_id")]
    errors: list[dict] = []
    seen: dict[str, int] = {}
    total = objects = 0
    for n, raw in lines(path, max_line):
        total += 1
        if total > max_lines:
            errors.append(error("too_many_lines", f"the input file has more than {max_lines} requests "
                                "(--max-batch-lines)", n))
            break
        try:
            obj = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            continue  # a line error, not the batch's
        if not isinstance(obj, dict):
            continue
        objects += 1
        url = obj.get("url")
        if isinstance(url, str) and url != endpoint:
            errors.append(error("mismatched_endpoint", f"line {n}: url '{url[:200]}' is not the batch's endpoint "
                                f"'{endpoint}': every request of a batch goes to its endpoint", n, "url"))
        cid = obj.get("custom_id")
        if isinstance(cid, str):
            if cid in seen:
                errors.append(error("duplicate_custom_id", f"line {n}: custom_id '{cid[:200]}' is already the "
                                    f"custom_id of line {seen[cid]}; each request needs its own", n, "custom_id"))
            else:
                seen[cid] = n
        if len(errors) >= MAX_ERRORS:
            break
    if total == 0:
        return 0, [error("empty_file", "the input file has no requests")]
    if objects == 0 and not errors:
        errors.append(error("invalid_file_format", "no line of the input file is a JSON object: a batch input "
                            "file is JSONL, one request object per line ({\"custom_id\", \"method\", \"url\", "
                            "\"body\"})"))
    return total, errors


def line_request(raw: bytes | None, endpoint: str, max_line: int) -> tuple[str | None, dict | None, dict | None]:
    """A line's (custom_id, its request body, None), or (custom_id if it has one, None, its error
    {"code", "message"}) where the line itself is unusable."""
    if raw is None:
        return None, None, {"code": "line_too_long", "message": f"line over {max_line} bytes (--max-request-mb)"}
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return None, None, {"code": "invalid_json_line", "message": f"line is not valid JSON: {e}"}
    if not isinstance(obj, dict):
        return None, None, {"code": "invalid_json_line", "message": "line is not a JSON object"}
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, {"code": "missing_custom_id", "message": "line has no 'custom_id' string"}
    if obj.get("method") != "POST":
        return cid, None, {"code": "invalid_method", "message": f"'method' must be \"POST\", got {obj.get('method')!r}"}
    if obj.get("url") != endpoint:
        return cid, None, {"code": "invalid_url", "message": f"'url' must be the batch's endpoint '{endpoint}'"}
    body = obj.get("body")
    if not isinstance(body, dict):
        return cid, None, {"code": "invalid_body", "message": "'body' must be a JSON object (the request's body)"}
    return cid, body, None
