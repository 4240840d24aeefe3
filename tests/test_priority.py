"""Issue 50: two priority classes. The scheduler's rules (online work first at every step, FCFS within a
class, no batch work in a step with online work but one in ONLINE_STEPS_PER_FILL in a row, batch steps
capped, drop / counts across classes), then one real CPU
Tulip (the default model) on loopback: an online request sent through the real client overtakes batch
requests queued ahead of it (completion order, and Tulip's per-class metrics), an unknown class is
INVALID_ARGUMENT on both RPCs, and an Ivy in front of it passes the X-Trellis-Priority header and the
body's `priority` field on to Tulip's per-class metrics (a bad value: a 400 naming it)."""

import asyncio

import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import Proc, free_port, http_status, metric
from trellis.client import EmbedOptions, TulipClient
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.scheduler import BATCH, ONLINE, ONLINE_STEPS_PER_FILL, Entry, Scheduler


def req(*lens, priority=ONLINE):
    return Entry(lens, priority)


def drain(s: Scheduler) -> list[list[tuple[Entry, int]]]:
    batches = []
    while len(s):
        batches.append(s.next_batch())
    return batches


# ---- the scheduler (pure Python) ----

def test_classes_are_the_protos():
    assert (ONLINE, BATCH) == (tulip_pb2.PRIORITY_ONLINE, tulip_pb2.PRIORITY_BATCH)
    assert Entry((3,)).priority == ONLINE


def online_steps(s: Scheduler, n: int, length: int = 10) -> list:
    """Run `n` steps that each carry one online query of `length` tokens arriving just before it; their slots."""
    steps = []
    for _ in range(n):
        s.add(req(length))
        steps.append(s.next_batch())
    return steps


def test_online_overtakes_queued_batch_work():
    s = Scheduler(max_batch_tokens=100)
    b1, b2 = req(60, 60, priority=BATCH), req(50, priority=BATCH)
    s.add(b1)
    s.add(b2)
    assert s.next_batch() == [(b1, 0)]  # batch alone runs
    q = req(30)  # arrives while b1's second sequence and b2 wait
    s.add(q)
    assert s.next_batch() == [(q, 0)]  # online first, and alone: no batch work in its step
    assert s.next_batch() == [(b1, 1)]  # (b2's 50 would pass the budget)
    assert s.next_batch() == [(b2, 0)]
    assert len(s) == 0 and s.queued_tokens == 0 and s.batch_tokens == 0 and s.batch_live == 0


def test_fcfs_within_each_class():
    s = Scheduler(max_batch_tokens=1000)
    b = [req(10, priority=BATCH) for _ in range(3)]
    o = [req(10) for _ in range(3)]
    for x, y in zip(b, o):  # interleaved arrivals
        s.add(x)
        s.add(y)
    assert s.online_live == 3
    assert [e for e, _ in s.next_batch()] == o
    assert s.online_live == 0 and [e for e, _ in s.next_batch()] == b


def test_a_step_with_online_work_takes_no_batch_work():
    """Issue 50: the callers of a step wait for all of it, so an online step is not filled with batch work
    (before: a 1 x 128 probe's step on an H100 carried up to 2,048 batch tokens, --batch-step-tokens)."""
    s = Scheduler(max_batch_tokens=16384, batch_step_tokens=2048)
    s.add(job := req(*[512] * 100, priority=BATCH))
    assert [i for _, i in s.next_batch()] == [0, 1, 2, 3]  # batch alone: 2,048 tokens
    s.add(probe := req(128))
    assert s.next_batch() == [(probe, 0)]
    s.add(a := req(128))
    s.add(b := req(64, 64))
    assert s.next_batch() == [(a, 0), (b, 0), (b, 1)]  # online work in full, FCFS, and nothing else
    assert [(e, i) for e, i in s.next_batch()] == [(job, 4), (job, 5), (job, 6), (job, 7)]  # the job goes on


def test_one_online_step_in_four_in_a_row_takes_batch_work():
    """Batch work is never starved: of the steps in a row that carry online work while it waits, every
    ONLINE_STEPS_PER_FILL-th fills the budget the online work leaves; a batch-only step starts the count again."""
    assert ONLINE_STEPS_PER_FILL == 4
    s = Scheduler(max_batch_tokens=64)
    bulk = req(*[16] * 8, priority=BATCH)
    s.add(bulk)
    steps = online_steps(s, 4, length=40)
    assert [[e is bulk for e, _ in st] for st in steps] == [[False]] * 3 + [[False, True]]  # 40 + 16 of 64
    assert [len(st) for st in online_steps(s, 2, length=40)] == [1, 1]
    assert [e is bulk for e, _ in s.next_batch()] == [True] * 4  # no online work: batch alone, full budget
    assert [len(st) for st in online_steps(s, 4, length=40)] == [1, 1, 1, 2]  # the count began again
    assert [e is bulk for e, _ in s.next_batch()] == [True] * 2
    assert len(s) == 0 and s.queued_tokens == 0 and s.batch_tokens == 0
    # no batch work waiting: online steps do not count towards a fill
    s = Scheduler(max_batch_tokens=64)
    online_steps(s, 3)
    s.add(late := req(16, priority=BATCH))
    assert [len(st) for st in online_steps(s, 2)] == [1, 1] and s.batch_live == 1


