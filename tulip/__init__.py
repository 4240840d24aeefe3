"""Tulip: the gRPC inference server (tulip.server), its engine loop and its client."""

from trellis.grpcio import use_inline_io

use_inline_io()  # before grpc is first imported (trellis.grpcio says why)
