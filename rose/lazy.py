"""`LazyTensor`: a step's result that may still be in flight on the GPU.

On CUDA the engine queues a device-to-host copy into page-locked memory behind
the forward pass and records an event after it; `ready()` polls the event,
`synchronize()` waits for it (the only blocking call on the step path) and
`await lazy` waits in a worker thread so the event loop keeps running. On CPU
the tensor is complete when the step returns and the interface is the same.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

# Its threads only ever sleep inside cudaEventSynchronize, which releases the GIL. More than one: with an
# online lane (`Engine.lane`) a step can finish before the one launched ahead of it, and its wait must not
# queue behind that step's (Tulip then waits on up to 2 x `max_inflight` steps at once: 8 covers 4 each).
_WAITER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rose-lazy-wait")


class LazyTensor:
    """A host tensor (or tuple of them) that becomes valid once `event` (if any) has completed."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: torch.Tensor, event: "torch.cuda.Event | None" = None):
        self._host = host
        self._event = event

    @classmethod
    def from_device(cls, t: "torch.Tensor | tuple[torch.Tensor, ...]") -> "LazyTensor":
        """Queue a copy of `t` (a tensor or a tuple of them) to the host; on CPU this is `t` itself."""
        first = t[0] if isinstance(t, tuple) else t
        if first.device.type != "cuda":
            return cls(t)
        ts = t if isinstance(t, tuple) else (t,)
        hosts = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in ts)
        for h, x in zip(hosts, ts):
            h.copy_(x, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(hosts if isinstance(t, tuple) else hosts[0], event)

    def ready(self) -> bool:
        """True once the data is on the host (never blocks)."""
        return self._event is None or self._event.query()

    def synchronize(self) -> torch.Tensor:
        """Block until the data is on the host and return it."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def __await__(self):
        if self.ready():
            self._event = None
            return self._host
        loop = asyncio.get_running_loop()
        return (yield from loop.run_in_executor(_WAITER, self.synchronize).__await__())
