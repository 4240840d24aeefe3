"""Ivy alone: `/v1/embeddings` per worker against a Tulip stand-in that answers at once.

    python -m benchmarks.gateway --model preset:bge-m3 --out benchmarks/results/gateway [--server uvicorn]

Starts a stand-in Tulip (a grpc.aio server written from the trellis.tulip.v1 stubs: Info, Embed,
EmbedStream and the health service, replying with fixed 1024-value vectors and no engine), then
one Ivy worker (`python -m ivy --workers 1`) in front of it, and sends one L-token text per request
(tokenization, templating, balancer, gRPC, JSON all paid; the engine not):
- latency: 1 client, `--n` sequential requests, p50 / p99 ms;
- saturation: each of `--clients` concurrent connections sends its next request as soon as its
  last is answered, for `--seconds`; req/s, p50 / p99 ms, and the Ivy worker's CPU time per request (user +
  system of its process tree over the window, and of its busiest thread, the event loop's, which
  bounds a worker: on a shared or small host the part that does not depend on how much CPU the
  clients and the stand-in left it).
With `--stages` only the latency cells run, Ivy's worker records per-request stage stamps
(IVY_STAGES, see ivy/front.py) and their medians are emitted as `bench: ivy-stage` rows, with the
client's p50 less Ivy's (HTTP parsing and writing in the server, the sockets, the client itself). `--stand-in-only PORT` serves the stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import free_port, read_rows, stop

ROOT = Path(__file__).resolve().parent.parent
DIM = 1024
ISSUE_TARGET_REQ_PER_S = 1000  # issue 14: per worker, CPU, a Tulip that answers at once, 512-token text


# --- the stand-in Tulip --------------------------------------------------------------------------

def serve_stand_in(port: int, max_seq_len: int = 8192, vocab_size: int = 250002, uds: str = "") -> None:
    """Serve Info / Embed / EmbedStream / health on 127.0.0.1:port (and unix:`uds` if given) until
    SIGTERM (prints STAND_IN_READY)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc

    g = np.random.default_rng(0)
    unit = g.standard_normal(DIM).astype("<f4")
    unit /= np.linalg.norm(unit)
    rows = {tulip_pb2.ENCODING_FLOAT32: lambda d: unit[:d].tobytes(),
            tulip_pb2.ENCODING_INT8: lambda d: np.clip(np.round(np.tanh(unit[:d]) * 127), -127, 127).astype(np.int8).tobytes(),
            tulip_pb2.ENCODING_BINARY: lambda d: np.packbits(unit[:d] > 0).tobytes()}
    cache: dict[tuple, tulip_pb2.EmbedReply] = {}
    info = tulip_pb2.InfoReply(model="stand-in", embedding_dim=DIM, max_seq_len=max_seq_len, vocab_size=vocab_size,
                               pooling="cls", normalized=True, outputs=[tulip_pb2.OUTPUT_DENSE], dtype="float32",
                               device="none", max_batch_tokens=16384, encodings=list(rows), attention="none")

    def reply(req: tulip_pb2.EmbedRequest) -> tulip_pb2.EmbedReply:
        n, d = len(req.lengths), req.dimensions or DIM
        key = (n, d, req.encoding, sum(req.lengths))
        r = cache.get(key)
        if r is None:
            r = cache[key] = tulip_pb2.EmbedReply(embeddings=rows[req.encoding](d) * n, shape=[n, d],
                                                  prompt_tokens=sum(req.lengths), encoding=req.encoding)
        return r

    class StandIn(tulip_pb2_grpc.TulipServicer):
        async def Info(self, request, context):
            return info

        async def Embed(self, request, context):
            return reply(request)

        async def EmbedStream(self, request_iterator, context):
            async for req in request_iterator:
                r = tulip_pb2.EmbedReply()
                r.CopyFrom(reply(req))
                r.request_id = req.request_id
                yield r

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        tulip_pb2_grpc.add_TulipServicer_to_server(StandIn(), server)
        h = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        res = h.set("", health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(res):
            await res
        server.add_insecure_port(f"127.0.0.1:{port}")
        if uds:
            server.add_insecure_port(f"unix:{uds}")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("STAND_IN_READY", flush=True)
        await stop.wait()
        await server.stop(0.5)

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# --- processes -----------------------------------------------------------------------------------



def spawn(argv: list[str], log: Path, env: dict | None = None, root: Path = ROOT) -> subprocess.Popen:
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    e["PYTHONPATH"] = str(root) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, *argv], cwd=root, stdout=log.open("w"), stderr=subprocess.STDOUT, env=e)


