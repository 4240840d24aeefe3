"""benchmarks.images' served paths: a Tulip (and an Ivy before it) started for the run, the gRPC cells
(`trellis.client`), the Ivy cell (one JPEG data URI a request, over HTTP), the decode cell (`ivy.images` in this
thread), and the test picture: a deterministic, natural-looking JPEG of about 100 KB."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import re
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import free_port, percentiles, run_client, stop

TARGETS = {"grpc 1 image p50": 1.0, "ivy 1 JPEG p50": 3.0}  # issue 51's measured targets (ms)


def random_pixels(n: int, side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


# --- a natural-looking JPEG ---------------------------------------------------------------------------------------

def photo_jpeg(target_kb: float = 100, width: int = 640, height: int = 480, seed: int = 0) -> tuple[bytes, int]:
    """(JPEG bytes, quality): smooth colour gradients, soft blobs and grain, deterministic; the quality whose file
    comes closest to `target_kb` (1,000 bytes)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.5, 3, 2).tolist() + [rng.uniform(0, 6.28)]
        img[..., c] = 128 + 70 * np.sin(2 * np.pi * (fx * x / width + fy * y / height) + ph)
    for _ in range(12):  # soft blobs of colour
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(20, 120)
        img += np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None] * rng.uniform(-80, 80, 3)
    img += rng.normal(0, 7, img.shape)  # sensor grain: what makes a photo's JPEG ~100 KB rather than ~20
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")

    def jpeg(q: int) -> bytes:
        buf = io.BytesIO()
        pic.save(buf, "JPEG", quality=q)
        return buf.getvalue()

    best = min(range(5, 100, 5), key=lambda q: abs(len(jpeg(q)) - target_kb * 1000))
    best = min(range(max(1, best - 4), min(100, best + 5)), key=lambda q: abs(len(jpeg(q)) - target_kb * 1000))
    return jpeg(best), best


# --- Tulip and Ivy ------------------------------------------------------------------------------------------------

