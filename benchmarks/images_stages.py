"""Where one JPEG's time goes in Ivy (issue 51): every stage of one image request, on any machine (a CPU one too).

    python -m benchmarks.images_stages --out DIR                   # a tiny CLIP, its Tulip on this machine's CPU
    python -m benchmarks.images_stages --ivy-root before=/tmp/old  # also an Ivy from another tree, in turns
    python -m benchmarks.images_stages --device cuda --out DIR     # the CLIP ViT-B/16 preset, its Tulip on a GPU
    python -m benchmarks.images_stages --tulip HOST:PORT --model DIR   # a Tulip already serving DIR

It starts a Tulip serving `--preset` as transformers builds it (random weights; on a CPU benchmarks.images'
`--smoke` towers: image side 224 and patch 16 kept, so Ivy's work is the real preset's), and one Ivy per tree (this
one, and each `--ivy-root LABEL=PATH`: their requests in turns, one each, so a machine's load falls on all alike),
each with IVY_STAGES on (ivy/front.py). The request is the image benchmark's (`benchmarks.images_served.photo_jpeg`:
640 x 480, ~100 KB, as a data URI in a Jina item on /v1/embeddings, one kept-alive connection, sequential). Rows,
one JSON object each (`bench: "images-stages"`):
- `cell: "ivy"`: a tree's end-to-end p50 / p99 (the client's clock), its process's CPU time per request (all its
  threads: `cpu_ms_per_request`, robust to a loaded machine where wall times are not), the p50 of each of Ivy's
  stages in microseconds (`stages_us`: receive = the body read, decode = msgspec's JSON parse, checks,
  decode_images = the images' pool work and the hand-offs to and from it, balancer, grpc = the Tulip call to its
  reply, encode = the reply's JSON, send), and `outside_us`: what the client saw less Ivy's stages (the HTTP
  server's parsing and writes, the loopback, the client's own work);
- `cell: "grpc"`: the same image's pixels (as `ivy.images` makes them) straight to the Tulip over trellis.client's
  stream, p50, back to back (`gap_ms` 0) and with `--gap-ms` of idle before each call, as Ivy's calls come (Tulip's
  loop, the device and the cores idle meanwhile): what Ivy's `grpc` stage cannot go under;
- `cell: "thread"`: `ivy.images`' steps of that JPEG on this thread, p50 each (microseconds): base64, Image.open
  (header), load (the JPEG decode), EXIF transpose, RGB, resize_crop, copy into the request's array, pixels_of
  (all but base64 again), and `cpu` (the thread's CPU time for one image); back to back and after `--gap-ms`;
  `resize`: "c" (ivy.resample's C, Ivy's way where it builds) or "pillow" (the C switched off: Pillow's resize, the
  way before it; back to back, in turns with "c");
- `cell: "handoff"`: an empty function through Ivy's image pool and back, on a uvloop event loop, p50: what a
  thread hop costs (each way together) with nothing else running.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, percentiles, run_client, stop

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("receive", "decode", "checks", "decode_images", "balancer", "grpc", "encode", "send")


def _p50(xs) -> float:
    return round(float(np.percentile(np.asarray(xs, float), 50)), 1)


class ThreadSteps:
    """Each of ivy.images' steps on this thread, one after the other per run (`run(n)`), microseconds; the resize
    by ivy.resample's C (`resize` "c", Ivy's way where it builds) or by Pillow (`resize` "pillow": the C switched
    off while this one runs, the way before it)."""

    def __init__(self, jpeg: bytes, directory: Path, resize: str = "c"):
        self.uri = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
        self.directory = directory
        self.resize = resize
        self.t: dict[str, list[float]] = {k: [] for k in ("base64", "open", "load", "exif", "rgb", "resize_crop",
                                                           "copy", "pixels_of")}
        self.cpu: list[float] = []  # one image's thread CPU time, microseconds
        self.run(10)
        for v in (*self.t.values(), self.cpu):
            v.clear()

    def run(self, n: int, gap_s: float = 0.0) -> None:
        from ivy import images, resample

        was = list(resample._USABLE)
        resample._USABLE[:] = [resample.usable(images._vertical_first) and self.resize == "c"]
        try:
            self._run(n, gap_s)
        finally:
            resample._USABLE[:] = was

    def _run(self, n: int, gap_s: float) -> None:
        from PIL import Image, ImageOps

        from ivy.images import FORMATS, Limits, b64_bytes, pixels_of, preprocessor, to_rgb

        uri, t = self.uri, self.t
        prep, limits = preprocessor(self.directory), Limits(64 << 20, 1 << 28)
        out = np.empty((1, prep.side, prep.side, 3), np.uint8)
        clock, cpu = time.perf_counter, time.thread_time_ns
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            c0 = cpu()
            t0 = clock()
            data = b64_bytes(uri, "input[0]", limits)
            t1 = clock()
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            t2 = clock()
            img.load()
            t3 = clock()
            img = ImageOps.exif_transpose(img, in_place=True) or img
            t4 = clock()
            rgb = to_rgb(img)
            t5 = clock()
            a = prep(rgb)
            t6 = clock()
            out[0] = a
            t7 = clock()
            pixels_of(data, "input[0]", limits, prep)
            t8 = clock()
            c1 = cpu()
            for k, (s, e) in zip(t, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7), (t7, t8))):
                t[k].append((e - s) * 1e6)
            self.cpu.append((c1 - c0) / 2e3)  # the steps then pixels_of again: half is one image's

    def p50(self) -> dict:
        return {**{k: _p50(v) for k, v in self.t.items()}, "cpu": _p50(self.cpu)}


def handoff(n: int) -> float:
    """An empty function through ivy.images' pool and back on a uvloop loop, p50 microseconds."""
    import uvloop

    from ivy import images

    async def go():
        loop = asyncio.get_running_loop()
        ts = []
        for _ in range(n + 20):
            t0 = time.perf_counter()
            await loop.run_in_executor(images._POOL, int)
            ts.append((time.perf_counter() - t0) * 1e6)
        return _p50(ts[20:])

    return uvloop.run(go())


