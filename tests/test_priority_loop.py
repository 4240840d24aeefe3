"""Issue 50: what an online request waits for beside a bulk job in Tulip's engine loop.

On a GPU-like device (tests/test_overlap.py's fake: steps queue on one timeline and take STEP_S each, launched
inline, two in flight): a job of batch requests keeps two batch steps in flight while no online work is live;
an online request that arrives within ONLINE_LIVE_S of the one before finds at most one batch step ahead of it
and its own step carries no batch work; once the window passes the job has two in flight again.
On the CPU with the real engine (all-MiniLM-L6-v2): the online request's step is its own, and every request's
rows are the engine's."""

import asyncio
import time

import numpy as np
import pytest
import torch

import tulip.loop
from rose.batch import Batch
from benchmarks.hop import TimedEvent
from rose.lazy import LazyTensor
from tests.test_overlap import STEP_S, FakeGpuEngine, Timeline
from tulip.config import TulipConfig
from tulip.loop import EngineLoop, Request
from tulip.scheduler import BATCH

JOB = 1  # the job's token id; a probe's is 900 + its number


class Recording(FakeGpuEngine):
    """The fake device, and the token ids of each step it ran (in launch order, as the timeline's)."""

    def __init__(self, tl: Timeline):
        super().__init__(tl)
        self.ids: list[set] = []

    def step(self, batch, extras=frozenset(), urgent=False):
        lazy = super().step(batch, extras)
        self.ids.append(set(batch.input_ids.tolist()))
        return lazy


def overlapping(tl: Timeline, kinds: list, start: float, end: float) -> int:
    """The most batch-only steps on the device at once among those launched in [start, end)."""
    most = 0
    for k, t in enumerate(tl.launched):
        if start <= t < end and kinds[k]:
            most = max(most, sum(1 for j in range(k + 1) if kinds[j] and tl.done_at[j] > t))
    return most


def job_with_probes(engine, jobs: int, settle_steps: float, probes: int, gap_steps: float):
    """A job of `jobs` batch requests (4 x 128 tokens of JOB) on a loop of max_inflight 2; after `settle_steps`
    step times, `probes` online requests of 64 tokens one at a time, `gap_steps` apart. Checks every reply's rows;
    returns each probe's (arrival, wait)."""
    cfg = TulipConfig(max_batch_tokens=512, max_inflight=2, spin_ms=0.0)

    async def main():
        loop = EngineLoop(engine, cfg)
        loop.start()
        job = [Request(np.full(512, JOB, dtype=np.int32), [128] * 4, priority=BATCH) for _ in range(jobs)]
        done = [asyncio.ensure_future(loop.submit(r)) for r in job]
        await asyncio.sleep(settle_steps * STEP_S)
        times = []
        for p in range(probes):
            t = time.monotonic()
            row = await loop.submit(Request(np.full(64, 900 + p, dtype=np.int32), [64]))
            times.append((t, time.monotonic() - t))
            assert int(row[0, 0]) == 900 + p
            await asyncio.sleep(gap_steps * STEP_S)
        rows = await asyncio.gather(*done)
        await loop.stop()
        assert all(r.shape == (4, 4) and (r == JOB).all() for r in rows)
        return times

    return asyncio.run(main())


