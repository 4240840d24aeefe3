"""python -m ivy --port 8000 --tulip HOST:PORT [--tulip ...] --model PATH: serve the HTTP API
under uvicorn (httptools, uvloop) or Granian (`--server`)."""

import logging
import os
import signal
import sys

from ivy.config import IvyConfig


def main(argv: list[str] | None = None) -> int:
    cfg = IvyConfig.from_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The servers shut down gracefully on SIGTERM/SIGINT, then uvicorn re-raises the signal under the
    # handler that was installed before it: make that one a clean exit, as a supervisor expects.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        if cfg.server == "granian":
            return _granian(cfg)
        return _uvicorn(cfg)
    except ValueError as e:
        print(f"ivy: error: {e}", file=sys.stderr)
        return 2


def _uvicorn(cfg: IvyConfig) -> int:
    import uvicorn

    import copy
    import functools

    from ivy.protocol import ReadLimitedProtocol

    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # its workers log by this config too
    log_config["filters"] = {"redact_query": {"()": "ivy.front.RedactQuery"}}
    log_config["handlers"]["access"]["filters"] = ["redact_query"]
    http = functools.partial(ReadLimitedProtocol, read_timeout=cfg.read_timeout_s)
    kw = dict(host=cfg.host, port=cfg.port, log_level=cfg.log_level, loop="uvloop", http=http,
              timeout_keep_alive=cfg.keep_alive_s, timeout_graceful_shutdown=10, access_log=cfg.access_log,
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
    Server("ivy.app:create_app_from_env", factory=True, address=cfg.host, port=cfg.port, interface=Interfaces.ASGI,
           workers=cfg.workers, loop=Loops.uvloop, log_level=cfg.log_level, log_access=cfg.access_log,
           websockets=False, workers_kill_timeout=10,
           http1_settings=HTTP1Settings(header_read_timeout=int(cfg.read_timeout_s * 1000))).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
