"""Where Engine.step's host time goes: back to back, after idle gaps, in Tulip's loop, and served over gRPC.

    python -m benchmarks.step_host OUTDIR [--model preset:bge-m3] [--n 1500]       # OUTDIR/step_host.jsonl

Wraps GraphRunner / CudaOps methods (class level) with wall and thread-CPU timers, then runs:
  b2b     engine.step + synchronize back to back (as benchmarks.engine)
  sleep   the same with a 0.5 ms time.sleep between steps
  spin    the same with a 0.5 ms busy wait between steps
  loop    Tulip's EngineLoop in-process (submit -> result, benchmarks.hop's in-process row)
  stream  Tulip's servicer over gRPC, benchmarks.hop's trellis.client in another process
  unary   the same, unary
Prints and writes one JSON line per (scenario, part): p50 / p90 wall us and p50 CPU us; per served
scenario also each busy thread's share of a core (`part: "thread"`) and the client's p50 / p99. The
server is Tulip's own (`tulip.h2server`), as `python -m tulip` serves. A probe: the parts are timed
by wrappers set on the classes, which add a little to each.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder

W, C = time.perf_counter_ns, time.thread_time_ns
PARTS: dict[str, list] = {}
# benchmarks.hop's client, in a process of its own: 200 requests of warm-up, then the timed ones
CLIENT = ("import asyncio, json, sys; from benchmarks.hop import _measure; "
          "print(json.dumps(asyncio.run(_measure(sys.argv[1], sys.argv[2], int(sys.argv[3])))))")


def wrap(owner, name, label):
    f = getattr(owner, name)
    acc = PARTS.setdefault(label, [])

    def w(*a, **k):
        t0, c0 = W(), C()
        r = f(*a, **k)
        acc.append((W() - t0, C() - c0))
        return r

    setattr(owner, name, w)


def install():
    from rose import graphs
    from rose.engine import Engine

    wrap(Engine, "step", "engine.step")
    wrap(graphs.GraphRunner, "step", "runner.step")
    wrap(graphs.GraphRunner, "_next_slot", "next_slot")
    wrap(graphs.GraphRunner, "_stage", "stage")
    wrap(graphs.GraphRunner, "_run_key", "run_key(launch)")
    wrap(graphs.GraphRunner, "key", "key")
    if hasattr(graphs, "_checked_copy"):  # the driver copies, bound once per buffer pair (an older tree: CudaOps.copy)
        wrap(graphs, "_checked_copy", "driver copies (x2)")
    else:
        wrap(graphs.CudaOps, "copy", "ops.copy(x2)")
    wrap(graphs.CudaOps, "use_stream", "use_stream")


def threads() -> dict:
    """tid -> (name, utime + stime in clock ticks, last CPU) of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[tid] = (name, int(f[11]) + int(f[12]), int(f[36]))
        except OSError:
            pass
    return out


def thread_usage(rec: Recorder, before: dict, after: dict, seconds: float, scenario: str):
    tick = os.sysconf("SC_CLK_TCK")
    for tid, (name, t, cpu) in after.items():
        used = (t - before.get(tid, (name, 0, 0))[1]) / tick
        if used > 0.01 * seconds:
            rec.emit(scenario=scenario, part="thread", tid=tid, name=name, cpu_share=round(used / seconds, 3),
                     last_cpu=cpu)


def summary(rec: Recorder, scenario: str, skip: int):
    for label, v in PARTS.items():
        v = v[skip:]
        if v:
            a = np.array(v, dtype=np.float64) / 1e3
            rec.emit(scenario=scenario, part=label, n=len(a), wall_p50_us=round(float(np.median(a[:, 0])), 1),
                     wall_p90_us=round(float(np.percentile(a[:, 0], 90)), 1),
                     cpu_p50_us=round(float(np.median(a[:, 1])), 1))
    for v in PARTS.values():
        v.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--n", type=int, default=1500, help="steps (requests) per scenario")
    args = ap.parse_args(argv)
    n = args.n
    install()
    import torch

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig

    rec = Recorder(args.out, "step_host")
    rec.env["model"] = args.model
    e = Engine(EngineConfig(model=args.model, compile=torch.cuda.is_available()))
    ids = np.arange(5, 133, dtype=np.int32)
    for _ in range(10):
        e.step(Batch.from_sequences([ids])).synchronize()
    for v in PARTS.values():
        v.clear()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout, flush=True)
    for scen in ("b2b", "sleep", "spin", "b2b"):
        for _ in range(n):
            e.step(Batch.from_sequences([ids])).synchronize()
            if scen == "sleep":
                time.sleep(0.0005)
            elif scen == "spin":
                t = time.perf_counter() + 0.0005
                while time.perf_counter() < t:
                    pass
        summary(rec, scen, 0)

    import gc

    import uvloop
    from grpc_health.v1 import health, health_pb2_grpc

    from benchmarks.hop import _in_process
    from tulip.config import TulipConfig
    from tulip.h2server import Server
    from tulip.loop import EngineLoop
    from tulip.server import TulipServicer, add_tulip

    async def amain():
        loop = EngineLoop(e, TulipConfig(max_batch_tokens=16384))
        loop.start()
        await _in_process(loop, n)  # 200 of warm-up, then n
        summary(rec, "loop", 200)
        server = Server(64 << 20)
        add_tulip(server, TulipServicer(loop, "probe"))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = await server.listen("127.0.0.1", 0)
        await _in_process(loop, n)  # in-process again, with the server up (idle)
        summary(rec, "loop+server", 200)
        gc.collect()
        gc.freeze()
        for transport in ("stream", "unary", "stream"):
            before, w0 = threads(), time.monotonic()
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", transport,
                                                     str(n), stdout=subprocess.PIPE)
            o, _ = await p.communicate()
            thread_usage(rec, before, threads(), time.monotonic() - w0, transport)
            rec.emit(scenario=transport, part="client", transport=transport,
                     **json.loads(o.decode().strip().splitlines()[-1]))
            summary(rec, transport, 200)
        await server.stop(0)
        await loop.stop()

    uvloop.install()
    asyncio.run(amain())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