def test_an_online_arrival_waits_for_at_most_one_batch_step(monkeypatch):
    live_s = 0.25
    monkeypatch.setattr(tulip.loop, "ONLINE_LIVE_S", live_s)  # (1 s in Tulip: shortened to keep the test short)
    tl = Timeline()
    engine = Recording(tl)
    probes = 6
    arrivals = [t for t, _ in job_with_probes(engine, 80, 10, probes, 1.5)]  # 10 steps of the job alone first
    kinds = [ids == {JOB} for ids in engine.ids]  # batch-only steps
    ahead = []
    for p, t in enumerate(arrivals):
        (k,) = [k for k, ids in enumerate(engine.ids) if 900 + p in ids]
        assert engine.ids[k] == {900 + p}, f"probe {p}'s step carried {engine.ids[k]}"  # no batch work beside it
        ahead.append(sum(1 for j in range(k) if kinds[j] and tl.done_at[j] > t))
    # the first probe finds the job with two steps in flight (online work was not live); each later one, one
    assert ahead[0] <= 2 and max(ahead[1:]) <= 1, ahead
    assert overlapping(tl, kinds, 0.0, arrivals[0]) == 2  # the job alone: two in flight
    assert overlapping(tl, kinds, arrivals[0] + STEP_S, arrivals[-1] + live_s) == 1
    assert overlapping(tl, kinds, arrivals[-1] + live_s + 2 * STEP_S, float("inf")) == 2  # the window passed
    assert sum(kinds) == len(kinds) - probes  # every job step was batch-only: 80 x 4 x 128 in 80 steps
    assert len(kinds) == 80 + probes


class TwoLanes(Recording):
    """The fake device with an online lane (`Engine.lane`): an urgent step runs beside the bulk steps on a
    timeline of its own (taking LANE_S, a small step's time), so it can finish before a step launched earlier."""

    LANE_S = STEP_S / 4

    def __init__(self, tl: Timeline):
        super().__init__(tl)
        self.lane = Timeline()
        self.urgent: list[bool] = []

    def step(self, batch, extras=frozenset(), urgent=False):
        self.urgent.append(urgent)
        if not urgent:
            return super().step(batch, extras)
        done = self.lane.take(self.LANE_S)
        self.ids.append(set(batch.input_ids.tolist()))
        out = batch.input_ids[batch.cu_seqlens[:-1].long()].float().unsqueeze(1).repeat(1, 4)
        return LazyTensor(out, TimedEvent(done))


def test_with_an_online_lane_a_probe_completes_before_the_bulk_step_ahead_of_it():
    """Steps complete out of launch order where the engine runs online steps beside the rest: a probe that
    arrives while a bulk step runs is answered in about its own step's time (LANE_S), not after that step
    (STEP_S); every bulk request still gets its own rows. On a one-stream engine the loop kept FIFO completion,
    and each probe waited for the bulk step ahead of it."""
    tl = Timeline()
    engine = TwoLanes(tl)
    probes = 6
    waits = [w for _, w in job_with_probes(engine, 40, 3, probes, 1.3)]
    kinds = [ids == {JOB} for ids in engine.ids]
    assert len(tl.launched) == 40 and engine.urgent == [not k for k in kinds]  # probes (alone in their steps) urgent, the job's steps not
    assert sum(engine.urgent) == probes
    # a bulk step was on the device at each probe's arrival, yet each probe came back in well under one
    assert max(waits) < 0.7 * STEP_S, [round(w / STEP_S, 2) for w in waits]
    # and the job kept two steps in flight throughout (the lane's steps are not on its timeline)
    assert overlapping(tl, [True] * len(tl.launched), 0.0, float("inf")) == 2
    assert min(sum(1 for j in range(k) if tl.done_at[j] > t) for k, t in enumerate(tl.launched) if k > 1) == 1


