"""python -m tulip --model PATH --port 50051 [...]: serve one model over gRPC."""

from trellis.grpcio import use_inline_io

use_inline_io()  # before grpc is first imported (trellis.grpcio says why)

import asyncio  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from trellis import logs  # noqa: E402
from tulip.config import TulipConfig  # noqa: E402
from tulip.server import serve  # noqa: E402


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