class Ivy:
    """One Ivy process (from `root`) before `target`, with IVY_STAGES written to `work`."""

    def __init__(self, label: str, root: Path, directory: Path, target: str, work: Path):
        from benchmarks.gateway import spawn

        self.label, self.port = label, free_port()
        self.stages = work / f"stages-{label}.jsonl"
        self.stages.unlink(missing_ok=True)
        self.log = work / f"ivy-{label}.log"
        self.proc = spawn(["-m", "ivy", "--model", str(directory), "--served-model-name", "m", "--tulip", target,
                           "--port", str(self.port), "--workers", "1", "--keep-alive-s", "3600"], self.log, {"IVY_STAGES": str(self.stages)},
                          root)
        self.conn: http.client.HTTPConnection | None = None
        self.ms: list[float] = []
        self.cpu_ms = float("nan")

    def ready(self) -> None:
        from benchmarks.gateway import http_ok, wait_until

        wait_until(lambda: http_ok(f"http://127.0.0.1:{self.port}/ready"), f"ivy {self.label}", self.proc, self.log,
                   300)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def once(self, body: bytes, keep: bool) -> bytes:
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"Ivy {self.label} answered {r.status}: {data[:300]!r}")
        if keep:
            self.ms.append((time.perf_counter() - t0) * 1e3)
        return data

    def records(self, warm: int) -> list[dict]:
        """The stage records of the timed requests (Ivy writes them at shutdown: call after `stop`)."""
        lines = self.stages.read_text().splitlines() if self.stages.is_file() else []
        return [json.loads(x) for x in lines if x.strip()][warm:]

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        stop(self.proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="timed requests per Ivy (and gRPC calls, thread rounds)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds the requests are split into, Ivys in turns")
    ap.add_argument("--jpeg-kb", type=float, default=100, help="the test JPEG's size to aim at (640 x 480)")
    ap.add_argument("--ivy-root", action="append", default=[], metavar="LABEL=PATH",
                    help="another tree's Ivy beside this one's (repeatable)")
    ap.add_argument("--gap-ms", type=float, default=8.0, help="also the gRPC and thread cells with this pause before "
                    "each request / run (as Ivy's requests come: Tulip, the thread and the cores idle in between); 0: "
                    "back to back only")
    ap.add_argument("--tulip", default="", help="a Tulip already serving --model (else one is started on the CPU)")
    ap.add_argument("--device", default="cpu", help="the started Tulip's device: cpu or cuda")
    ap.add_argument("--preset", default="preset:clip-vit-base-patch16", help="the image model the Tulip serves "
                    "(built by transformers, random weights)")
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                    help="benchmarks.images' --smoke towers (default: on a CPU; Ivy's work is the same either way)")
    ap.add_argument("--tulip-args", default=None, help="the started Tulip's flags beyond model, port and device "
                    "(default on a CPU: --spin-ms 0, no polling core where two are shared; on CUDA: Tulip's own)")
    ap.add_argument("--model", type=Path, default=None, help="with --tulip: the directory it serves")
    ap.add_argument("--work", type=Path, default=None, help="where the tiny model and logs go (default: temporary)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from benchmarks.images_served import _image_input, photo_jpeg

    work = args.work or Path(tempfile.mkdtemp(prefix="trellis-images-stages-"))
    work.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out, "images_stages")
    tulip = None
    if args.tulip:
        if args.model is None:
            ap.error("--tulip needs --model (the directory that Tulip serves)")
        directory, target = args.model, args.tulip
    else:
        from benchmarks.gateway import spawn, wait_until
        from benchmarks.images import prepare

        tiny = args.device == "cpu" if args.tiny is None else args.tiny
        directory, hf = prepare(args.preset, work, tiny=tiny)
        del hf
        port = free_port()
        target = f"127.0.0.1:{port}"
        log = work / "tulip.log"
        tulip_args = args.tulip_args if args.tulip_args is not None else "--spin-ms 0" if args.device == "cpu" else ""
        tulip = spawn(["-m", "tulip", "--model", str(directory), "--port", str(port), "--device", args.device,
                       *tulip_args.split()], log)
    ivys = [Ivy("this", ROOT, directory, target, work)]
    ivys += [Ivy(label, Path(path), directory, target, work)
             for label, _, path in (r.partition("=") for r in args.ivy_root)]
    jpeg, quality = photo_jpeg(args.jpeg_kb)
    uri, _, _, pixels = _image_input(jpeg, directory)
    body = json.dumps({"model": "m", "input": [{"image": uri}]}).encode()
    from PIL import Image

    w, h = Image.open(io.BytesIO(jpeg)).size
    common = dict(bench="images-stages", model=args.preset if not args.tulip else str(directory), jpeg_bytes=len(jpeg), jpeg_size=f"{w}x{h}", jpeg_quality=quality,
                  body_bytes=len(body), tulip="given" if args.tulip else f"started here, {args.device}")
    warm = 20
    try:
        if tulip is not None:
            wait_until(lambda: "TULIP_READY" in log.read_text(), "tulip", tulip, log, 600)
        for ivy in ivys:
            ivy.ready()
            for _ in range(warm):
                ivy.once(body, False)
        from trellis.client import TulipClient

        grpc_ms: dict[float, list[float]] = {0.0: [], args.gap_ms: []}

        async def direct(count: int, gap_s: float):
            async with TulipClient(target) as c:
                for i in range(count + 5):
                    if gap_s:
                        time.sleep(gap_s)  # the client's loop blocked: as Ivy's, Tulip and the cores idle meanwhile
                    t0 = time.perf_counter()
                    await c.embed_images(pixels[None])
                    if i >= 5:
                        grpc_ms[gap_s * 1e3].append((time.perf_counter() - t0) * 1e3)

        from benchmarks.gateway import tree_cpu_s

        def cpu_s(proc) -> float:  # its threads' user + system seconds (uvicorn's worker is a child process)
            return sum(tree_cpu_s(proc.pid).values())

        from ivy import images as ivy_images, resample

        resample_c = resample.usable(ivy_images._vertical_first)  # ivy.resample's C built and checked here
        cpu0 = {ivy.label: cpu_s(ivy.proc) for ivy in ivys}
        per = max(1, args.n // args.rounds)
        steps, cold = ThreadSteps(jpeg, directory), ThreadSteps(jpeg, directory)
        pillow = ThreadSteps(jpeg, directory, "pillow")
        for _ in range(args.rounds):  # the Ivys and the direct calls in turns
            for _ in range(per):  # one request of each Ivy in turn
                for ivy in ivys:
                    ivy.once(body, True)
            run_client(direct(per, 0.0))
            if args.gap_ms:
                run_client(direct(per, args.gap_ms / 1e3))
            steps.run(per)
            pillow.run(per)
            if args.gap_ms:
                cold.run(per, args.gap_ms / 1e3)
        for ivy in ivys:
            ivy.cpu_ms = (cpu_s(ivy.proc) - cpu0[ivy.label]) * 1e3 / len(ivy.ms)
        for gap, ms in grpc_ms.items():
            rec.emit(**common, cell="grpc", path="trellis.client stream, one image's pixels", gap_ms=gap,
                     **percentiles(ms))
        rec.emit(**common, cell="thread", gap_ms=0, resize="c" if resample_c else "pillow", steps_us=steps.p50())
        rec.emit(**common, cell="thread", gap_ms=0, resize="pillow", steps_us=pillow.p50())
        if args.gap_ms:
            rec.emit(**common, cell="thread", gap_ms=args.gap_ms, resize="c" if resample_c else "pillow",
                     steps_us=cold.p50())
        rec.emit(**common, cell="handoff", p50_us=handoff(args.n))
    finally:
        for ivy in ivys:
            ivy.stop()
        if tulip is not None:
            stop(tulip)
    for ivy in ivys:
        recs = ivy.records(warm)
        stages = {k: _p50([r.get(k, 0.0) for r in recs]) for k in STAGES if any(k in r for r in recs)}
        inside = [r["total"] for r in recs]
        outside = [m * 1e3 - r for m, r in zip(ivy.ms, inside)] if len(inside) == len(ivy.ms) else []
        rec.emit(**common, cell="ivy", ivy=ivy.label, **percentiles(ivy.ms), cpu_ms_per_request=round(ivy.cpu_ms, 3),
                 stages_us=stages,
                 inside_us=_p50(inside) if inside else None, outside_us=_p50(outside) if outside else None)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
