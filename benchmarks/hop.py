"""What a request costs besides the GPU: the gRPC hop and Tulip's Python around the engine.

    python -m benchmarks.hop --out benchmarks/results [--n 3000] [--device-ms 0] [--spin-ms 10]
    python -m benchmarks.hop --model preset:bge-m3 --compile      # the real engine instead of the null one
    python -m benchmarks.hop --no-stages --no-proto        # only the trellis.client rows
    python -m benchmarks.hop --device-ms 1 --tail-only     # only the stamping Tulip: where the slow requests went

grpc.aio's echo server polls its sockets on gRPC's completion-queue thread (`INLINE_IO`; `--server-io
default`: grpc's own EventEngine threads), the clients keep grpc's default, as an independent client would.
Serves, in a separate process, (a) a bare echo servicer (the gRPC floor: unary and bidi stream),
on grpc.aio's server and on Tulip's own (`tulip.h2server`, `server: "grpc echo (tulip.h2server)"`),
and (b) the real Tulip servicer and engine loop over a null engine whose steps take `--device-ms`
(0: an already-complete LazyTensor; > 0: a step that completes that much later, watched as
Tulip watches a GPU step: polled for `--spin-ms`, then awaited in a thread; the loop also stays
awake `--spin-ms` after each step). `--client-spin-ms` lets the client poll while a reply is due. Where CUDA is
present the null step is a real device-side sleep with a real CUDA event; elsewhere a timer stands
in; with `--model` the real engine runs instead. Before serving, Tulip times its engine loop
in-process (submit -> result, no gRPC) and, with `--model`, the bare `Engine.step()` as
`benchmarks.engine` times it (the baseline the request-path targets subtract). Both servers also listen on a Unix socket. The client, in this process, sends one
pre-tokenized 128-token request at a time over TCP (unary, stream) and the socket (stream). Each
row is one p50/p99 over `--n` requests; the differences between rows are the breakdown.

Then, in the same run: `benchmarks.protoclient` (a client from the proto alone, in a process of
its own; grpc's sync and asyncio stubs) against both servers (`bench: "hop-proto"` rows), and a
third server, Tulip with stage recording on (`tulip.stages`), measured again with the unary and
stream client, whose per-stage p50 / p99 are `bench: "hop-stages"` rows (one per stage, receipt to
write; stamping costs a little, so the timing rows come from the server without it).
`--profile DIR` also writes a cProfile of that server (pstats and its top functions as text).
With that server the client also keeps each request's (start, end) and both processes log their garbage
collections (`GcLog`; `perf_counter_ns` is one clock across the host's processes), so each request is
split into segments that add up to the client's time (`TAIL_SEGMENTS`: `send`, client to Tulip's
deserializer; Tulip's stages; `back`, gRPC's core to the client's code): `bench: "hop-tail"` rows say
which segments the slow requests (over the client's p99) lost their time in, and whether a collection
overlapped them (also printed to stderr). `--tail-only` serves only that server (no echo, no proto, no floors).
`--sync-floors` (on by default with the null engine) adds the other server arrangement's echo floors, timed with
`benchmarks.protoclient`: grpc's sync server, and that server bridging unary replies through an
asyncio loop in another thread, idle or spinning (`benchmarks.syncserver`; `hop-proto` rows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, model_tag, percentiles, pyplot, run_client, write_profile
from tulip.stages import POINTS, RECEIPT


class TimedEvent:
    """Stands in for a CUDA event on machines without a GPU: complete at monotonic time `t`."""

    def __init__(self, t):
        self.t = t

    def query(self):
        return time.monotonic() >= self.t

    def synchronize(self):
        wait = self.t - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class NullEngine:
    """The engine interface with no model: rows of zeros, ready `device_ms` after the step."""

    num_labels, activation, image_size = 0, "", 0  # an embedding model of text, not a cross-encoder

    def __init__(self, device_ms: float, dim: int = 1024):
        import torch

        self.device_ms, self.embedding_dim, self.dtype = device_ms, dim, torch.bfloat16
        self.cuda = torch.cuda.is_available()
        if self.cuda and device_ms:  # calibrate torch.cuda._sleep's cycles per millisecond
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles = int(device_ms * 10_000_000 / start.elapsed_time(end))
        self.device = torch.device("cuda")  # launched inline, as on a GPU
        self.spec = types.SimpleNamespace(max_seq_len=8192, vocab_size=250002, pooling="cls", normalize=True,
                                          special_token_ids=(), quantized_outputs=False)
        self.extra_outputs = ()
        self.sparse_rows = False
        self.attention = types.SimpleNamespace(name="none")

    def step(self, batch, extras=frozenset(), urgent=False):
        import torch

        from rose.lazy import LazyTensor

        if self.cuda and self.device_ms:
            torch.cuda._sleep(self.cycles)
            return LazyTensor.from_device(torch.zeros(batch.num_seqs, self.embedding_dim, device="cuda"))
        out = torch.zeros(batch.num_seqs, self.embedding_dim)
        return LazyTensor(out, TimedEvent(time.monotonic() + self.device_ms / 1e3) if self.device_ms else None)


class GcLog:
    """This process's garbage collections, (start, end, generation) in `perf_counter_ns`
    (CLOCK_MONOTONIC: comparable across the processes of one host), from its first `get()` on."""

    _one: "GcLog | None" = None

    def __init__(self, size: int = 65536):
        from collections import deque

        self.events = deque(maxlen=size)
        self._start = 0
        gc.callbacks.append(self._callback)

    @classmethod
    def get(cls) -> "GcLog":
        if cls._one is None:
            cls._one = cls()
        return cls._one

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.events.append((self._start, time.perf_counter_ns(), info["generation"]))


async def _in_process(loop, n: int) -> dict:
    """Submit -> result through the engine loop in this process (no gRPC)."""
    from tulip.loop import Request

    ids, lengths = np.arange(5, 133, dtype=np.int32), np.array([128])
    ts = []
    for i in range(200 + n):
        t0 = time.perf_counter()
        await loop.submit(Request(ids, lengths))
        ts.append((time.perf_counter() - t0) * 1e3)
    return percentiles(ts[200:])


@contextlib.contextmanager
def _environ(env: dict):
    """These environment variables set for the block, then as they were."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_ready(p, ready, timeout: float):
    """The server process's first message, or an error as soon as it dies (a failed import or model
    load must not leave the benchmark waiting out the whole timeout)."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return ready.get(timeout=1.0)
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the benchmark server exited with code {p.exitcode} before it was ready "
                                   "(its traceback is above)") from None
    raise TimeoutError(f"the benchmark server was not ready after {timeout:.0f} s")


# gRPC's iomgr for grpc.aio's echo server: sockets polled on the completion-queue thread, one thread wake-up
# fewer per message each way than grpc's EventEngine (on an H200 host a Tulip on grpc.aio's server gained
# 0.1-0.3 ms from it: results/2026-12-01_cpu-h200_request-path-tail/; Tulip's own server has no gRPC core)
INLINE_IO = "-event_engine_client,-event_engine_listener"
ECHOES = {"echo": "grpc echo", "echo-h2": "grpc echo (tulip.h2server)"}  # the floors: grpc.aio's server, Tulip's


def _serve(kind: str, port: int, uds: str, args: dict, ready, cmd) -> None:
    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2_grpc

    from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop
    from tulip.h2server import Server
    from tulip.server import TulipServicer, add_tulip

    class Echo(tulip_pb2_grpc.TulipServicer):
        reply = tulip_pb2.EmbedReply(embeddings=bytes(4096), shape=[1, 1024], prompt_tokens=128)

        async def Embed(self, request, context):
            return self.reply

        async def EmbedStream(self, request_iterator, context):
            async for r in request_iterator:
                rep = tulip_pb2.EmbedReply()
                rep.CopyFrom(self.reply)
                rep.request_id = r.request_id
                yield rep

    gc_log = GcLog.get() if kind == "tulip-stages" else None  # (the timing servers run without the callback)

    async def main():
        info = {}
        if kind in ("echo", "echo-h2"):
            servicer = Echo()
        else:
            if args["model"]:
                from rose.engine import Engine, EngineConfig

                engine = Engine(EngineConfig(model=args["model"], attention=args["attention"], compile=args["compile"]))
            else:
                engine = NullEngine(args["device_ms"])
            stages = 4 * args["n"] if kind == "tulip-stages" else 0
            loop = EngineLoop(engine, TulipConfig(spin_ms=args["spin_ms"], max_batch_tokens=16384,
                                                  stage_samples=stages))
            if args["model"] and kind == "tulip":  # the bare step first, as benchmarks.engine times it
                from benchmarks.engine import time_online

                info["step"] = time_online(engine, 128, args["n"])
            loop.start()
            info["loop"] = await _in_process(loop, args["n"])
            servicer = TulipServicer(loop, "null")
        server = grpc.aio.server() if kind == "echo" else Server(64 << 20)  # Tulip's own server, as tulip.server
        if kind.startswith("echo"):
            tulip_pb2_grpc.add_TulipServicer_to_server(servicer, server)
        else:
            add_tulip(server, servicer)
        health_servicer = health.aio.HealthServicer()  # Ivy's readiness check
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if kind == "echo":
            server.add_insecure_port(f"127.0.0.1:{port}")
            server.add_insecure_port(f"unix:{uds}")
            await server.start()
        else:
            await server.listen("127.0.0.1", port)
            await server.listen_unix(uds)
        prof = None
        if kind == "tulip-stages" and args["profile"]:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        gc.collect()  # as tulip.server.serve does before serving: what is loaded stays out of the collector's scans
        gc.freeze()
        ready.put(info)
        aloop = asyncio.get_running_loop()
        while True:  # the parent's requests: "stages" (and "reset") until it terminates this process
            what = await aloop.run_in_executor(None, cmd.get)
            if what == "reset" and kind == "tulip-stages":
                loop.stages.ring.clear()
                gc_log.events.clear()
            elif what == "stages":
                if prof is not None:
                    prof.disable()
                    write_profile(prof, Path(args["profile"]), "hop-tulip", 40)
                if kind == "tulip-stages":  # the summary, and each request's stamps and the collections for hop-tail
                    ready.put((loop.stages.summary(), list(loop.stages.ring), list(gc_log.events)))
                else:
                    ready.put(({}, [], []))

    uvloop.install()
    asyncio.run(main())


def draw_stages(rows: list[dict], path: Path) -> bool:
    """One stacked bar per transport: the p50 of each stage of a served request, receipt to write."""
    from tulip.stages import POINTS

    plt = pyplot()
    rows = [r for r in rows if r.get("bench") == "hop-stages" and r["stage"] != "total"]
    transports = sorted({r["transport"] for r in rows}, reverse=True)
    if plt is None or not transports:
        return False
    stages = [p for p in POINTS[1:] if any(r["stage"] == p for r in rows)]
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(10, 1.0 * len(transports) + 2.2))
    for j, t in enumerate(transports):
        left = 0.0
        for k, stage in enumerate(stages):
            v = next((r["p50_ms"] for r in rows if r["transport"] == t and r["stage"] == stage), 0.0)
            ax.barh(j, v, left=left, color=colors[k % len(colors)], label=stage if j == 0 else None)
            if v > 0.03:
                ax.text(left + v / 2, j, f"{v * 1e3:.0f}", ha="center", va="center", fontsize=6)
            left += v
    server = rows[0]["server"] + (f", device step {rows[0]['device_ms']:g} ms" if rows[0].get("device_ms") is not None else "")
    ax.set_yticks(range(len(transports)), transports)
    ax.set_xlabel(f"p50 per stage, ms (labels in us); {server}; {rows[0]['gpu']}")
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def _proto_client(target: str, n: int) -> list[dict]:
    """benchmarks.protoclient in a process of its own (only grpcio and the stubs imported)."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "benchmarks.protoclient", target, "--n", str(n),
                        "--warmup", str(min(200, n))], cwd=root, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, PYTHONPATH=str(root)))
    if r.returncode:
        raise RuntimeError(f"benchmarks.protoclient exited {r.returncode}: {r.stderr[-2000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


async def _measure(target: str, transport: str, n: int, spin_ms: float = 0.0, spans: list | None = None) -> dict:
    """p50 / p99 of `n` sequential 1 x 128 requests (after 200 of warm-up); `spans` (a list) also gets
    each timed request's (start, end) in `perf_counter_ns` for `tail_rows`."""
    from trellis.client import TulipClient

    seq = [np.arange(5, 133, dtype=np.int32)]
    clock = time.perf_counter_ns
    async with TulipClient(target, transport=transport, spin_ms=spin_ms) as c:
        for _ in range(200):
            await c.embed(seq)
        ts = []
        for _ in range(n):
            t0 = clock()
            await c.embed(seq)
            t1 = clock()
            ts.append((t1 - t0) / 1e6)
            if spans is not None:
                spans.append((t0, t1))
    return percentiles(ts)


# A request's time as the client saw it, in segments that add up to it: the client's send and the way in
# to Tulip's deserializer, Tulip's stages (tulip.stages.POINTS) up to the encoded reply, its hand-off to
# gRPC's core (`write`, cut at the client's end where a done callback came later), and the rest
# (`back`: gRPC's core to the client's awaiting code).
TAIL_SEGMENTS = ("send", *POINTS[1:], "back")


def _segments(spans: list, stamps: list) -> tuple[np.ndarray, np.ndarray]:
    """Match each server stamp list to the client request whose span holds its receipt (the requests
    are sequential) -> ([requests, segments] ns, the matched spans [requests, 2])."""
    spans_a = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    rows = np.asarray(stamps, dtype=np.int64).reshape(-1, len(TAIL_SEGMENTS) - 1)
    rows = rows[(rows > 0).all(axis=1)]
    i = np.searchsorted(spans_a[:, 0], rows[:, RECEIPT], side="right") - 1
    ok = (i >= 0) & (rows[:, RECEIPT] <= spans_a[np.maximum(i, 0), 1])
    rows, sp = rows[ok], spans_a[i[ok]]
    points = np.concatenate([sp[:, :1], rows[:, :-1], np.minimum(rows[:, -1:], sp[:, 1:]), sp[:, 1:]], axis=1)
    return np.diff(points, axis=1), sp


def _overlaps(sp: np.ndarray, events: list) -> np.ndarray:
    """[requests, 3]: the generation-0/1/2 collections (of one process's `GcLog`) that overlap each span."""
    out = np.zeros((len(sp), 3), dtype=np.int64)
    for a, b, gen in events:
        out[(sp[:, 0] < b) & (sp[:, 1] > a), gen] += 1
    return out


def tail_rows(spans: list, stamps: list, client_gcs: list, server_gcs: list, q: float = 99.0) -> list[dict]:
    """Where the slow requests' time went: `spans` the client's (start, end) per request, `stamps`
    Tulip's stage stamps over the same requests, `*_gcs` each process's collections (GcLog).
    A request is slow above the `q` percentile of the client's times; each slow request's time over
    the median is split by segment (each segment's excess over its own median), and the segment with
    the most excess is its `worst`. One row per segment (`bench: "hop-tail"`, ms) and one "all" row:
    the slow count and how many of them (and of all requests) a collection overlapped."""
    seg, sp = _segments(spans, stamps)
    if not len(seg):
        return []
    total = seg.sum(axis=1)
    slow = total > np.percentile(total, q)
    med = np.median(seg, axis=0)
    excess = np.maximum(seg[slow] - med, 0)
    worst = np.bincount(excess.argmax(axis=1), minlength=seg.shape[1]) if slow.any() else np.zeros(seg.shape[1], int)
    out = []
    for k, name in enumerate(TAIL_SEGMENTS):
        out.append(dict(segment=name, p50_ms=round(float(med[k]) / 1e6, 4),
                        p99_ms=round(float(np.percentile(seg[:, k], 99)) / 1e6, 4),
                        slow_excess_ms=round(float(excess[:, k].mean()) / 1e6 if slow.any() else 0.0, 4),
                        slow_worst=int(worst[k])))
    cg, sg = _overlaps(sp, client_gcs), _overlaps(sp, server_gcs)
    anyc, anys = cg.sum(axis=1) > 0, sg.sum(axis=1) > 0
    out.append(dict(segment="all", n=int(len(seg)), slow=int(slow.sum()),
                    p50_ms=round(float(np.median(total)) / 1e6, 4),
                    p99_ms=round(float(np.percentile(total, q)) / 1e6, 4),
                    slow_excess_ms=round(float((total[slow] - np.median(total)).mean()) / 1e6 if slow.any() else 0.0, 4),
                    gc_client_slow=int(anyc[slow].sum()), gc_server_slow=int(anys[slow].sum()),
                    gc_client_all=int(anyc.sum()), gc_server_all=int(anys.sum()),
                    gc_gens_slow=[int(x) for x in (cg[slow] + sg[slow]).sum(axis=0)],
                    gc_server=_gc_stats(server_gcs, sp), gc_client=_gc_stats(client_gcs, sp)))
    return out


def _gc_stats(events: list, sp: np.ndarray) -> dict:
    """Per generation: how many collections ran while the requests were timed, and their p50 / max ms."""
    lo, hi = int(sp[:, 0].min()), int(sp[:, 1].max())
    out = {}
    for gen in range(3):
        d = np.array([b - a for a, b, g in events if g == gen and lo <= a <= hi], dtype=np.float64) / 1e6
        out[gen] = dict(n=int(d.size), p50_ms=round(float(np.median(d)), 4) if d.size else 0.0,
                        max_ms=round(float(d.max()), 4) if d.size else 0.0)
    return out


def print_tail(transport: str, rows: list[dict]) -> None:
    """hop-tail rows as a few lines of text (stderr)."""
    if not rows:
        return
    a = rows[-1]
    print(f"tail, {transport}: {a['n']} requests, p50 {a['p50_ms']:.3f} p99 {a['p99_ms']:.3f} ms; {a['slow']} slow, "
          f"{a['slow_excess_ms']:.3f} ms over the median on average; a collection in {a['gc_server_slow']} (server) / "
          f"{a['gc_client_slow']} (client) of them, against {a['gc_server_all']} / {a['gc_client_all']} of all "
          f"(generations in the slow ones {a['gc_gens_slow']})", file=sys.stderr)
    for who in ("server", "client"):
        print(f"  {who} collections: " + ", ".join(f"gen {g}: {v['n']} x {v['p50_ms']:.3f} (max {v['max_ms']:.3f}) ms"
                                                   for g, v in a[f"gc_{who}"].items()), file=sys.stderr)
    print("  segment    p50    p99  slow: excess worst", file=sys.stderr)
    for r in rows[:-1]:
        print(f"  {r['segment']:<9} {r['p50_ms']:.3f}  {r['p99_ms']:.3f}  {r['slow_excess_ms']:12.3f} {r['slow_worst']:5d}",
              file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--device-ms", type=float, default=0.0)
    ap.add_argument("--spin-ms", type=float, default=10.0, help="Tulip's --spin-ms")
    ap.add_argument("--client-spin-ms", type=float, default=0.0, help="the client's TulipClient spin_ms")
    ap.add_argument("--model", default="", help="serve this model with the real engine instead of the null one")
    ap.add_argument("--attention", default="auto", help="with --model")
    ap.add_argument("--compile", action="store_true", help="with --model")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                    help="also serve a Tulip with stage recording and emit hop-stages rows")
    ap.add_argument("--proto", action=argparse.BooleanOptionalAction, default=True,
                    help="also time both servers with benchmarks.protoclient (hop-proto rows)")
    ap.add_argument("--sync-floors", action=argparse.BooleanOptionalAction, default=None,
                    help="also time sync-server echo floors with benchmarks.protoclient (hop-proto rows); "
                         "default: on with the null engine, off with --model (they do not depend on it)")
    ap.add_argument("--server-io", choices=("inline", "default"), default="inline",
                    help="grpc.aio's echo server's gRPC I/O: sockets polled on the completion-queue thread "
                         "(INLINE_IO), or grpc's default; the clients always keep grpc's default")
    ap.add_argument("--profile", default="", help="with --stages: write a cProfile of that Tulip to this directory")
    ap.add_argument("--tail-only", action="store_true",
                    help="serve only the stage-recording Tulip (hop-stages and hop-tail rows; no echo, no proto, "
                         "no sync floors): the shortest run that says where the slow requests' time goes")
    args = ap.parse_args(argv)

    rec = Recorder(args.out, f"hop_{model_tag(args.model) if args.model else f'null-{args.device_ms:g}ms'}")
    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp())
    what = (f"tulip + {args.model} ({args.attention}{', compile' if args.compile else ''})" if args.model
            else "tulip + null engine")
    server_env = {"GRPC_EXPERIMENTS": INLINE_IO} if args.server_io == "inline" else {}
    kinds = ("tulip-stages",) if args.tail_only else ("echo", "echo-h2", "tulip") + (("tulip-stages",) if args.stages else ())
    for kind in kinds:
        port, uds, ready, cmd = free_port(), tmp / f"{kind}.sock", ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_serve, args=(kind, port, str(uds), vars(args), ready, cmd), daemon=True)
        with _environ(server_env):  # a spawned process reads its environment at start
            p.start()
        try:
            in_process = _wait_ready(p, ready, 900)  # the server is listening (and measured itself in-process)
            tulip = not kind.startswith("echo")
            common = dict(bench="hop", server=what if tulip else ECHOES[kind], device_ms=None, spin_ms=None,
                          cpus=os.cpu_count(), client_spin_ms=args.client_spin_ms,
                          server_grpc_experiments=server_env.get("GRPC_EXPERIMENTS"))
            if tulip:
                common.update(device_ms=None if args.model else args.device_ms, spin_ms=args.spin_ms)
            if kind == "tulip-stages":
                client_gc = GcLog.get()
                for transport in ("unary", "stream"):
                    cmd.put("reset")
                    spans: list = []
                    client_gc.events.clear()
                    run_client(_measure(f"127.0.0.1:{port}", transport, args.n, args.client_spin_ms, spans))
                    cmd.put("stages")
                    summary, stamps, server_gcs = ready.get(timeout=60)
                    for stage, r in summary.items():
                        rec.emit(**{**common, "bench": "hop-stages"}, transport=transport, socket="tcp",
                                 client="trellis.client", stage=stage, **r)
                    tail = tail_rows(spans, stamps, list(client_gc.events), server_gcs)
                    for r in tail:
                        rec.emit(**{**common, "bench": "hop-tail"}, transport=transport, socket="tcp",
                                 client="trellis.client", **r)
                    print_tail(transport, tail)
                continue
            if tulip:
                rec.emit(**common, transport="in-process engine loop", socket=None, **in_process["loop"])
            if "step" in in_process:  # the baseline: the bare Engine.step(), no loop
                rec.emit(**common, transport="in-process engine step", socket=None, **in_process["step"])
            for transport, target in (("unary", f"127.0.0.1:{port}"), ("stream", f"127.0.0.1:{port}"),
                                      ("stream", f"unix:{uds}")):
                r = run_client(_measure(target, transport, args.n, args.client_spin_ms))
                rec.emit(**common, transport=transport, socket="unix" if target.startswith("unix") else "tcp", **r)
            if args.proto:
                for r in _proto_client(f"127.0.0.1:{port}", args.n):
                    rec.emit(**{**common, **r, "socket": "tcp"})
        finally:
            p.terminate()
            p.join(10)
    floors = args.sync_floors if args.sync_floors is not None else not (args.model or args.tail_only)
    for kind in ("sync", "bridge", "bridge-spin") if floors else ():
        port = free_port()
        root = Path(__file__).resolve().parent.parent
        p = subprocess.Popen([sys.executable, "-m", "benchmarks.syncserver", kind, str(port)], cwd=root,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(root), **server_env))
        try:
            if p.stdout.readline().strip() != "READY":
                raise RuntimeError(f"benchmarks.syncserver {kind} did not start")
            common = dict(bench="hop-proto", server=f"grpc echo, sync server ({kind})", device_ms=None, spin_ms=None,
                          cpus=os.cpu_count(), client_spin_ms=0.0,
                          server_grpc_experiments=server_env.get("GRPC_EXPERIMENTS"))
            for r in _proto_client(f"127.0.0.1:{port}", args.n):
                rec.emit(**{**common, **r, "socket": "tcp"})
        finally:
            p.terminate()
            p.wait(10)
    if rec.path is not None and draw_stages(rec.rows, rec.path.with_name(rec.path.stem + "_stages.png")):
        print(f"wrote {rec.path.with_name(rec.path.stem + '_stages.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
