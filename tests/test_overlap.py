"""Tulip's engine loop against a fake GPU whose steps take a known device time: batch N+1 is
launched while batch N runs (host work hidden), FCFS order holds, and wall time stays near the
device floor."""

import asyncio
import threading
import time
import types

import numpy as np
import pytest
import torch

from benchmarks.hop import TimedEvent
from rose.lazy import LazyTensor
from tulip.config import TulipConfig
from tulip.loop import EngineLoop
from tulip.loop import Request

STEP_S = 0.02


class Timeline:
    """A fake device: steps run back to back; each completes STEP_S after the previous one."""

    def __init__(self):
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.launched: list[float] = []
        self.done_at: list[float] = []

    def take(self, step_s: float = STEP_S) -> float:
        """A step launched now: when it is done, `step_s` after the previous one (or now), recorded."""
        now = time.monotonic()
        with self.lock:
            done = max(now, self.free_at) + step_s
            self.free_at = done
            self.launched.append(now)
            self.done_at.append(done)
        return done


class FakeGpuEngine:
    def __init__(self, timeline: Timeline):
        self.tl = timeline
        self.device = torch.device("cuda")  # steps are launched inline, as on a GPU
        self.embedding_dim = 4
        self.dtype = torch.float32
        self.spec = types.SimpleNamespace(max_seq_len=512, vocab_size=1000, pooling="mean", normalize=False,
                                          special_token_ids=(), quantized_outputs=False)
        self.extra_outputs = ()
        self.sparse_rows = False
        self.image_size = 0  # text only

    def step(self, batch, extras=frozenset(), urgent=False):
        done = self.tl.take()
        # Each row carries its sequence's first token id, so results can be checked.
        out = batch.input_ids[batch.cu_seqlens[:-1].long()].float().unsqueeze(1).repeat(1, 4)
        return LazyTensor(out, TimedEvent(done))


def run_requests(max_inflight: int, n: int = 30, spin_ms: float = 10.0):
    tl = Timeline()
    cfg = TulipConfig(max_batch_tokens=512, max_inflight=max_inflight, spin_ms=spin_ms)

    async def main():
        loop = EngineLoop(FakeGpuEngine(tl), cfg)
        loop.start()
        t0 = time.monotonic()
        reqs = [Request(np.full(512, i, dtype=np.int32), np.array([512])) for i in range(n)]
        outs = await asyncio.gather(*(loop.submit(r) for r in reqs))
        wall = time.monotonic() - t0
        await loop.stop()
        return outs, wall

    outs, wall = asyncio.run(main())
    in_flight = max(sum(1 for s, d in zip(tl.launched, tl.done_at) if s <= t < d) for t in tl.launched)
    return outs, wall, in_flight


@pytest.mark.parametrize("spin_ms", [0.0, 10.0, 100.0])  # waiter thread only, polled then thread, polled only
def test_overlap_hides_host_work(spin_ms):
    n = 30
    outs, wall, in_flight = run_requests(max_inflight=2, n=n, spin_ms=spin_ms)
    assert [int(o[0, 0]) for o in outs] == list(range(n))  # every request got its own row, FCFS
    assert in_flight == 2  # batch N+1 was launched while batch N was running
    floor = n * STEP_S
    assert floor <= wall < floor * 1.15 + 0.05, (wall, floor)


def test_one_step_in_flight_when_asked():
    _, _, in_flight = run_requests(max_inflight=1, n=10)
    assert in_flight == 1


class FailingEvent(TimedEvent):
    """A step that fails on the device: its result cannot be read."""

    def synchronize(self):
        super().synchronize()
        raise RuntimeError("device-side assert")


class PoisonEngine(FakeGpuEngine):
    """Token 666 fails the step at launch, token 777 fails it on the device; others succeed."""

    def step(self, batch, extras=frozenset(), urgent=False):
        ids = set(batch.input_ids.tolist())
        if 666 in ids:
            raise RuntimeError("launch failed")
        lazy = super().step(batch, extras)
        if 777 in ids:
            return LazyTensor(lazy._host, FailingEvent(lazy._event.t))
        return lazy


def test_a_failed_step_fails_only_its_requests():
    cfg = TulipConfig(max_batch_tokens=8, max_inflight=2)

    async def main():
        loop = EngineLoop(PoisonEngine(Timeline()), cfg)
        loop.start()
        reqs = [Request(np.full(8, t, dtype=np.int32), np.array([8])) for t in (1, 666, 2, 777, 3)]
        out = await asyncio.gather(*(loop.submit(r) for r in reqs), return_exceptions=True)
        await loop.stop()
        return out

    out = asyncio.run(main())
    assert [int(o[0, 0]) for o in (out[0], out[2], out[4])] == [1, 2, 3]
    assert isinstance(out[1], RuntimeError) and "launch failed" in str(out[1])
    assert isinstance(out[3], RuntimeError) and "device-side assert" in str(out[3])


def test_cancelled_and_expired_requests_leave_the_others_alone():
    """A request spanning several steps is cancelled midway; another expires in the queue; the
    rest complete in order and nothing is delivered twice."""
    cfg = TulipConfig(max_batch_tokens=8, max_inflight=1, spin_ms=0)

    async def main():
        loop = EngineLoop(FakeGpuEngine(Timeline()), cfg)
        loop.start()
        first = Request(np.full(8, 1, dtype=np.int32), np.array([8]))
        spanning = Request(np.full(32, 2, dtype=np.int32), np.array([8, 8, 8, 8]))  # four steps
        late = Request(np.full(8, 3, dtype=np.int32), np.array([8]))
        last = Request(np.full(8, 4, dtype=np.int32), np.array([8]))
        calls = []
        late.on_done = lambda r, rows, err: calls.append(err)
        late.deadline = time.monotonic() + STEP_S / 2  # passes while `first` runs
        t_first = asyncio.ensure_future(loop.submit(first))
        t_span = asyncio.ensure_future(loop.submit(spanning))
        await asyncio.sleep(0)  # both queued
        loop.submit_nowait(late)
        t_last = asyncio.ensure_future(loop.submit(last))
        await asyncio.sleep(STEP_S * 1.5)  # `first` done, `spanning` has started
        t_span.cancel()
        results = await asyncio.gather(t_first, t_last)
        await loop.stop()
        return results, calls, t_span

    (first, last), calls, t_span = asyncio.run(main())
    assert int(first[0, 0]) == 1 and int(last[0, 0]) == 4
    assert t_span.cancelled()
    assert len(calls) == 1 and isinstance(calls[0], TimeoutError)