def test_batch_never_starved_by_a_stream_of_online_work():
    s = Scheduler(max_batch_tokens=128)
    bulk = req(*[64] * 4, priority=BATCH)
    s.add(bulk)
    served = [sum(1 for e, _ in st if e is bulk) for st in online_steps(s, 16, length=64)]
    assert served == [0, 0, 0, 1] * 4 and len(s) == 0  # a query before every step: every fourth takes the 64 left


def test_batch_steps_are_capped_at_batch_step_tokens():
    """A step takes at most `batch_step_tokens` of batch work (online work arriving waits for the steps in
    flight: on an H100 a cap of 2,048 took an online p99 beside a job from 61.8 to 10.1 ms), and at most
    `online_batch_step_tokens` while online work is live (`live`: the engine loop's clock); one longer batch
    sequence still goes, alone; online work is not capped."""
    s = Scheduler(max_batch_tokens=1000, batch_step_tokens=100)
    job = req(40, 40, 40, 250, 40, priority=BATCH)
    s.add(job)
    assert [[job.lengths[i] for _, i in b] for b in drain(s)] == [[40, 40], [40], [250], [40]]
    s.add(job2 := req(60, 60, priority=BATCH))
    s.add(online := req(300, 300))
    first = s.next_batch()
    assert [(e is online, i) for e, i in first] == [(True, 0), (True, 1)]  # online in full
    assert s.next_batch() == [(job2, 0)] and s.next_batch() == [(job2, 1)]  # 120 > 100
    s = Scheduler(max_batch_tokens=1000, batch_step_tokens=100, online_batch_step_tokens=50)
    s.add(job := req(20, 20, 20, 20, 20, 20, 70, priority=BATCH))
    assert [len(s.next_batch(live=True)), len(s.next_batch()), len(s.next_batch(live=True))] == [2, 4, 1]
    assert Scheduler(100, batch_step_tokens=60).online_batch_step_tokens == 60  # 0: batch_step_tokens


def test_drop_and_counts_across_classes():
    s = Scheduler(max_batch_tokens=16)
    spanning, other, online = req(8, 8, 8, priority=BATCH), req(4, priority=BATCH), req(6)
    for r in (spanning, other, online):
        s.add(r)
    assert len(s) == 3 and s.queued_tokens == 34 and s.batch_tokens == 28 and s.batch_live == 2
    assert s.online_live == 1
    assert s.next_batch() == [(online, 0)]
    assert s.queued_tokens == 28 and s.batch_tokens == 28 and len(s) == 2 and s.online_live == 0
    assert s.next_batch() == [(spanning, 0), (spanning, 1)]
    assert s.queued_tokens == 12 and s.batch_tokens == 12 and len(s) == 2
    assert s.drop(spanning) and s.queued_tokens == 4 and s.batch_tokens == 4 and s.batch_live == 1 and len(s) == 1
    assert not s.drop(spanning) and not s.drop(online)  # nothing of them is queued
    o2 = req(5)
    s.add(o2)
    assert s.drop(o2) and s.batch_tokens == 4 and s.queued_tokens == 4 and len(s) == 1  # an online drop
    other.cancelled = True  # cancelled by its owner without drop(): skipped and counted off at the front
    assert s.next_batch() == [] and s.queued_tokens == 0 and s.batch_tokens == 0 and len(s) == 0


def test_sequence_cap_holds_across_classes():
    s = Scheduler(max_batch_tokens=1000, max_batch_seqs=3)
    s.add(b := req(1, 1, 1, 1, priority=BATCH))
    online_steps(s, ONLINE_STEPS_PER_FILL - 1, length=1)
    s.add(o := req(1, 1))
    assert s.next_batch() == [(o, 0), (o, 1), (b, 0)]  # the filled step: 3 sequences in all
    assert s.next_batch() == [(b, 1), (b, 2), (b, 3)]


# ---- a real Tulip (and Ivy) on loopback ----

SEQ, SEQS = 128, 4  # a batch request: 4 x 128 tokens, one step's whole budget (--max-batch-tokens 512)
BULK = 8  # batch requests queued
QUEUED = 'tulip_priority_queue_requests'


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("priority")
    tport, mport, iport = free_port(), free_port(), free_port()
    tulip = Proc(["-m", "tulip", "--model", "default", "--port", str(tport), "--device", "cpu",
                  "--max-batch-tokens", str(SEQ * SEQS), "--metrics-port", str(mport)], tmp)
    ivy = Proc(["-m", "ivy", "--port", str(iport), "--tulip", f"127.0.0.1:{tport}"], tmp)
    url = f"http://127.0.0.1:{iport}"
    try:
        tulip.wait_for(lambda: "TULIP_READY" in tulip.output())
        ivy.wait_for(lambda: http_status(url + "/ready") == 200, timeout=60)
        yield f"127.0.0.1:{tport}", f"http://127.0.0.1:{mport}/metrics", url
    finally:
        ivy.stop()
        tulip.stop()