def wait_until(pred, what: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if pred():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def tree_cpu_s(pid: int) -> dict[tuple[int, int], float]:
    """User + system CPU seconds of every thread of `pid` and its live descendants, by (pid, tid)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                s = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parents[int(d)] = int(s[s.rindex(")") + 2:].split()[1])
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo += [c for c, pp in parents.items() if pp == p]
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                s = Path(f"/proc/{p}/task/{t}/stat").read_text()
            except OSError:
                continue
            f = s[s.rindex(")") + 2:].split()
            out[(p, int(t))] = (int(f[11]) + int(f[12])) / tick
    return out


def _rev(root: Path) -> str:
    if root.resolve() == ROOT:
        from benchmarks.common import git_rev

        return git_rev()
    if (root / "REVISION").exists():  # an exported tree (no .git of its own): the revision it was taken from
        return (root / "REVISION").read_text().strip()
    if not (root / ".git").exists():  # else git would answer for the repository around it
        return "unknown"
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True).strip()
    except Exception:
        return "unknown"


# --- clients ---------------------------------------------------------------------------------------

async def _latency(url: str, payload: bytes, n: int, warmup: int) -> list[float]:
    import aiohttp

    lat = []
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=60)) as s:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            async with s.post("/v1/embeddings", data=payload, headers={"content-type": "application/json"}) as r:
                await r.read()
                r.raise_for_status()
            if i >= warmup:
                lat.append((time.perf_counter() - t0) * 1e3)
    return lat


async def _saturate(url: str, payload: bytes, clients: int, seconds: float,
                    start_at: float) -> tuple[int, int, list[float]]:
    """(answered, failed, latencies ms) of `clients` connections between start_at and start_at + seconds."""
    import aiohttp

    done = failed = 0
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one():
            nonlocal done, failed
            async with s.post("/v1/embeddings", data=payload, headers={"content-type": "application/json"}) as r:
                await r.read()
                return r.status == 200

        await asyncio.gather(*(one() for _ in range(clients)))  # connections open and warm
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds

        async def loop():
            nonlocal done, failed
            while time.time() < end:
                t0 = time.perf_counter()
                ok = await one()
                if time.time() <= end:
                    done, failed = done + ok, failed + (not ok)
                    lat.append((time.perf_counter() - t0) * 1e3)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return done, failed, lat


def _saturate_process(url, payload, clients, seconds, start_at, q):
    q.put(asyncio.run(_saturate(url, payload, clients, seconds, start_at)))


def saturate(url: str, payload: bytes, clients: int, seconds: float, processes: int, ivy_pid: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0  # every client process started and connected by then
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    procs = [ctx.Process(target=_saturate_process, args=(url, payload, k, seconds, start_at, q)) for k in shares if k]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = tree_cpu_s(ivy_pid)
    time.sleep(seconds)
    cpu1 = tree_cpu_s(ivy_pid)
    res = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    done, failed = sum(r[0] for r in res), sum(r[1] for r in res)
    lat = np.asarray([x for r in res for x in r[2]] or [0.0])
    per_thread = [cpu1[k] - cpu0.get(k, 0.0) for k in cpu1]
    total, busiest = sum(per_thread), max(per_thread, default=0.0)
    return {"req_per_s": round(done / seconds, 1), "n": done, "failed": failed, "seconds": seconds,
            "p50_ms": round(float(np.percentile(lat, 50)), 4), "p99_ms": round(float(np.percentile(lat, 99)), 4),
            "ivy_cpu_ms_per_req": round(total * 1e3 / max(done, 1), 4), "ivy_cpu_share": round(total / seconds, 3),
            # the thread running the app (the event loop) bounds a worker: 1 / this is its req/s on a free core
            "ivy_busiest_thread_ms_per_req": round(busiest * 1e3 / max(done, 1), 4), "client_processes": len(procs)}


# --- the run -------------------------------------------------------------------------------------

def stage_rows(recs: list[dict]) -> list[dict]:
    """Per stage, the median and mean microseconds over `recs` (Ivy's stage records)."""
    names = list(recs[0]) if recs else []
    return [{"stage": k, "p50_us": round(float(np.median([r.get(k, 0.0) for r in recs])), 1),
             "mean_us": round(float(np.mean([r.get(k, 0.0) for r in recs])), 1), "n": len(recs)} for k in names]


def stage_chart(files: list[Path], out: Path) -> None:
    """Ivy's stage p50s of several runs (their `ivy-stage` rows) as stacked bars, one panel per
    encoding, a bar per file (its label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_rows(f) for f in files]
    encodings = sorted({r["encoding"] for rows in runs for r in rows if r["bench"] == "ivy-stage"}, reverse=True)
    # Ivy's stages in the order its records name them (`stage_rows`), less the total and what lies outside
    stages = list(dict.fromkeys(r["stage"] for rows in runs for r in rows if r["bench"] == "ivy-stage"
                                and r["stage"] != "total" and not r["stage"].startswith("outside")))
    fig, axes = plt.subplots(1, len(encodings), figsize=(6 * len(encodings), 1.2 + 0.6 * len(files)), sharey=True,
                             squeeze=False)
    for ax, enc in zip(axes[0], encodings):
        for i, rows in enumerate(runs):
            st = {r["stage"]: r["p50_us"] for r in rows if r["bench"] == "ivy-stage" and r["encoding"] == enc}
            left = 0.0
            for j, s in enumerate(stages):
                ax.barh(i, st.get(s, 0.0), left=left, color=plt.cm.tab10(j), label=s if i == 0 else None)
                left += st.get(s, 0.0)
            ax.text(left + 10, i, f"{left:.0f} us", va="center", fontsize=8)
        ax.set_yticks(range(len(runs)), [rows[0].get("label") or f.stem for rows, f in zip(runs, files)])
        ax.set_title(f"Ivy stage p50s, {runs[0][0]['tokens']}-token text, {enc}")
        ax.set_xlabel("sum of stage p50s, us (stand-in Tulip)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, ncol=len(stages), loc="lower center")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3", help="a Hub id, a model directory or preset:NAME: Ivy reads its "
                    "tokenizer and prompts")
    ap.add_argument("--length", type=int, default=512, help="tokens per text, special tokens included")
    ap.add_argument("--encodings", default="float,base64", help="encoding_format values to run")
    ap.add_argument("--n", type=int, default=2000, help="sequential requests of the 1-client latency cell")
    ap.add_argument("--clients", default="16,64", help="concurrent connections of the saturation cells")
    ap.add_argument("--client-processes", type=int, default=1, help="processes the saturation clients are spread over")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each saturation cell")
    ap.add_argument("--server", default="", help="Ivy's --server (the ASGI server); empty: Ivy's default")
    ap.add_argument("--ivy-args", default="", help="extra `python -m ivy` flags")
    ap.add_argument("--ivy-root", type=Path, default=ROOT, help="the checkout Ivy runs from (A/B against another revision; an exported tree names its revision in a REVISION file)")
    ap.add_argument("--label", default="", help="a name for this configuration in the rows")
    ap.add_argument("--stages", action="store_true", help="record Ivy's per-stage stamps (IVY_STAGES) and emit them")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--uds", action="store_true", help="Ivy reaches the stand-in over a Unix socket, not TCP loopback")
    ap.add_argument("--stand-in-only", type=int, default=0, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--stand-in-uds", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stand-in-vocab", type=int, default=250002, help=argparse.SUPPRESS)
    ap.add_argument("--chart", type=Path, nargs="+", default=None, metavar="JSONL",
                    help="only draw these runs' stage p50s (their --stages rows) into --out (a .png)")
    args = ap.parse_args(argv)
    if args.chart:
        stage_chart(args.chart, args.out or Path("ivy_stages.png"))
        return 0
    if args.stand_in_only:
        serve_stand_in(args.stand_in_only, vocab_size=args.stand_in_vocab, uds=args.stand_in_uds)
        return 0
    from benchmarks.common import Recorder
    from benchmarks.concurrency import text_of
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve

    ref = resolve(args.model)
    path, served = ref.path, ref.name
    text = text_of(path / "tokenizer.json", args.length)
    work = args.out or Path("/tmp") / f"gateway-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    tport, port = free_port(), free_port()
    uds = f"/tmp/trellis-stand-in-{os.getpid()}.sock" if args.uds else ""
    # the model's vocabulary: Ivy refuses a model whose Tulips report another (a mixed-up configuration)
    vocab = ModelSpec.read(path).vocab_size
    stand_in = spawn(["-m", "benchmarks.gateway", "--stand-in-only", str(tport), "--stand-in-uds", uds,
                      "--stand-in-vocab", str(vocab)], work / "stand-in.log")
    ivy_argv = ["-m", "ivy", "--model", args.model, "--port", str(port), "--tulip", f"unix:{uds}" if uds else f"127.0.0.1:{tport}",
                "--workers", "1", *(["--server", args.server] if args.server else []), *args.ivy_args.split()]
    stages = work / "stages.jsonl"
    stages.unlink(missing_ok=True)
    ivy = spawn(ivy_argv, work / "ivy.log", {"IVY_STAGES": str(stages)} if args.stages else None, args.ivy_root)
    url = f"http://127.0.0.1:{port}"
    rec = Recorder(args.out, "gateway" + (f"_{args.label}" if args.label else ""))
    common = dict(ivy_git=_rev(args.ivy_root), tulip_transport="uds" if uds else "tcp", model=args.model, tokens=args.length, workers=1, server=args.server or "uvicorn", label=args.label or None,
                  ivy_args=args.ivy_args or None, stand_in="grpc.aio, fixed vectors", dim=DIM)
    try:
        wait_until(lambda: "STAND_IN_READY" in (work / "stand-in.log").read_text(), "stand-in", stand_in,
                   work / "stand-in.log")
        wait_until(lambda: http_ok(url + "/ready"), "ivy", ivy, work / "ivy.log")
        latency_p50: dict[str, float] = {}
        warmup = min(200, args.n)
        for enc in args.encodings.split(","):
            payload = json.dumps({"model": served, "input": text, "encoding_format": enc}).encode()
            lat = asyncio.run(_latency(url, payload, args.n, warmup=warmup))
            a = np.asarray(lat)
            rec.emit(bench="ivy-latency", encoding=enc, clients=1, n=len(a), p50_ms=round(float(np.percentile(a, 50)), 4),
                     p99_ms=round(float(np.percentile(a, 99)), 4), mean_ms=round(float(a.mean()), 4), **common)
            latency_p50[enc] = float(np.percentile(a, 50))
            for c in [] if args.stages else map(int, args.clients.split(",")):
                rec.emit(bench="ivy-saturation", encoding=enc, clients=c, target_req_per_s=ISSUE_TARGET_REQ_PER_S,
                         **common, **saturate(url, payload, c, args.seconds, args.client_processes, ivy.pid))
    finally:
        stop(ivy)
        stand_in.send_signal(signal.SIGTERM)
        stand_in.wait(30)
    if args.stages and stages.is_file():  # the latency cells' requests, in order, warm-ups first
        recs = [json.loads(line) for line in stages.read_text().splitlines() if line.strip()]
        for i, enc in enumerate(latency_p50):
            part = recs[i * (warmup + args.n) + warmup:(i + 1) * (warmup + args.n)]
            rows = stage_rows(part)
            for row in rows:
                rec.emit(bench="ivy-stage", encoding=enc, clients=1, **row, **common)
            inside = next((r["p50_us"] for r in rows if r["stage"] == "total"), 0.0)
            rec.emit(bench="ivy-stage", encoding=enc, clients=1, stage="outside the app (client p50 - total p50)",
                     p50_us=round(latency_p50[enc] * 1e3 - inside, 1), mean_us=None, n=len(part), **common)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
