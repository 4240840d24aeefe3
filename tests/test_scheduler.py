"""FCFS token-budget scheduler: order, budget, spanning, cancellation (pure Python)."""

import numpy as np
import pytest

from tulip.scheduler import Entry, Scheduler


def req(*lens):
    lengths = np.array(lens, dtype=np.int64)
    return Entry(lengths)


def test_budget_and_fcfs_order():
    s = Scheduler(max_batch_tokens=100)
    a, b, c = req(40, 40), req(30), req(10)
    for r in (a, b, c):
        s.add(r)
    assert s.queued_tokens == 120
    first = s.next_batch()
    assert [(r is a, i) for r, i in first] == [(True, 0), (True, 1)]  # 80 tokens; b (30) would exceed 100
    second = s.next_batch()
    assert [r for r, _ in second] == [b, c]
    assert s.next_batch() == [] and s.queued_tokens == 0


def test_request_spans_batches_and_never_overtaken():
    s = Scheduler(max_batch_tokens=64)
    bulk, later = req(*[32] * 5), req(9)
    s.add(bulk)
    s.add(later)
    batches = []
    while len(s):
        batches.append([(r, i) for r, i in s.next_batch()])
    assert [len(b) for b in batches] == [2, 2, 2]
    assert batches[-1] == [(bulk, 4), (later, 0)]  # the later query fills the last bulk batch's room


def test_nine_token_query_first_leaves_in_next_batch():
    s = Scheduler(max_batch_tokens=512)
    query, bulk = req(9), req(*[500] * 10)
    s.add(query)
    s.add(bulk)
    batch = s.next_batch()
    assert batch[0] == (query, 0)
    assert sum(int(r.lengths[i]) for r, i in batch) <= 512


def test_oversize_sequence_rejected_and_cancelled_skipped():
    s = Scheduler(max_batch_tokens=16)
    with pytest.raises(ValueError, match="exceeds the batch budget"):
        s.add(req(17))
    a, b = req(8, 8, 8), req(4)
    s.add(a)
    s.add(b)
    assert len(s.next_batch()) == 2
    s.drop(a)
    assert s.next_batch() == [(b, 0)]
    assert s.queued_tokens == 0 and len(s) == 0


def test_drop_frees_queued_tokens_at_once():
    s = Scheduler(max_batch_tokens=16)
    spanning, other = req(8, 8, 8), req(4)
    s.add(spanning)
    s.add(other)
    assert s.next_batch() == [(spanning, 0), (spanning, 1)]
    assert s.drop(spanning) and spanning.cancelled and s.queued_tokens == 4 and len(s) == 1  # third sequence gone
    assert not s.drop(spanning)  # nothing of it is queued any more
    assert s.next_batch() == [(other, 0)] and s.queued_tokens == 0 and len(s) == 0
    assert not s.drop(other) and not other.cancelled  # fully batched already: left to complete


def test_held_work_waits_in_place_and_goes_back_to_the_front():
    """hold(): an entry's queued sequences leave the counts and batching (its caller takes no replies);
    resume(): back where it was, or at the front for one that reached the front while held; drop() of a
    held entry cancels it."""
    s = Scheduler(max_batch_tokens=20)
    a, b, c, d = req(10, 10, 10), req(5), req(5), req(5)
    for r in (a, b, c, d):
        s.add(r)
    assert [(r, i) for r, i in s.next_batch()] == [(a, 0), (a, 1)]
    assert s.hold(a) and s.hold(c) and not s.hold(a)
    assert (s.queued_tokens, s.held_tokens, len(s)) == (10, 15, 2)
    assert [r for r, _ in s.next_batch()] == [b, d]  # a (at the front: taken off) and c skipped
    assert s.next_batch() == [] and (a.held, c.held) == (2, 2)
    s.resume([a, c])
    assert (s.queued_tokens, s.held_tokens, len(s)) == (15, 0, 2)
    e = req(5)
    s.add(e)
    assert [(r, i) for r, i in s.next_batch()] == [(a, 2), (c, 0), (e, 0)]  # back at the front, in order
    f, g = req(5), req(5)
    s.add(f)
    s.add(g)
    s.hold(f)
    s.resume([f])  # never reached the front: still in its place
    assert [r for r, _ in s.next_batch()] == [f, g]
    s.add(h := req(5))
    s.hold(h)
    assert s.drop(h) and h.cancelled and s.held_tokens == 0 and not s.drop(h)
    s.resume([h])
    assert s.next_batch() == [] and s.queued_tokens == 0


def test_the_online_lane_asks_for_online_and_batch_steps_apart():
    """With an online lane the loop takes an online step without batch fill (`fill=False`, even where the
    fourth online step in a row would fill) and a batch-only step while online work waits (`batch_only`)."""
    from tulip.scheduler import BATCH, ONLINE_STEPS_PER_FILL

    s = Scheduler(512, batch_step_tokens=256)
    job = Entry([128] * 8, priority=BATCH)
    s.add(job)
    for _ in range(ONLINE_STEPS_PER_FILL):  # one online request at each step: the fourth would fill
        e = Entry([64])
        s.add(e)
        assert s.next_batch(fill=False) == [(e, 0)]
    last = Entry([64])
    s.add(last)
    assert s.next_batch(batch_only=True) == [(job, 0), (job, 1)]  # online work waits; batch_step_tokens 256
    assert s.online_live == 1 and s.next_batch(fill=False) == [(last, 0)]
    assert s.queued_tokens == 6 * 128 and s.batch_tokens == 6 * 128
    s.add(e := Entry([64]))
    assert s.next_batch() == [(e, 0)]  # steps taken with fill=False left the one-stream count of steps alone
