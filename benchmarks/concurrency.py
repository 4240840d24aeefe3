"""Concurrency through Ivy, text in (the published fourth workload): batch 1, L = 512 tokens,
1..16 concurrent HTTP clients, p50 / p99 latency per level; tokenization included. Then bulk
through Ivy: 4 client processes, each sending batches of 100 pre-tokenized 512-token inputs
(base64 replies), in embeddings/s: with `--replicas 2` on a two-GPU host this is the scale-out
check (>= 1.9x one replica).

    python -m benchmarks.concurrency --model preset:bge-m3 --out benchmarks/results [--replicas 1] [--n 2000]

Starts `deploy.local` (one GPU per replica; Tulip settings through TULIP_* variables, e.g.
TULIP_COMPILE=true TULIP_WARMUP=1-16x512,32x512: every batch 1..16 clients form), checks correctness first (the served vector of the
benchmark text against a float32 eager engine on the same tokens: cosine >= 0.999, else abort),
then runs each level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import (Recorder, bulk_clients, free_port, model_tag, percentiles, progress,
                               spawn_until_ready)

# ../shared/DESIGN.md, workload 4 (approximate, read off the published chart): p50 ms.
PUBLISHED_APPROX = {1: {"vllm-0.22": 12.5, "tulip-rust": 3.0}, 16: {"vllm-0.22": 23.0, "tulip-rust": 16.5}}


WORDS = ("search engines rank documents by relevance to a query using many signals and learned "
         "representations of meaning").split()


def text_of(tokenizer, L: int, seed: int | None = None, words: tuple[str, ...] | list[str] = WORDS) -> str:
    """A text that tokenizes to L tokens, special tokens included (or as close below as the
    tokenizer allows), so a request is the published 1 x L and not a bucket above it. `tokenizer`:
    a tokenizer.json path or a loaded `tokenizers.Tokenizer`; `seed` draws the words in a seeded
    order (distinct texts of one length), None repeats `words` in order."""
    from tokenizers import Tokenizer

    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.from_file(str(tokenizer))
    tok.no_truncation()
    tok.no_padding()
    floor = len(tok.encode("").ids)  # the special tokens alone
    if L <= floor:
        raise ValueError(f"--length {L}: this tokenizer adds {floor} special tokens; ask for more")
    if seed is not None:
        g = np.random.default_rng(seed)
        words = [words[i] for i in g.integers(0, len(words), 4 * L)]
    text, i = "", 0
    while len(tok.encode(text).ids) < L:
        text += words[i % len(words)] + " "
        i += 1
    while len(tok.encode(text).ids) > L and len(text) > 1:
        text = text[:-1]
    return text


def start_stack(model: str, replicas: int, port: int, log: Path, ivy_workers: int = 1):
    return spawn_until_ready(["deploy.local", "--model", model, "--replicas", str(replicas), "--port", str(port),
                              "--ivy-workers", str(ivy_workers)], "Trellis is ready", log)


def gate(url: str, model_name: str, model: str, text: str, L: int) -> float:
    import httpx
    import torch

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig
    from trellis.modelref import resolve_model_path

    r = httpx.post(url + "/v1/embeddings", json={"model": model_name, "input": text, "truncate": True}, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"Ivy answered {r.status_code}: {r.text}")
    served = np.array(r.json()["data"][0]["embedding"])
    from tokenizers import Tokenizer

    path = resolve_model_path(model)
    ref_engine = Engine(EngineConfig(model=model, device="cuda" if torch.cuda.is_available() else "cpu",
                                     dtype="float32", attention="sdpa", graphs="off"))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(ref_engine.spec.max_seq_len)
    ref = ref_engine.step(Batch.from_sequences([tok.encode(text).ids])).synchronize().numpy()[0]
    del ref_engine
    return float(served @ ref / np.linalg.norm(served) / np.linalg.norm(ref))


CLIENTS_PER_PROCESS = 4  # a Python HTTP client costs ~1 ms of CPU per request: spread them out


def http_client() -> str:
    """The HTTP client the latency cells use: aiohttp where installed (about 0.2 ms per request of its
    own on a 2-core CPU), else httpx (about 0.8 ms there: a quarter of a small request's latency)."""
    try:
        import aiohttp
        return f"aiohttp {aiohttp.__version__}"
    except ImportError:
        import httpx
        return f"httpx {httpx.__version__}"


async def _clients(url: str, route: str, body: dict, clients: int, per: int) -> tuple[list[float], float, float]:
    """`clients` asyncio clients each sending `per` timed requests (after one that warms the connection
    and graphs; all start timing together); returns the latencies and the span of the timed requests."""
    lat: list[float] = []
    payload = json.dumps(body).encode()
    headers = {"content-type": "application/json"}

    if http_client().startswith("aiohttp"):
        import aiohttp

        def session():
            return aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=120))

        async def post(s):
            async with s.post(route, data=payload, headers=headers) as r:
                await r.read()
                r.raise_for_status()
    else:
        import httpx

        def session():
            return httpx.AsyncClient(base_url=url, timeout=120)

        async def post(c):
            (await c.post(route, content=payload, headers=headers)).raise_for_status()

    warm = asyncio.Barrier(clients + 1)  # and the clock
    bar = progress(clients * per, f"{clients} clients {route}")
    ends: list[float] = []

    async def client():
        async with session() as s:
            await post(s)  # warms the connection and graphs
            await warm.wait()
            for _ in range(per):
                t0 = time.perf_counter()
                await post(s)
                lat.append((time.perf_counter() - t0) * 1e3)
                bar.update()
            ends.append(time.perf_counter())

    async def timed():
        await warm.wait()
        return time.perf_counter()

    start, *_ = await asyncio.gather(timed(), *(client() for _ in range(clients)))
    bar.close()
    return lat, start, max(ends)


