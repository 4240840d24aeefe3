"""Where Engine.step's host time goes: back to back, after idle gaps, in Tulip's loop, and served over gRPC.

    python -m benchmarks.step_host OUTDIR [--model bge-m3] [--n 1500]       # OUTDIR/launchprobe.jsonl

Wraps GraphRunner / CudaOps methods (class level) with wall and thread-CPU timers, then runs:
  b2b     engine.step + synchronize back to back (as benchmarks.engine)
  sleep   the same with a 0.5 ms time.sleep between steps
  spin    the same with a 0.5 ms busy wait between steps
  loop    Tulip's EngineLoop in-process (submit -> result, as benchmarks.hop's in-process row)
  stream  Tulip's servicer over gRPC, a tulip.client stream client in another process
  unary   the same, unary
Prints and writes one JSON line per (scenario, part): p50 / p90 wall us and p50 CPU us; per served
scenario also each busy thread's share of a core (`part: "thread"`) and the client's p50 / p99. This
process runs gRPC's I/O as `python -m tulip` does (`trellis.grpcio`), and its client inherits it. A
probe: the parts are timed by wrappers set on the classes, which add ~0.3 us each.
"""
from trellis.grpcio import use_inline_io

use_inline_io()

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

W, C = time.perf_counter_ns, time.thread_time_ns
PARTS: dict[str, list] = {}


def wrap(cls, name, label):
    f = getattr(cls, name)
    acc = PARTS.setdefault(label, [])

    def w(*a, **k):
        t0, c0 = W(), C()
        r = f(*a, **k)
        acc.append((W() - t0, C() - c0))
        return r

    setattr(cls, name, w)


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
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[tid] = (name, int(f[11]) + int(f[12]), int(f[36]))
        except OSError:
            pass
    return out


def thread_usage(before: dict, after: dict, seconds: float, scenario: str, out: list):
    tick = os.sysconf("SC_CLK_TCK")
    for tid, (name, t, cpu) in after.items():
        used = (t - before.get(tid, (name, 0, 0))[1]) / tick
        if used > 0.01 * seconds:
            row = {"scenario": scenario, "part": "thread", "tid": tid, "name": name, "cpu_share": round(used / seconds, 3),
                   "last_cpu": cpu}
            out.append(row)
            print(json.dumps(row), flush=True)


def summary(scenario: str, skip: int, out: list):
    for label, v in PARTS.items():
        v = v[skip:]
        if not v:
            continue
        a = np.array(v, dtype=np.float64) / 1e3
        row = {"scenario": scenario, "part": label, "n": len(a), "wall_p50_us": round(float(np.median(a[:, 0])), 1),
               "wall_p90_us": round(float(np.percentile(a[:, 0], 90)), 1),
               "cpu_p50_us": round(float(np.median(a[:, 1])), 1)}
        out.append(row)
        print(json.dumps(row), flush=True)
    for v in PARTS.values():
        v.clear()


CLIENT = r"""
import asyncio, json, sys, time
import numpy as np
from tulip.client import TulipClient
async def main(target, transport, n):
    seq = [np.arange(5, 133, dtype=np.int32)]
    async with TulipClient(target, transport=transport) as c:
        for _ in range(200):
            await c.embed(seq)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns(); await c.embed(seq); ts.append((time.perf_counter_ns() - t0) / 1e6)
    print(json.dumps({"transport": transport, "n": n, "p50_ms": float(np.median(ts)), "p99_ms": float(np.percentile(ts, 99))}))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    model = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "bge-m3"
    n = int(sys.argv[sys.argv.index("--n") + 1]) if "--n" in sys.argv else 1500
    install()
    import torch

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig

    e = Engine(EngineConfig(model=model, compile=torch.cuda.is_available()))
    batch = Batch.from_sequences([np.arange(5, 133, dtype=np.int32)])
    rows: list = []
    for _ in range(10):
        e.step(batch).synchronize()
    for v in PARTS.values():
        v.clear()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout, flush=True)
    for scen in ("b2b", "sleep", "spin", "b2b"):
        for _ in range(n):
            lazy = e.step(Batch.from_sequences([np.arange(5, 133, dtype=np.int32)]))
            lazy.synchronize()
            if scen == "sleep":
                time.sleep(0.0005)
            elif scen == "spin":
                t = time.perf_counter() + 0.0005
                while time.perf_counter() < t:
                    pass
        summary(scen, 0, rows)

    import gc

    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2_grpc

    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop, Request
    from tulip.server import TulipServicer, add_tulip

    async def amain():
        loop = EngineLoop(e, TulipConfig(max_batch_tokens=16384))
        loop.start()
        ids, lengths = np.arange(5, 133, dtype=np.int32), np.array([128])
        for i in range(n + 200):
            await loop.submit(Request(ids, lengths))
        summary("loop", 200, rows)
        server = grpc.aio.server()
        add_tulip(server, TulipServicer(loop, "probe"))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        for i in range(n + 200):  # in-process again, with the server up (idle)
            await loop.submit(Request(ids, lengths))
        summary("loop+server", 200, rows)
        gc.collect()
        gc.freeze()
        env = dict(os.environ)
        for transport in ("stream", "unary", "stream"):
            spy = None
            if transport == "stream" and os.environ.get("PROBE_SPY"):
                spy = subprocess.Popen(["py-spy", "record", "-p", str(os.getpid()), "-r", "997", "-d", "60",
                                        "--nonblocking", "--threads", "--format", "raw",
                                        "-o", str(out_dir / "spy_stream.txt")], stdout=subprocess.DEVNULL)
                await asyncio.sleep(1.0)
            t_before, w0 = threads(), time.monotonic()
            p = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", transport, str(n),
                                                     stdout=subprocess.PIPE, env=env)
            o, _ = await p.communicate()
            thread_usage(t_before, threads(), time.monotonic() - w0, transport, rows)
            if spy is not None:
                spy.terminate()
                spy.wait()
                os.environ.pop("PROBE_SPY")
            client = json.loads(o.decode().strip().splitlines()[-1])
            rows.append({"scenario": transport, "part": "client", **client})
            print(json.dumps(rows[-1]), flush=True)
            summary(transport, 200, rows)
        await server.stop(0)
        await loop.stop()

    uvloop.install()
    asyncio.run(amain())
    meta = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "git": os.environ.get("TRELLIS_GIT_REV"), "model": model, "n": n}
    with open(out_dir / "launchprobe.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, **meta}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
