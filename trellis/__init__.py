"""Shared contracts: the generated gRPC stubs (trellis.tulip.v1) and config plumbing (trellis.cli)."""
