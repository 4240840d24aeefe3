"""`python -m tulip.probe [HOST:PORT | unix:PATH]`: exit 0 when the Tulip there reports SERVING
on the gRPC health service (it does once weights are loaded and warm-up is done), 1 otherwise.

For container health checks (docker compose); Kubernetes has a native gRPC probe for the same.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tulip.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", default="127.0.0.1:50051")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds")
    args = ap.parse_args(argv)
    with grpc.insecure_channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.target}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
