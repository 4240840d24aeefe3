"""Ivy's and Tulip's log lines: `--log-format text` (the default, `TIME LEVEL LOGGER: MESSAGE`) or
`json`, one JSON object per line:

    {"time": "2026-05-09T07:35:25.123Z", "level": "INFO", "logger": "ivy.access", "message": "...",
     "method": "POST", "path": "/v1/embeddings", "status": 200, "duration_ms": 4.1, ...}

`time` is UTC with milliseconds; a record's `extra` fields are keys of their own (Ivy's access lines:
method, path, status, duration_ms, request_id, model); a traceback is the `exception` key. In JSON
mode Python's warnings are logged too (logger `py.warnings`), so nothing else reaches the stream.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# a LogRecord's own attributes (and uvicorn's colour copy of its message) are not extra fields
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring). `fields()`: keys a subclass adds to
    every line (Ivy: the request id of the request being handled); a record's own extras win."""

    def fields(self) -> dict:
        return {}

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(), **self.fields()}
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def check_format(log_format: str) -> None:
    """A ValueError unless `log_format` is one of FORMATS (the configs' check, and `setup`'s)."""
    if log_format not in FORMATS:
        raise ValueError(f"log_format {log_format!r} is not one of {', '.join(FORMATS)}")


def formatter(log_format: str, json_class: type[JsonFormatter] = JsonFormatter) -> logging.Formatter:
    return json_class() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def setup(level: str | int, log_format: str = "text", json_class: type[JsonFormatter] = JsonFormatter) -> None:
    """The root logger: one stderr handler in `log_format` at `level` (a name or a number)."""
    check_format(log_format)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, json_class))
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=True)
    if log_format == "json":
        logging.captureWarnings(True)