def _metric(port: int, name: str) -> float:
    """One of Tulip's gauges (tulip_graph_*) from its /metrics; nan where it has none (no graphs: a CPU)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def _graph_delta(port: int, before: tuple[float, float]) -> dict:
    now = (_metric(port, "tulip_graph_replays"), _metric(port, "tulip_graph_oversize"))
    if any(np.isnan(v) for v in now):
        return {}
    return {"graph_replays": int(now[0] - before[0]), "oversize_steps": int(now[1] - before[1])}


def _graphs_now(port: int) -> tuple[float, float]:
    return _metric(port, "tulip_graph_replays"), _metric(port, "tulip_graph_oversize")


async def grpc_cells(rec, common, target: str, metrics_port: int, side: int, big: int, n: int, rounds: int,
                     inflight: list[int]) -> None:
    from trellis.client import TulipClient

    one, many = random_pixels(1, side, seed=5), random_pixels(big, side, seed=6)
    base = dict(**common, path="tulip gRPC", client="trellis.client (stream)", input="uint8 pixels")
    async with TulipClient(target) as c:
        info = await c.info()
        for _ in range(min(20, n)):  # warm: the stream open, graphs captured (each bucket's second hit)
            await c.embed_images(one)
        for _ in range(min(3, rounds)):
            await c.embed_images(many)
        for k in inflight:
            before = _graphs_now(metrics_port)
            lat: list[float] = []

            async def worker(count):
                for _ in range(count):
                    t0 = time.perf_counter()
                    await c.embed_images(many)
                    lat.append((time.perf_counter() - t0) * 1e3)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(max(1, rounds // k)) for _ in range(k)))
            dt = time.perf_counter() - t0
            rec.emit(**base, cell="grpc", batch=big, requests_in_flight=k, **percentiles(lat),
                     images_per_s=round(big * len(lat) / dt, 1), tulip_step_budget=info.max_batch_tokens,
                     **_graph_delta(metrics_port, before))
        before = _graphs_now(metrics_port)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            await c.embed_images(one)
            ts.append((time.perf_counter() - t0) * 1e3)
        rec.emit(**base, cell="grpc", batch=1, requests_in_flight=1, **percentiles(ts),
                 target_p50_ms=TARGETS["grpc 1 image p50"], **_graph_delta(metrics_port, before))


def _image_input(jpeg: bytes, directory: Path):
    """The JPEG as a data URI, and what ivy.images makes of it: (uri, limits, preprocessor, uint8 pixels)."""
    from ivy.images import Limits, b64_bytes, pixels_of, preprocessor

    uri = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    prep, limits = preprocessor(directory), Limits(64 << 20, 1 << 28)
    return uri, limits, prep, pixels_of(b64_bytes(uri, "input[0]", limits), "input[0]", limits, prep)[0]


def ivy_cell(rec, common, ivy_port: int, served: str, target: str, directory: Path, jpeg: bytes, n: int,
             meta: dict) -> None:
    """One JPEG a request through Ivy, sequential; its vector against Tulip's for ivy.images' pixels of it."""
    from trellis.client import TulipClient

    uri, _, _, pixels = _image_input(jpeg, directory)
    body = json.dumps({"model": served, "input": [{"image": uri}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", ivy_port, timeout=60)
    ts, vec = [], None
    warm = min(20, n)
    for i in range(warm + n):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"Ivy answered {r.status}: {data[:500]!r}")
        if i >= warm:
            ts.append((time.perf_counter() - t0) * 1e3)
        elif vec is None:
            vec = np.asarray(json.loads(data)["data"][0]["embedding"], np.float32)
    conn.close()

    async def direct():
        async with TulipClient(target) as c:
            return await c.embed_images(pixels[None])

    want = run_client(direct())[0]
    cos = float(vec @ want / (np.linalg.norm(vec) * np.linalg.norm(want)))
    rec.emit(**common, cell="ivy", path="ivy HTTP (JPEG data URI)", client="http.client, one connection", batch=1,
             **meta, **percentiles(ts), target_p50_ms=TARGETS["ivy 1 JPEG p50"], cos_vs_tulip=round(cos, 6))


def decode_cell(rec, common, directory: Path, jpeg: bytes, n: int, meta: dict) -> None:
    """ivy.images' work on one JPEG data URI (base64, decode, RGB, resize, crop) in this thread."""
    from ivy.images import b64_bytes, pixels_of

    uri, limits, prep, pixels = _image_input(jpeg, directory)
    ts = []
    warm = min(10, n)
    for _ in range(warm + n):
        t0 = time.perf_counter()
        pixels_of(b64_bytes(uri, "input[0]", limits), "input[0]", limits, prep)
        ts.append((time.perf_counter() - t0) * 1e3)
    p = percentiles(ts[warm:])
    rec.emit(**common, cell="decode", path="ivy.images decode + preprocess (one thread)", batch=1, **meta,
             **p, images_per_s=round(1e3 / p["mean_ms"], 1), output=f"uint8 {list(pixels.shape)}")


class Servers:
    """A Tulip (and an Ivy before it) serving `directory`, started now; `ready()` waits for them."""

    def __init__(self, directory: Path, served: str, device: str, tulip_args: list[str], ivy: bool, log_dir: Path):
        from benchmarks.gateway import spawn

        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.logs = (log_dir / f"tulip-{served}.log", log_dir / f"ivy-{served}.log")
        self.tulip = spawn(["-m", "tulip", "--model", str(directory), "--served-model-name", served, "--port",
                            str(self.port), "--metrics-port", str(self.metrics_port), "--device", device, *tulip_args],
                           self.logs[0])
        self.ivy, self.ivy_port = None, free_port()
        if ivy:
            self.ivy = spawn(["-m", "ivy", "--model", str(directory), "--served-model-name", served, "--tulip",
                              self.target, "--port", str(self.ivy_port), "--workers", "1"], self.logs[1])

    def ready(self, timeout: float = 900) -> None:
        from benchmarks.gateway import http_ok, wait_until

        wait_until(lambda: "TULIP_READY" in self.logs[0].read_text(), "tulip", self.tulip, self.logs[0], timeout)
        if self.ivy is not None:
            wait_until(lambda: http_ok(f"http://127.0.0.1:{self.ivy_port}/ready"), "ivy", self.ivy, self.logs[1],
                       timeout)

    def signal(self) -> None:
        """SIGTERM to both at once (their shutdowns overlap); `stop` waits."""
        for p in (self.ivy, self.tulip):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.signal()
        for p in (self.ivy, self.tulip):
            if p is not None:
                stop(p, 0)  # (signal 0: sent above) waited for, killed past 30 s
