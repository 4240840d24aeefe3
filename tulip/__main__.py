"""python -m tulip --model PATH --port 50051 [...]: serve one model over gRPC."""

import asyncio
import logging
import sys

from tulip.config import TulipConfig
from tulip.server import serve


def main(argv: list[str] | None = None) -> int:
    cfg = TulipConfig.from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
