"""Ivy: the HTTP gateway (FastAPI) in front of Tulip replicas."""

from trellis.grpcio import use_inline_io

use_inline_io()  # before grpc is first imported (trellis.grpcio says why)
