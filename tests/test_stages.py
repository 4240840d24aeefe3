"""Stage timestamps (tulip.stages): a request served through Tulip's server on loopback stamps
every point in order, unary and streamed; off, nothing is recorded."""

import asyncio

import grpc

import numpy as np
import pytest

from benchmarks.hop import NullEngine
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.config import TulipConfig
from tulip.h2server import Server
from tulip.loop import EngineLoop
from tulip.server import TulipServicer, add_tulip
from tulip.stages import POINTS


def serve(engine, stages: int, n: int = 5):
    """n unary requests, then n on one stream, through Tulip's server on loopback (grpcio's client)."""
    async def main():
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, stage_samples=stages))
        loop.start()
        server = Server()
        add_tulip(server, TulipServicer(loop, "t"))
        port = await server.listen("127.0.0.1", 0)
        msgs = [tulip_pb2.EmbedRequest(token_ids=np.full(k + 1, 7 + k, dtype="<i4").tobytes(), lengths=[k + 1],
                                       request_id=str(k)) for k in range(n)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tulip_pb2_grpc.TulipStub(ch)
            for m in msgs:
                assert list((await stub.Embed(m)).shape) == [1, engine.embedding_dim]
            call = stub.EmbedStream()
            for m in msgs:
                await call.write(m)
                assert not (await call.read()).error_code
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
        await server.stop(1)
        await loop.stop()
        return loop.stages

    return asyncio.run(main())


def test_every_point_is_stamped_in_order():
    rec = serve(NullEngine(20), stages=100)
    assert len(rec.ring) == 10  # five unary, five streamed
    for stamps in rec.ring:
        assert all(stamps), stamps
        assert stamps == sorted(stamps)
    summary = rec.summary()
    assert set(summary) == set(POINTS[1:]) | {"total"}
    assert all(s["n"] == 10 for s in summary.values())
    assert summary["wait"]["p50_ms"] > 10  # the null engine's steps take 20 ms
    assert not rec._decoded and not rec._replies  # every stamped message was claimed


def test_off_by_default():
    assert serve(NullEngine(0), stages=0) is None


def test_tail_rows_name_the_slow_stage_and_the_collections_in_it():
    """benchmarks.hop's per-request tail: client spans matched to Tulip's stamps by time, split into
    segments that add up to the client's time; a slow request is charged to the segment that grew,
    and a collection (of either process) overlapping it is counted."""
    from benchmarks.hop import TAIL_SEGMENTS, _segments, tail_rows

    us = 1000
    spans, stamps, t = [], [], 10**12
    for k in range(200):
        send = 50 * us + (3000 * us if k == 50 else 0)  # request 50: slow on the way in
        launch = 20 * us + (2000 * us if k == 120 else 0)  # request 120: a slow launch
        s = [t + send]
        for point in POINTS[1:]:
            s.append(s[-1] + (launch if point == "launch" else 1000 * us if point == "wait" else 5 * us))
        t1 = s[-1] + 80 * us
        spans.append((t, t1))
        stamps.append(s)
        t = t1 + 500 * us
    seg, sp = _segments(spans, stamps)
    assert seg.shape == (200, len(TAIL_SEGMENTS)) and (seg.sum(axis=1) == sp[:, 1] - sp[:, 0]).all()
    a0, b0 = spans[120]
    rows = tail_rows(spans, stamps, client_gcs=[], server_gcs=[(a0 + 100, a0 + 200, 0), (b0 + 10**6, b0 + 10**6 + 5, 2)],
                     q=99.0)
    by = {r["segment"]: r for r in rows}
    assert by["all"]["n"] == 200 and by["all"]["slow"] == 2
    assert by["send"]["slow_worst"] == 1 and by["launch"]["slow_worst"] == 1
    assert sum(r.get("slow_worst", 0) for r in rows if r["segment"] != "all") == 2
    assert by["launch"]["slow_excess_ms"] == pytest.approx(1.0, abs=0.01)  # 2 ms over, averaged over 2 slow ones
    assert by["all"]["gc_server_slow"] == 1 and by["all"]["gc_client_slow"] == 0 and by["all"]["gc_gens_slow"] == [1, 0, 0]
    assert by["all"]["gc_server"][0]["n"] == 1 and by["all"]["gc_server"][2]["n"] == 1


def test_hop_tail_only_emits_tail_rows_and_tailab_tables_them(tmp_path):
    """`benchmarks.hop --tail-only` serves only the stamping Tulip: hop-stages and hop-tail rows, which
    `benchmarks.tailab --table` lays out per variant."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "benchmarks.hop", "--device-ms", "1", "--n", "60", "--tail-only"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {x["bench"] for x in rows} == {"hop-stages", "hop-tail"}
    tail = [x for x in rows if x["bench"] == "hop-tail"]
    assert sorted({x["transport"] for x in tail}) == ["stream", "unary"]
    for transport in ("stream", "unary"):
        total = next(x for x in tail if x["transport"] == transport and x["segment"] == "all")
        assert total["n"] >= 55 and total["slow"] >= 1 and 1.0 < total["p50_ms"] <= total["p99_ms"]
    assert "tail, stream:" in r.stderr
    (tmp_path / "after.jsonl").write_text(r.stdout)
    t = subprocess.run([sys.executable, "-m", "benchmarks.tailab", "--table", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert len(t) == 4 and t[2].startswith("| after | stream |") and t[3].startswith("| after | unary |")