def test_on_the_cpu_an_online_request_runs_in_a_step_of_its_own(engine):
    """The real engine on the CPU (one step at a time there): an online request that arrives while a batch
    step runs goes next, alone (before: with three of the next batch request's sequences beside it)."""
    steps = []

    class Steps:  # the loop's tracing hooks (tulip.tracing): which requests each step carried
        @staticmethod
        def launched(step):
            steps.append([(r.tag, i) for r, i in step.slots])

        @staticmethod
        def completed(step, now):
            pass

    rng = np.random.default_rng(0)
    job = [rng.integers(1000, 20000, 512).astype(np.int32) for _ in range(3)]
    query = rng.integers(1000, 20000, 64).astype(np.int32)

    async def main():
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, device="cpu"))
        loop.start()
        loop.tracing = Steps
        reqs = [Request(ids, [128] * 4, priority=BATCH) for ids in job]
        for n, r in enumerate(reqs):
            r.tag = f"b{n}"
        done = [asyncio.ensure_future(loop.submit(r)) for r in reqs]
        await asyncio.sleep(0)
        assert steps == [[("b0", i) for i in range(4)]]  # b0's step runs
        online = Request(query, [64])
        online.tag = "online"
        got = await loop.submit(online)
        rows = await asyncio.gather(*done)
        await loop.stop()
        return got, rows

    got, rows = asyncio.run(main())
    assert steps[1] == [("online", 0)]  # on the old rule: [online, b1 0, b1 1, b1 2]
    assert steps[2:] == [[(f"b{n}", i) for i in range(4)] for n in (1, 2)]
    want = engine.step(Batch.from_sequences([query])).synchronize()
    torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=0)
    want = engine.step(Batch.from_sequences([job[2][i * 128:(i + 1) * 128] for i in range(4)])).synchronize()
    torch.testing.assert_close(torch.from_numpy(rows[2]), want, atol=1e-5, rtol=0)


def test_with_an_online_lane_a_probe_is_launched_beside_a_bulk_step_whatever_the_queue_holds():
    """Review of 6dce07e: the overlap rule (a step launched while another runs waits for a quarter of the budget
    queued) held a probe back behind the bulk step in flight when the job had nothing more queued; with a lane
    the probe's step runs beside the bulk step, so a probe with no online step in flight goes at once."""
    engine = TwoLanes(Timeline())

    async def main():
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, max_inflight=2, spin_ms=0.0))
        loop.start()
        job = [asyncio.ensure_future(loop.submit(Request(np.full(512, JOB, dtype=np.int32), [128] * 4,
                                                         priority=BATCH))) for _ in range(2)]
        await asyncio.sleep(0.2 * STEP_S)  # both job steps in flight, nothing queued
        t = time.monotonic()
        row = await loop.submit(Request(np.full(16, 900, dtype=np.int32), [16]))
        wait = time.monotonic() - t
        await asyncio.gather(*job)
        await loop.stop()
        return row, wait

    row, wait = asyncio.run(main())
    assert int(row[0, 0]) == 900 and engine.urgent == [False, False, True]
    # (before: 2.06, behind both bulk steps; its own step takes 0.25)
    assert wait < STEP_S, f"the probe waited {wait / STEP_S:.2f} bulk steps"


class Stretched(TwoLanes):
    """TwoLanes whose first bulk step takes 5 STEP_S and whose waiter sees it done 3 STEP_S late (a waiter thread
    busy elsewhere): the bulk step launched after it is on the same stream, so it is done later, and is found by
    polling while the first still waits in its thread."""

    def step(self, batch, extras=frozenset(), urgent=False):
        lazy = super().step(batch, extras, urgent)
        if not urgent and len(self.tl.launched) == 1:
            done = self.tl.done_at[0] + 4 * STEP_S
            self.tl.done_at[0] = self.tl.free_at = done
            late = TimedEvent(done)
            late.synchronize = lambda: time.sleep(max(0.0, done + 3 * STEP_S - time.monotonic()))
            lazy = LazyTensor(lazy._host, late)
        return lazy