def scrape(metrics_url: str) -> str:
    return httpx.get(metrics_url, timeout=5).text


def test_online_request_overtakes_queued_batch_work(stack):
    target, metrics_url, _ = stack
    rng = np.random.default_rng(0)
    bulk = [rng.integers(1000, 20000, (SEQS, SEQ)).astype(np.int32) for _ in range(BULK)]
    query = rng.integers(1000, 20000, (1, 64)).astype(np.int32)
    before = scrape(metrics_url)

    async def run():
        done: list[str] = []
        async with TulipClient(target) as c:  # one stream: Tulip's replies come back in completion order
            async def call(name, seqs, priority):
                await c.call(list(seqs), EmbedOptions(priority=priority))
                done.append(name)

            batch = [asyncio.ensure_future(call(f"b{i}", s, tulip_pb2.PRIORITY_BATCH)) for i, s in enumerate(bulk)]
            queued = 0
            for _ in range(400):  # until Tulip holds the batch work: one step runs, the rest waits
                await asyncio.sleep(0.01)
                text = await asyncio.to_thread(scrape, metrics_url)
                queued = metric(text, QUEUED, priority="batch")
                if queued >= BULK - 2:
                    break
            assert queued >= BULK - 2, f"only {queued} batch requests queued"
            await call("online", query, tulip_pb2.PRIORITY_ONLINE)
            await asyncio.gather(*batch)
        return done, int(queued)

    done, queued = asyncio.run(run())
    # FCFS within the class; the online request ahead of every batch request that was queued when it came
    # (but one, which may have started while the metrics were read): under FCFS it came last
    assert [d for d in done if d != "online"] == [f"b{i}" for i in range(BULK)]
    ahead_of = BULK - done.index("online")
    assert ahead_of >= queued - 1, done
    after = scrape(metrics_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tulip_priority_queue_seconds_count", priority="online") == 1
    assert delta("tulip_priority_queue_seconds_count", priority="batch") == BULK
    online_wait = delta("tulip_priority_queue_seconds_sum", priority="online")
    batch_wait = delta("tulip_priority_queue_seconds_sum", priority="batch") / BULK
    assert online_wait < batch_wait, (online_wait, batch_wait)  # at most a step against ~BULK/2 steps
    assert delta("tulip_queue_seconds_count") == BULK + 1  # the totals as before
    assert metric(after, QUEUED, priority="batch") == metric(after, QUEUED, priority="online") == 0
    assert metric(after, "tulip_priority_queue_tokens", priority="batch") == 0


def test_unknown_priority_is_invalid_argument(stack):
    target, _, _ = stack

    async def run():
        request = tulip_pb2.EmbedRequest(token_ids=np.arange(100, 108, dtype="<i4").tobytes(), lengths=[8],
                                         priority=7)  # proto3 keeps an unknown enum number as it is
        async with grpc.aio.insecure_channel(target) as ch:  # grpcio's own client: the unary RPC
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await tulip_pb2_grpc.TulipStub(ch).Embed(request, timeout=10)
        async with TulipClient(target) as c:  # the stream: a failed reply, the stream goes on
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                await c.call([np.arange(100, 108)], EmbedOptions(priority=7))
            ok = await c.embed([np.arange(100, 108)], priority=tulip_pb2.PRIORITY_BATCH)
        return unary.value, stream.value, ok

    unary, stream, ok = asyncio.run(run())
    for e in (unary, stream):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority 7" in e.details() and "PRIORITY_BATCH = 1" in e.details()
    assert ok.shape == (1, 384)


def test_ivy_passes_the_priority_on(stack):
    _, metrics_url, url = stack

    def counts():
        text = scrape(metrics_url)
        return tuple(metric(text, "tulip_priority_queue_seconds_count", priority=p) for p in ("online", "batch"))

    body = {"input": "a query"}
    with httpx.Client(base_url=url, timeout=30) as h:
        for headers, extra, want in (({"X-Trellis-Priority": "batch"}, {}, (0, 1)),
                                     ({"x-trellis-priority": "Online"}, {}, (1, 0)),
                                     ({}, {}, (1, 0)),  # the default
                                     ({}, {"priority": "batch"}, (0, 1)),
                                     ({"X-Trellis-Priority": "online"}, {"priority": "batch"}, (0, 1))):  # body wins
            c0 = counts()
            r = h.post("/v1/embeddings", json={**body, **extra}, headers=headers)
            assert r.status_code == 200, r.text
            assert tuple(b - a for a, b in zip(c0, counts())) == want, (headers, extra)
        for path, b in (("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
                        ("/v1/rerank", {"query": "a", "documents": ["b", "c"]})):
            c0 = counts()
            assert h.post(path, json={**b, "priority": "batch"}).status_code == 200
            assert tuple(y - x for x, y in zip(c0, counts())) == (0, 1), path
        r = h.post("/v1/embeddings", json=body, headers={"X-Trellis-Priority": "urgent"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Trellis-Priority"
        assert "'online' or 'batch'" in r.json()["error"]["message"]
        r = h.post("/v1/embeddings", json={**body, "priority": "urgent"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
