"""Per-request stage timestamps in Tulip: where a served request's time goes, receipt to write.

Off unless asked (`--stage-samples N` / `TULIP_STAGE_SAMPLES`, or `StageRecorder(n)` in a
benchmark): then every request carries a list of `time.perf_counter_ns()` stamps, one per point
in `POINTS`, filled in by the gRPC (de)serializers, the servicer and the engine loop; the last
`n` complete lists stay in a ring and `summary()` gives p50 / p99 per stage (the time between
two consecutive points). Off, the request path pays one `is not None` test per point.

The decode and encode points come from wrapped deserializers / serializers, keyed by the message
object, so concurrent requests are attributed correctly; `write` is when the stream's generator
is resumed after its `yield` or, for unary, when the call's done callback runs: gRPC's core has
reported the send (and the status) done, which can be after the bytes reached the caller, so the
`write` stage (and `total`) include that notification's way back to the event loop.
"""

from __future__ import annotations

from collections import deque
from time import perf_counter_ns

import numpy as np

# The points stamped, in path order: each one's index in a request's stamp list, named here and
# only here. The stamping code indexes the list with these module constants (imported by name: a
# plain int, no enum or dict lookup on the request path). A stage is named by the point that ends it.
RECEIPT = 0     # the deserializer is called with the message's bytes
DECODE = 1      # ...and has returned the EmbedRequest
HANDLER = 2     # the servicer's code runs with it (unary handler started / stream reader resumed)
VALIDATE = 3    # checked and unpacked into a Request
SCHEDULE = 4    # queued on the scheduler (submit_nowait, before any launch)
BATCH = 5       # Batch.from_sequences done for the step it is in
LAUNCH = 6      # engine.step returned (the step is queued on the device)
WAIT = 7        # the engine loop sees the step complete
COPY = 8        # the step's rows copied out of the engine's host buffer
DELIVER = 9     # its completion callback ran (future set / reply queued)
RESUME = 10     # the servicer's code runs again with the rows
REPLY = 11      # the EmbedReply is built
TO_ENCODE = 12  # the serializer is called with it
ENCODE = 13     # ...and has returned the bytes
WRITE = 14      # handed to gRPC's core (stream) / the call is done (unary)

# Their names by index (summary()'s stage names, benchmarks' columns).
POINTS = ("receipt", "decode", "handler", "validate", "schedule", "batch", "launch", "wait", "copy",
          "deliver", "resume", "reply", "to_encode", "encode", "write")
if any(globals()[name.upper()] != i for i, name in enumerate(POINTS)):
    raise AssertionError("tulip.stages: POINTS and the point constants disagree")
INDEX = {name: i for i, name in enumerate(POINTS)}
N = len(POINTS)


class StageRecorder:
    """A ring of the last `samples` requests' stamps, and wrapped (de)serializers that stamp."""

    def __init__(self, samples: int):
        if samples < 1:
            raise ValueError(f"stage samples {samples} must be >= 1")
        self.ring: deque[list[int]] = deque(maxlen=samples)
        self._decoded: dict[int, tuple[int, int]] = {}  # id(message) -> (receipt, decode) until its handler claims it
        self._replies: dict[int, list[int]] = {}  # id(reply) -> its request's stamps until serialized

    @staticmethod
    def new() -> list[int]:
        return [0] * N

    # -- the gRPC edges ----------------------------------------------------------------------
    def deserializer(self, from_string):
        decoded = self._decoded

        def deserialize(data: bytes):
            t0 = perf_counter_ns()
            msg = from_string(data)
            if len(decoded) > 1024:  # messages no handler claimed (e.g. Info's are not stamped)
                decoded.clear()
            decoded[id(msg)] = (t0, perf_counter_ns())
            return msg

        return deserialize

    def serializer(self, to_string):
        replies = self._replies

        def serialize(msg) -> bytes:
            t0 = perf_counter_ns()
            out = to_string(msg)
            stamps = replies.get(id(msg))
            if stamps is not None:
                stamps[TO_ENCODE] = t0
                stamps[ENCODE] = perf_counter_ns()
            return out

        return serialize

    def received(self, msg) -> list[int]:
        """Stamps for a request whose handler now runs (its decode points filled in)."""
        stamps = [0] * N
        stamps[RECEIPT], stamps[DECODE] = self._decoded.pop(id(msg), (0, 0))
        stamps[HANDLER] = perf_counter_ns()
        return stamps

    def replying(self, reply, stamps: list[int]) -> None:
        """`reply` is built and about to be handed to gRPC."""
        stamps[REPLY] = perf_counter_ns()
        if len(self._replies) > self.ring.maxlen:  # replies of calls that ended before writing them
            self._replies.clear()
        self._replies[id(reply)] = stamps

    def written(self, reply) -> None:
        """`reply` has been handed to gRPC (stream) / its call is done (unary): keep its stamps."""
        stamps = self._replies.pop(id(reply), None)
        if stamps is not None:
            stamps[WRITE] = perf_counter_ns()
            self.ring.append(stamps)

    # -- reading it --------------------------------------------------------------------------
    def summary(self) -> dict[str, dict]:
        """{stage: {"n", "p50_ms", "p99_ms"}} over the ring, plus "total" (receipt to write);
        a stage is left out of requests that did not stamp both its ends."""
        rows = np.array(list(self.ring), dtype=np.int64).reshape(-1, N)
        out = {}
        for i in range(1, N):
            d = rows[:, i] - rows[:, i - 1]
            d = d[(rows[:, i] > 0) & (rows[:, i - 1] > 0)]
            if d.size:
                out[POINTS[i]] = _pct(d)
        ok = rows[(rows[:, RECEIPT] > 0) & (rows[:, WRITE] > 0)]
        if ok.size:
            out["total"] = _pct(ok[:, WRITE] - ok[:, RECEIPT])
        return out


def _pct(ns: np.ndarray) -> dict:
    return {"n": int(ns.size), "p50_ms": round(float(np.percentile(ns, 50)) / 1e6, 4),
            "p99_ms": round(float(np.percentile(ns, 99)) / 1e6, 4)}