def _client_process(url, route, body, clients, per, q):
    q.put(asyncio.run(_clients(url, route, body, clients, per)))


def http_level(url: str, route: str, body: dict, clients: int, n: int) -> dict:
    """`clients` concurrent HTTP clients (asyncio, at most CLIENTS_PER_PROCESS per process) posting
    `body` to `route`, `n` requests in all, each sent as soon as the client's previous one is answered:
    latency percentiles and requests/s over the span from the first timed request to the last reply."""
    import multiprocessing as mp

    per = max(1, n // clients)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shares = [CLIENTS_PER_PROCESS] * (clients // CLIENTS_PER_PROCESS) + [clients % CLIENTS_PER_PROCESS]
    procs = [ctx.Process(target=_client_process, args=(url, route, body, k, per, q)) for k in shares if k]
    for p in procs:
        p.start()
    res = [q.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join()
    lat = [x for r in res for x in r[0]]
    span = max(r[2] for r in res) - min(r[1] for r in res)
    return {**percentiles(lat), "req_per_s": round(len(lat) / span, 2), "client_processes": len(procs),
            "client": http_client()}


def level(url: str, model_name: str, text: str, clients: int, n: int) -> dict:
    """Batch 1 text embeddings from `clients` concurrent clients (http_level)."""
    return http_level(url, "/v1/embeddings", {"model": model_name, "input": text, "truncate": True}, clients, n)


def _bulk_client(url, model_name, L, n_req, seed, barrier, q):
    import httpx

    g = np.random.default_rng(seed)
    body = {"model": model_name, "input": [g.integers(5, 1000, L).tolist() for _ in range(100)],
            "encoding_format": "base64"}
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post("/v1/embeddings", json=body).raise_for_status()  # connection and graphs warm
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(n_req):
            c.post("/v1/embeddings", json=body).raise_for_status()
        q.put((t0, time.perf_counter(), 100 * n_req))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--ivy-workers", type=int, default=1, help="Ivy worker processes")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--n", type=int, default=2000, help="requests per level (split over its clients)")
    ap.add_argument("--bulk-requests", type=int, default=10, help="bulk requests (of 100 inputs) per client; 0: none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from trellis.modelref import resolve

    ref = resolve(args.model)
    path, served_name = ref.path, ref.name
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out or Path("/tmp")) / "stack.log"
    port = free_port()
    proc = start_stack(args.model, args.replicas, port, log, args.ivy_workers)
    url = f"http://127.0.0.1:{port}"
    rec = Recorder(args.out, f"concurrency_{model_tag(args.model)}_replicas-{args.replicas}"
                             + (f"_workers-{args.ivy_workers}" if args.ivy_workers > 1 else ""))
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10):
            pass
        text = text_of(path / "tokenizer.json", args.length)
        common = dict(model=args.model, backend=f"trellis-ivy replicas={args.replicas} workers={args.ivy_workers}",
                      transport="http", replicas=args.replicas, ivy_workers=args.ivy_workers)
        cos = gate(url, served_name, args.model, text, args.length)
        rec.emit(bench="gate", min_cosine=round(cos, 6), passed=cos >= 0.999, **common)
        if cos < 0.999:
            print(f"correctness gate FAILED: cosine {cos:.6f} < 0.999; no timings taken", file=sys.stderr)
            return 1
        for c in map(int, args.levels.split(",")):
            pub = PUBLISHED_APPROX.get(c, {})
            rec.emit(bench="concurrency", cell=f"{c} clients x 1x{args.length} text", seqs=1, tokens=args.length,
                     clients=c, published_approx=pub or None, **common,
                     **level(url, served_name, text, c, args.n))
        if args.bulk_requests:
            rec.emit(bench="bulk-ivy", cell=f"100x{args.length} x4 clients via Ivy", seqs=100, tokens=args.length,
                     **common, **bulk_clients(_bulk_client, (url, served_name, args.length, args.bulk_requests),
                                              args.bulk_requests))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
