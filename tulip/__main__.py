"""python -m tulip --model PATH --port 50051 [...]: serve one model over gRPC."""

import asyncio
import logging
import sys

from trellis import logs
from tulip.config import TulipConfig
from tulip.server import serve


def main(argv: list[str] | None = None) -> int:
    cfg = TulipConfig.from_args(argv)
    logs.setup(logging.INFO, cfg.log_format)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(serve(cfg))
    except ValueError as e:
        print(f"tulip: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