def test_a_few_queued_tokens_wait_for_the_running_step():
    """While a step runs, a small request (under a quarter of the batch budget) is not given a
    step of its own: it goes in the next one, launched when the running step completes."""
    tl = Timeline()
    cfg = TulipConfig(max_batch_tokens=512, max_inflight=2)

    async def main():
        loop = EngineLoop(FakeGpuEngine(tl), cfg)
        loop.start()
        big = asyncio.ensure_future(loop.submit(Request(np.full(512, 1, dtype=np.int32), np.array([512]))))
        await asyncio.sleep(0)
        small = [loop.submit(Request(np.full(16, 2 + i, dtype=np.int32), np.array([16]))) for i in range(3)]
        out = await asyncio.gather(big, *small)
        await loop.stop()
        return out

    out = asyncio.run(main())
    assert [int(o[0, 0]) for o in out] == [1, 2, 3, 4]
    assert len(tl.launched) == 2  # the three small requests shared one step...
    assert tl.launched[1] >= tl.done_at[0] - 1e-3  # ...launched once the big one was done


def test_a_failing_completion_callback_does_not_stall_the_loop():
    cfg = TulipConfig(max_batch_tokens=8, max_inflight=2)

    async def main():
        loop = EngineLoop(FakeGpuEngine(Timeline()), cfg)
        loop.start()
        bad = Request(np.full(8, 9, dtype=np.int32), np.array([8]))
        bad.on_done = lambda r, rows, err: 1 / 0
        loop.submit_nowait(bad)
        out = await asyncio.gather(*(loop.submit(Request(np.full(8, t, dtype=np.int32), np.array([8])))
                                     for t in (1, 2, 3)))
        await loop.stop()
        return out

    assert [int(o[0, 0]) for o in asyncio.run(main())] == [1, 2, 3]


class StickyErrorEvent(TimedEvent):
    """A device with a sticky error: querying the event raises as well as waiting on it."""

    def query(self):
        raise RuntimeError("CUDA error: device-side assert triggered")

    def synchronize(self):
        raise RuntimeError("CUDA error: device-side assert triggered")


class StickyEngine(FakeGpuEngine):
    def step(self, batch, extras=frozenset(), urgent=False):
        lazy = super().step(batch, extras)
        return LazyTensor(lazy._host, StickyErrorEvent(lazy._event.t))


@pytest.mark.parametrize("spin_ms", [0.0, 100.0])
def test_an_event_that_raises_fails_the_requests_instead_of_hanging(spin_ms):
    cfg = TulipConfig(max_batch_tokens=8, max_inflight=2, spin_ms=spin_ms)

    async def main():
        loop = EngineLoop(StickyEngine(Timeline()), cfg)
        loop.start()
        reqs = [Request(np.full(8, t, dtype=np.int32), np.array([8])) for t in (1, 2, 3)]
        out = await asyncio.wait_for(asyncio.gather(*(loop.submit(r) for r in reqs), return_exceptions=True), 10)
        await asyncio.wait_for(loop.stop(), 10)
        return out

    assert all(isinstance(o, RuntimeError) and "device-side assert" in str(o) for o in asyncio.run(main()))


def test_stop_fails_what_is_still_running_after_its_timeout():
    class Wedged(FakeGpuEngine):
        def step(self, batch, extras=frozenset(), urgent=False):
            lazy = super().step(batch, extras)
            return LazyTensor(lazy._host, TimedEvent(time.monotonic() + 0.5))  # outlives stop()

    async def main():
        loop = EngineLoop(Wedged(Timeline()), TulipConfig(max_batch_tokens=8, spin_ms=0))
        loop.start()
        t = asyncio.ensure_future(loop.submit(Request(np.full(8, 1, dtype=np.int32), np.array([8]))))
        await asyncio.sleep(0.01)
        await loop.stop(timeout=0.05)
        out = await asyncio.gather(t, return_exceptions=True)
        await asyncio.sleep(0.6)  # the step's waiter comes back after stop(): nothing left to complete
        return out

    (err,) = asyncio.run(main())
    assert isinstance(err, RuntimeError) and "stopping" in str(err)


def test_a_deadline_passing_while_the_request_runs_lets_it_finish():
    """Deadlines drop only queued work: a request already running when its deadline passes is answered."""
    async def main():
        loop = EngineLoop(FakeGpuEngine(Timeline()), TulipConfig(max_batch_tokens=8))
        loop.start()
        got = asyncio.get_running_loop().create_future()
        r = Request(np.full(8, 5, dtype=np.int32), np.array([8]),
                    on_done=lambda req, rows, err: got.set_result((rows, err)))
        r.deadline = time.monotonic() + STEP_S / 4  # passes mid-step
        loop.submit_nowait(r)
        out = await asyncio.wait_for(got, 5)
        await loop.stop()
        return out

    rows, err = asyncio.run(main())
    assert err is None and int(rows[0, 0]) == 5