def test_with_an_online_lane_steps_of_one_stream_complete_in_launch_order():
    """Review of 6dce07e: with a lane a step found done by polling was completed while an older step of the same
    stream (done before it: stream order) still waited in a thread; that older step's result lives in a ring slot
    (rose.graphs: reused `ring` launches later) that the steps launched meanwhile could overwrite before it is
    copied. A step completes only after the older ones that are done."""
    engine = Stretched(Timeline())
    order = []

    class Completed:  # the loop's tracing hooks (tulip.tracing)
        @staticmethod
        def launched(step):
            pass

        @staticmethod
        def completed(step, now):
            order.append(int(step.slots[0][0].ids[0]))

    async def main():
        # spin 4 STEP_S: the first step (5) goes to its waiter, the second (done at 6) is polled from 3
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, max_inflight=2, spin_ms=4000 * STEP_S))
        loop.start()
        loop.tracing = Completed
        first = asyncio.ensure_future(loop.submit(Request(np.full(512, 1, dtype=np.int32), [512], priority=BATCH)))
        await asyncio.sleep(3 * STEP_S)
        second = loop.submit(Request(np.full(512, 2, dtype=np.int32), [512], priority=BATCH))
        rows = await asyncio.gather(first, second)
        await loop.stop()
        return rows

    rows = asyncio.run(main())
    assert [int(r[0, 0]) for r in rows] == [1, 2]
    assert order == [1, 2], order


def test_one_stream_a_request_schedules_no_poll_while_the_oldest_step_waits_in_its_thread():
    """Review of 6dce07e: on a one-stream engine the loop polls the oldest step alone; while its waiter thread
    owns it, a request's arrival (each runs `_pump`) scheduled a `_watch` that found nothing to poll (one callback
    per request on the event loop). As before 6dce07e: one poll per step handed over."""
    engine = FakeGpuEngine(Timeline())
    calls = 0

    async def main():
        nonlocal calls
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, max_inflight=2, spin_ms=0.0))
        loop.start()
        watch = loop._watch

        def counted():
            nonlocal calls
            calls += 1
            watch()

        loop._watch = counted
        reqs = [asyncio.ensure_future(loop.submit(Request(np.full(512, 1, dtype=np.int32), [512])))]
        await asyncio.sleep(0.2 * STEP_S)  # launched, in its waiter thread
        for _ in range(40):  # too few tokens to launch a second step beside it: they wait and go together
            reqs.append(asyncio.ensure_future(loop.submit(Request(np.full(2, 2, dtype=np.int32), [2]))))
            await asyncio.sleep(0)
        rows = await asyncio.gather(*reqs)
        await loop.stop()
        return rows

    rows = asyncio.run(main())
    assert [int(r[0, 0]) for r in rows] == [1] + [2] * 40
    assert len(engine.tl.launched) == 2 and calls <= 2 * len(engine.tl.launched), calls


class WithImages(TwoLanes):
    """The two-lane fake with an image tower: an image step runs on the main timeline, as the engine's do."""

    def __init__(self, tl: Timeline):
        super().__init__(tl)
        self.image_size, self.image_tokens, self.image_batch = 2, 16, 8

    def step_images(self, pixels):
        return LazyTensor(torch.zeros(pixels.shape[0], 4), TimedEvent(self.tl.take()))


def test_with_an_online_lane_text_goes_beside_image_steps_that_have_the_turn():
    """Image steps hold max_inflight and still wait (their turn): an online text request goes to the lane at once,
    not after an image step completes (the image branch used to end the pump where it had no room)."""
    engine = WithImages(Timeline())
    cfg = TulipConfig(max_batch_tokens=512, max_inflight=2, spin_ms=0.0)

    async def main():
        loop = EngineLoop(engine, cfg)
        loop.start()
        pictures = [Request(None, [16] * 8, pixels=np.zeros((8, 2, 2, 3), np.uint8)) for _ in range(4)]
        done = [asyncio.ensure_future(loop.submit(r)) for r in pictures]
        await asyncio.sleep(0.2 * STEP_S)  # two image steps in flight, two requests of images waiting
        assert len(loop._inflight) == 2 and len(loop.images) == 2
        t = time.monotonic()
        row = await loop.submit(Request(np.full(64, 901, dtype=np.int32), [64]))
        wait = time.monotonic() - t
        await asyncio.gather(*done)
        await loop.stop()
        return row, wait

    row, wait = asyncio.run(main())
    assert int(row[0, 0]) == 901 and wait < 0.7 * STEP_S, wait / STEP_S
