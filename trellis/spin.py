"""Keeping an asyncio event loop awake while an answer is due.

A loop with nothing to run sleeps in epoll; the gRPC reply, request or CUDA completion that
wakes it then pays thread and scheduler wake-ups (tens to hundreds of microseconds, measured
in `benchmarks.hop`). `Spinner` re-queues a no-op callback every loop iteration for a bounded
time, so the loop polls its file descriptors without sleeping: one busy core for lower latency.
Threads of the same process (a tokenizer offload, a step waiter) then compete with the spinning
loop for the GIL: their hand-offs get slower while it spins.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class Spinner:
    """After `kick()`, keep the running loop polling for up to `seconds`, or until `wanted()` is False."""

    def __init__(self, seconds: float, wanted: Callable[[], bool] = lambda: True):
        self.seconds = seconds
        self.wanted = wanted
        self._until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.spinning = False

    def kick(self) -> None:
        if self.seconds <= 0:
            return
        self._until = time.monotonic() + self.seconds
        if not self.spinning:
            self.spinning = True
            self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        again = False
        try:
            again = time.monotonic() < self._until and self.wanted()
        finally:
            if again:
                self._loop.call_soon(self._tick)
            else:
                self.spinning = False
