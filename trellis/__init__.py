"""Shared contracts: the generated gRPC stubs (trellis.tulip.v1) and config plumbing (trellis.cli);
`cache_root`, the one cache directory every role's files live under."""

import os
from pathlib import Path


def cache_root() -> Path:
    """$TRELLIS_CACHE, else ~/.cache/trellis (presets, Ivy's native tokenizers' builds)."""
    return Path(os.environ.get("TRELLIS_CACHE", Path.home() / ".cache" / "trellis"))
