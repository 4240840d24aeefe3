"""python -m ivy --port 8000 --tulip HOST:PORT [--tulip ...] --model PATH: serve the HTTP API
under uvicorn (httptools, uvloop) or Granian (`--server`)."""

import dataclasses
import logging
import os
import resource
import signal
import sys

from ivy.accesslog import JsonFormatter
from ivy.config import IvyConfig
from trellis import logs

log = logging.getLogger("ivy")
FD_RESERVE = 128  # descriptors a worker needs besides its HTTP connections


def raise_fd_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (every connection is a descriptor; workers
    inherit it); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, e)
    return soft


def main(argv: list[str] | None = None) -> int:
    cfg = IvyConfig.from_args(argv)
    logs.setup(cfg.log_level, cfg.log_format, JsonFormatter)
    fds = raise_fd_limit()
    if cfg.max_connections > fds - FD_RESERVE:
        log.warning("--max-connections %d is over what the descriptor limit of %d leaves (%d kept for Tulip "
                    "channels, logs and files): at most %d connections per worker", cfg.max_connections, fds,
                    FD_RESERVE, max(fds - FD_RESERVE, 1))
        cfg = dataclasses.replace(cfg, max_connections=max(fds - FD_RESERVE, 1))
    # The servers shut down gracefully on SIGTERM/SIGINT, then uvicorn re-raises the signal under the
    # handler that was installed before it: make that one a clean exit, as a supervisor expects.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        resolve_models(cfg)
        if cfg.server == "granian":
            return _granian(cfg)
        return _uvicorn(cfg)
    except ValueError as e:
        print(f"ivy: error: {e}", file=sys.stderr)
        return 2


def resolve_models(cfg: IvyConfig) -> None:
    """Every model resolved once, here, before any worker starts: a Hub id's tokenizer and configs are fetched
    (or found in the cache) once, a bad reference ends Ivy with one line, and the workers read the same commit
    (trellis.modelref.pin: they inherit the environment)."""
    import logging

    from trellis.modelref import pin, resolve

    for mc in cfg.models:
        ref = resolve(mc.model, mc.revision, weights=False)
        pin(ref)
        logging.getLogger("ivy").log(logging.WARNING if ref.random_weights else logging.INFO, "model '%s': %s",
                                     mc.name or ref.name, ref.describe())


def _uvicorn(cfg: IvyConfig) -> int:
    import uvicorn

    import copy
    import functools

    from ivy.protocol import ReadLimitedProtocol

    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # its workers log by this config too
    log_config["filters"] = {"redact_query": {"()": "ivy.front.RedactQuery"}}
    log_config["handlers"]["access"]["filters"] = ["redact_query"]
    if cfg.log_format == "json":  # every logger, Ivy's own (the root's) too, one JSON object per line
        log_config["formatters"] = {name: {"()": "ivy.accesslog.JsonFormatter"} for name in ("default", "access")}
        log_config["root"] = {"handlers": ["default"], "level": cfg.log_level.upper()}
    http = functools.partial(ReadLimitedProtocol, read_timeout=cfg.read_timeout_s, max_connections=cfg.max_connections)
    kw = dict(host=cfg.host, port=cfg.port, log_level=cfg.log_level, loop="uvloop", http=http,
              timeout_keep_alive=cfg.keep_alive_s, timeout_graceful_shutdown=10,
              access_log=cfg.access_log and cfg.log_format == "text",  # json: Ivy's own (ivy.accesslog)
              log_config=log_config)
    if cfg.workers == 1:
        from ivy.app import create_app

        uvicorn.run(create_app(cfg), **kw)
    else:
        os.environ["IVY_CONFIG_JSON"] = cfg.to_json()
        uvicorn.run("ivy.app:create_app_from_env", factory=True, workers=cfg.workers, **kw)
    return 0


def _granian(cfg: IvyConfig) -> int:
    from granian.constants import Interfaces, Loops
    from granian.http import HTTP1Settings
    from granian.server import Server

    os.environ["IVY_CONFIG_JSON"] = cfg.to_json()  # every worker (a process, even for one) builds the app
    log = {}
    if cfg.log_format == "json":  # Granian's loggers and Ivy's (the root's) as JSON; access lines: Ivy's own
        from granian.log import LOGGING_CONFIG

        log = {"log_dictconfig": {
            "formatters": {"json": {"()": "ivy.accesslog.JsonFormatter"}},
            "handlers": {"console": {"formatter": "json", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"}},
            "loggers": {**LOGGING_CONFIG["loggers"], "granian.access": {"handlers": [], "propagate": False}},
            "root": {"handlers": ["console"], "level": cfg.log_level.upper()}}}
    Server("ivy.app:create_app_from_env", factory=True, address=cfg.host, port=cfg.port, interface=Interfaces.ASGI,
           workers=cfg.workers, loop=Loops.uvloop, log_level=cfg.log_level,
           log_access=cfg.access_log and cfg.log_format == "text", websockets=False, workers_kill_timeout=10,
           http1_settings=HTTP1Settings(header_read_timeout=int(cfg.read_timeout_s * 1000)), **log).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
