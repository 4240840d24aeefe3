"""Image embeddings (issue 51): throughput and single-image latency in-process, over gRPC and through Ivy, beside
transformers eager and `torch.compile`d on the same weights, in the same run.

    python -m benchmarks.images --out DIR                  # both presets (CLIP ViT-B/16, SigLIP base), every cell
    python -m benchmarks.images --model preset:clip-vit-base-patch16 --cells engine,hf,grpc --batch 1,8 --device cpu
    python -m benchmarks.images --smoke [--out DIR]        # every cell, tiny towers, on the CPU (a harness check)
    python -m benchmarks.images --chart DIR                # redraw DIR's charts from its images_*.jsonl

The presets have real shapes, RANDOM weights and no weight files: the run builds transformers' own model
(`CLIPModel` / `SiglipModel`) from the preset's config.json (seed 0), saves it in the transformers layout beside
the preset's preprocessor_config.json and tokenizer into `--work`, and every path reads that directory (ROSE,
Tulip, Ivy) or is that model (the transformers cells): the same weights everywhere (a model directory or Hub id
with weights is read as it is). Cells, one JSON object each (`bench: "images"`, machine, versions, date):
- `gate`: ROSE's vectors against transformers' L2-normalised `get_image_features` on the same pixels (cosine;
  below 0.99 in half precision / 0.9999 in float32 the run stops, exit 1, no timings);
- `engine`: `Engine.step_images` on uint8 host pixels [N, S, S, 3] at each `--batch` N: p50 / p99 ms of a step
  (pixels staged, normalised on the device, result copied back, synchronised) and images/s, steps one at a time
  and (N > 1) two in flight; CUDA graphs on, `max_graph_tokens` raised so that the largest batch has a graph (the
  engine's default, 16,384 tokens, captures at most 64 images of 196 / 197 tokens); the graph replays and
  oversize steps each cell caused are in its row;
- `hf-eager` / `hf-compile`: transformers' `get_image_features` + L2 normalisation + copy to the host at the same
  N, same dtype (bfloat16 on CUDA, float32 on a CPU), SDPA attention; pixel_values as its image processor leaves
  them (float, rescaled, normalised, channels first) made on the device in the model's dtype BEFORE the timing:
  that prep is not timed (transformers gets it free; ROSE's rows pay for theirs); compiled with
  `torch.compile(mode="reduce-overhead")` on CUDA (default mode on a CPU), the first call's time (the compile)
  in the row as `first_call_s`. At each batch size the in-process cells take turns in `--rounds` rounds (a host
  or GPU clock that drifts falls on all alike): images/s is the median round's (`images_per_s_rounds`: each);
- `grpc`: a Tulip process (`python -m tulip`, its defaults plus `--tulip-args`), `trellis.client` here:
  `--grpc-batch` images a request (pre-processed uint8 pixels), images/s with 1 and 2 requests in flight, and
  one 224 x 224 image a request, p50 / p99 (`--n`), with Tulip's graph replays / oversize steps (its metrics);
- `ivy`: an Ivy process before that Tulip: one ~100 KB JPEG (640 x 480, drawn here deterministically: smooth
  gradients and noise, the quality chosen to come closest to `--jpeg-kb`) as a data URI in a Jina item on
  `/v1/embeddings`, sequential (http.client, one kept-alive connection), p50 / p99, decode and preprocessing
  included; its vector checked against Tulip's for the pixels `ivy.images` makes of the same file;
- `decode`: `ivy.images`' base64 + decode + preprocessing of that JPEG in this process, one thread (one core).
Charts: `images_<model>.png`: images/s per path, single-image p50 per path. A cell that raises leaves a row with
its `error` and the others still run (exit status 1): a device call keeps what it could measure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, model_tag, percentiles, pyplot, read_rows, run_client
from benchmarks.images_served import TARGETS, Servers, decode_cell, grpc_cells, ivy_cell, photo_jpeg, random_pixels

PRESETS = ("preset:clip-vit-base-patch16", "preset:siglip-base-patch16-224")
CELLS = ("engine", "hf", "hf-compile", "grpc", "ivy", "decode")
# --smoke's towers: the presets' configs shrunk; image side and patch kept (197 / 196 tokens an image)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


# --- the model: one directory, the same weights on every path ---------------------------------------------------

def hf_class(model_type: str):
    from transformers import CLIPModel, SiglipModel

    if model_type not in ("clip", "siglip"):
        raise SystemExit(f"benchmarks.images: model_type {model_type!r}: only CLIP and SigLIP have image towers")
    return CLIPModel if model_type == "clip" else SiglipModel


def prepare(model: str, work: Path, tiny: bool) -> tuple[Path, object]:
    """(directory, transformers model in float32 on the CPU). A preset: transformers' model built from its
    config.json (seed 0; `tiny`: towers of TINY), rounded to bfloat16 and saved so (what the GPU runs), beside the
    preset's preprocessor_config.json and tokenizer files. Anything else: its directory, read by transformers."""
    import torch

    from trellis.modelref import resolve

    ref = resolve(model)
    cfg = json.loads((ref.path / "config.json").read_text())
    cls = hf_class(cfg.get("model_type", ""))
    if not ref.random_weights:
        return ref.path, cls.from_pretrained(ref.path, dtype=torch.float32).eval()
    if tiny:
        for tower in ("text_config", "vision_config"):
            cfg[tower].update(TINY)
        if "projection_dim" in cfg:
            cfg["projection_dim"] = cfg["text_config"]["projection_dim"] = cfg["vision_config"]["projection_dim"] = 16
    d = work / (model_tag(model) + ("-tiny" if tiny else ""))
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    hf = cls(cls.config_class.from_dict(cfg)).to(torch.bfloat16).eval()
    hf.save_pretrained(d)
    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ref.path / name, d / name)
    return d, hf.float()


def hf_pixels(pixels: np.ndarray, directory: Path, device, dtype):
    """transformers' pixel_values for uint8 [N, S, S, 3] pixels already at the model's size: rescaled, normalised
    by preprocessor_config.json's mean / std, channels first; on `device` in `dtype`."""
    import torch

    cfg = json.loads((directory / "preprocessor_config.json").read_text())
    mean = torch.tensor(cfg["image_mean"], dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(cfg["image_std"], dtype=torch.float32).view(1, 3, 1, 1)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() * float(cfg.get("rescale_factor", 1 / 255))
    return ((x - mean) / std).to(device, dtype)


def hf_features(hf):
    """pixel_values -> L2-normalised float32 image vectors on the device, as ROSE's step computes them."""
    import torch.nn.functional as F

    def features(pv):
        out = hf.get_image_features(pixel_values=pv)
        out = getattr(out, "pooler_output", out)  # transformers 5 returns a model output, 4 the tensor
        return F.normalize(out.float(), dim=-1)

    return features


# --- timing -------------------------------------------------------------------------------------------------------

def in_flight(launch, depth: int = 2):
    """A step function keeping `depth` steps in flight: `launch()` returns a LazyTensor; each call launches one and
    waits for the one `depth - 1` behind it (the next staged and launched while one runs); `drain()` waits for the
    rest."""
    q: deque = deque()

    def step():
        q.append(launch())
        if len(q) >= depth:
            q.popleft().synchronize()

    def drain():
        while q:
            q.popleft().synchronize()

    step.drain = drain
    return step


def graph_fit(n: int, tokens: int) -> int:
    """The smallest valid `max_graph_tokens` (1,024, then steps of 256) that holds n images of `tokens`."""
    return max(16384, 1024 + -(-max(0, n * tokens - 1024) // 256) * 256)


class Cell:
    """One in-process cell: a step function over fixed inputs, timed in rounds alternating with the other cells'."""

    def __init__(self, row: dict, fn, images: int, counters=None):
        self.row, self.fn, self.images, self.counters = row, fn, images, counters
        self.samples: list[float] = []
        self.rounds: list[float] = []  # images/s per round
        self.graphs = [0, 0]  # the engine's graph replays and oversize steps during this cell's timed steps

    def run(self, iters: int) -> None:
        before = self.counters() if self.counters else None
        t_all = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            self.fn()
            self.samples.append((time.perf_counter() - t0) * 1e3)
        getattr(self.fn, "drain", lambda: None)()
        self.rounds.append(round(self.images * iters / (time.perf_counter() - t_all), 1))
        if before is not None:
            self.graphs = [g + now - was for g, now, was in zip(self.graphs, self.counters(), before)]

    def result(self) -> dict:
        out = {**self.row, **({} if "in flight" in self.row["mode"] else percentiles(self.samples)),
               "iters": len(self.samples), "images_per_s": round(float(np.median(self.rounds)), 1),
               "images_per_s_rounds": self.rounds}
        if self.counters:
            out.update(graph_replays=self.graphs[0], oversize_steps=self.graphs[1])
        return out


def gate(rec, common, engine, hf, directory: Path, device: str, n: int) -> bool:
    """ROSE's image vectors against transformers' (L2-normalised get_image_features) on the same pixels."""
    import torch

    side, _ = _vision(directory)
    px = random_pixels(n, side, seed=1)
    got = engine.step_images(torch.from_numpy(px)).synchronize().clone()
    with torch.inference_mode():
        want = hf_features(hf)(hf_pixels(px, directory, device, engine.dtype)).cpu()
    cos = torch.nn.functional.cosine_similarity(got, want).min().item()
    floor = 0.9999 if engine.dtype == torch.float32 else 0.99
    rec.emit(**common, cell="gate", path="rose vs transformers", images=n, dtype=str(engine.dtype)[6:],
             cos_min=round(cos, 6), floor=floor, passed=cos >= floor)
    return cos >= floor


def in_process(rec, common, directory: Path, hf, args, device: str, cells: set) -> tuple[bool, bool]:
    """The gate, then at each batch size ROSE's cells and transformers' eager / compiled ones, in `args.rounds`
    rounds taking turns (a drifting host or GPU clock falls on all alike); (gate passed, a cell failed: its row
    says why)."""
    import torch

    from rose.engine import Engine, EngineConfig

    side, tokens = _vision(directory)
    engine = Engine(EngineConfig(model=str(directory), device=device,
                                 max_graph_tokens=graph_fit(max(args.batch), tokens)))
    dtype, name = engine.dtype, str(engine.dtype)[6:]
    hf = hf.to(device, dtype)
    if not gate(rec, common, engine, hf, directory, device, min(8, max(args.batch))):
        return False, False
    stats = engine.runner.stats if engine.runner is not None else None
    counters = (lambda: (stats.replays, stats.oversize)) if stats else None
    rose = dict(**common, cell="engine", path="rose in-process", dtype=name, graphs=engine.images.graphs is not None,
                max_graph_tokens=engine.cfg.max_graph_tokens, input="uint8 host pixels, normalised on the device")
    features = hf_features(hf)
    mode = "reduce-overhead" if device == "cuda" else None
    compiled = torch.compile(features, mode=mode, backend=args.hf_compile_backend, dynamic=False) \
        if "hf-compile" in cells else None
    theirs = dict(**common, model_class=type(hf).__name__, dtype=name, attention=hf.config._attn_implementation,
                  mode="one call at a time", input="pixel_values on the device (prep not timed)")
    failed = False
    for n in args.batch:
        x = torch.from_numpy(random_pixels(n, side, seed=n))
        pv = hf_pixels(x.numpy(), directory, device, dtype)
        run: list[Cell] = []
        if "engine" in cells:
            run.append(Cell({**rose, "batch": n, "mode": "one step at a time"},
                            lambda: engine.step_images(x).synchronize(), n, counters))
            if n > 1:
                run.append(Cell({**rose, "batch": n, "mode": "two steps in flight"},
                                in_flight(lambda: engine.step_images(x)), n, counters))
        if "hf" in cells:
            run.append(Cell({**theirs, "cell": "hf-eager", "path": "transformers eager", "batch": n},
                            lambda: features(pv).cpu(), n))
        if compiled is not None:
            run.append(Cell({**theirs, "cell": "hf-compile", "batch": n,
                             "path": f"transformers torch.compile ({mode or 'default'} mode, {args.hf_compile_backend})"},
                            lambda: compiled(pv).cpu(), n))
        iters = args.iters if n == 1 else args.big_iters
        with torch.inference_mode():
            for c in list(run):  # first calls (a compiled function compiles here), then warm-up: graphs captured
                t0 = time.perf_counter()
                try:
                    c.fn()
                    c.row["first_call_s"] = round(time.perf_counter() - t0, 2)
                    for _ in range(3):
                        c.fn()
                    getattr(c.fn, "drain", lambda: None)()
                except Exception as e:  # noqa: BLE001  (one failing cell of a one-shot GPU call: the others still run)
                    rec.emit(**c.row, error=f"{type(e).__name__}: {e}"[:2000])
                    run.remove(c)
                    failed = True
            for _ in range(args.rounds):
                for c in run:
                    c.run(max(1, iters // args.rounds))
        for c in run:
            rec.emit(**c.result(), rounds=args.rounds)
    del engine, compiled
    if device == "cuda":
        torch.cuda.empty_cache()
    return True, failed


def _vision(directory: Path) -> tuple[int, int]:
    v = json.loads((directory / "config.json").read_text())
    vc, clip = v["vision_config"], v["model_type"] == "clip"
    return vc["image_size"], (vc["image_size"] // vc["patch_size"]) ** 2 + clip


# --- charts -------------------------------------------------------------------------------------------------------

def chart(rows: list[dict], path: Path) -> None:
    """Images/s per path at the largest batch, and single-image p50 per path (issue 51's targets dashed)."""
    plt = pyplot()
    rows = [r for r in rows if r.get("bench") == "images" and r.get("cell") != "gate"]
    if plt is None or not rows:
        return
    big = max(r["batch"] for r in rows)
    tput = [(f"{r['path']}\n" + (f"{r['requests_in_flight']} request(s) in flight" if "requests_in_flight" in r
                                  else r.get("mode", "")), r["images_per_s"])
            for r in rows if r["batch"] == big and r.get("images_per_s")]
    lat = [(r["path"], r["p50_ms"], r["p99_ms"]) for r in rows if r["batch"] == 1 and "p50_ms" in r
           and r.get("mode", "one").startswith("one")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    bars = a.barh([t[0] for t in tput], [t[1] for t in tput], color="tab:blue")
    a.bar_label(bars, fmt="%.0f" if max(t[1] for t in tput) >= 100 else "%.1f", fontsize=7)
    a.set_xlabel(f"images/s, {big} images a step or request")
    a.invert_yaxis()
    a.tick_params(axis="y", labelsize=7)
    y = np.arange(len(lat))
    b.barh(y - 0.2, [t[1] for t in lat], 0.4, label="p50")
    b.barh(y + 0.2, [t[2] for t in lat], 0.4, label="p99", color="tab:orange")
    b.set_yticks(y, [t[0] for t in lat], fontsize=7)
    for (name, x), ls in zip(TARGETS.items(), ("--", ":")):
        b.axvline(x, color="red", ls=ls, lw=0.8, label=f"target: {name} <= {x:g} ms")
    b.set_xscale("log")
    b.set_xlabel("one image: ms (log)")
    b.invert_yaxis()
    b.legend(fontsize=7)
    env = rows[0]
    fig.suptitle(f"{env['model']} {'(' + env['note'] + ')' if env.get('note') else ''}: {env['gpu']}, {env['cpus']} cores, torch {env['torch']}, "
                 f"{env['when'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the run ------------------------------------------------------------------------------------------------------

def run_model(args, model: str, work: Path, device: str) -> int:
    import torch

    tag = model_tag(model) + ("-tiny" if args.smoke else "")
    rec = Recorder(args.out, f"images_{tag}")
    directory, hf = prepare(model, work, args.smoke)
    side, tokens = _vision(directory)
    note = "RANDOM WEIGHTS" + (", tiny towers (--smoke)" if args.smoke else "") if model.startswith("preset:") else ""
    from importlib.metadata import version

    common = dict(bench="images", model=model, note=note, image_size=side, image_tokens=tokens, device=device,
                  transformers=version("transformers"), pillow=version("pillow"))
    cells = set(args.cells)
    served = tag
    servers = None
    need_servers = bool(cells & {"grpc", "ivy"})
    logs = args.out or work
    tulip_args = args.tulip_args.split()
    if need_servers and args.smoke:  # start-up overlapped with the in-process cells: a harness check, not timings
        servers = Servers(directory, served, device, tulip_args, "ivy" in cells, logs)
    failed = False

    def attempt(cell: str, fn, *a) -> None:
        """One served cell; its failure is a row (`error`) and exit status 1, and the next cell still runs."""
        nonlocal failed
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001  (a one-shot GPU call keeps what it can measure)
            rec.emit(**common, cell=cell, error=f"{type(e).__name__}: {e}"[:2000])
            failed = True

    try:
        passed, failed = in_process(rec, common, directory, hf, args, device, cells)
        if not passed:
            print(f"benchmarks.images: {model}: ROSE's vectors differ from transformers' (gate): no timings",
                  file=sys.stderr)
            return 1
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
        if need_servers:
            servers = servers or Servers(directory, served, device, tulip_args, "ivy" in cells, logs)
            attempt("servers", servers.ready)
        if "grpc" in cells:
            attempt("grpc", lambda: run_client(grpc_cells(rec, common, servers.target, servers.metrics_port, side,
                                                          args.grpc_batch, args.n, args.big_iters, args.inflight)))
        if cells & {"ivy", "decode"}:
            jpeg, quality = photo_jpeg(args.jpeg_kb)
            meta = dict(jpeg_bytes=len(jpeg), jpeg_size="640x480", jpeg_quality=quality)
            if "ivy" in cells:
                attempt("ivy", ivy_cell, rec, common, servers.ivy_port, served, servers.target, directory, jpeg,
                        args.n, meta)
            if "decode" in cells:
                attempt("decode", decode_cell, rec, common, directory, jpeg, args.n, meta)
    finally:
        if servers is not None:
            servers.signal()  # their shutdowns overlap the chart
    try:
        if args.out is not None:
            chart(rec.rows, args.out / f"images_{tag}.png")
    finally:
        if servers is not None:
            servers.stop()
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help=f"repeatable; default both presets: {PRESETS}")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (ROSE, transformers and Tulip alike)")
    ap.add_argument("--cells", default=",".join(CELLS), help=f"which of {','.join(CELLS)} (decode runs with ivy)")
    ap.add_argument("--batch", default="1,256", help="in-process batch sizes (images a step)")
    ap.add_argument("--grpc-batch", type=int, default=256, help="images a request in the gRPC throughput cell")
    ap.add_argument("--inflight", default="1,2", help="gRPC requests of --grpc-batch images in flight")
    ap.add_argument("--iters", type=int, default=200, help="timed steps of each one-image in-process cell")
    ap.add_argument("--big-iters", type=int, default=20, help="timed steps / requests of each batched cell")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds the in-process cells' steps are split into")
    ap.add_argument("--n", type=int, default=1000, help="timed one-image requests over gRPC, and through Ivy")
    ap.add_argument("--jpeg-kb", type=float, default=100, help="the test JPEG's size to aim at (640 x 480)")
    ap.add_argument("--tulip-args", default="", help="more `python -m tulip` flags")
    ap.add_argument("--hf-compile-backend", default="inductor", help="torch.compile's backend for hf-compile")
    ap.add_argument("--work", type=Path, default=None, help="where model directories go (default: a temporary one)")
    ap.add_argument("--smoke", action="store_true", help="every cell on the CPU with tiny towers, a few iterations "
                    "(the CLIP preset unless --model says): checks the harness, measures nothing")
    ap.add_argument("--chart", type=Path, default=None, metavar="DIR", help="only redraw DIR's charts")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.chart is not None:
        for f in sorted(args.chart.glob("images_*.jsonl*")):
            chart(read_rows(f), args.chart / (f.name.split(".jsonl")[0] + ".png"))
        return 0
    args.cells = [c for c in args.cells.split(",") if c]
    if set(args.cells) - set(CELLS):
        ap.error(f"--cells {args.cells}: not among {CELLS}")
    if "ivy" in args.cells and "decode" not in args.cells:
        args.cells.append("decode")
    if args.smoke:
        args.model = args.model or [PRESETS[0]]
        args.device, args.batch, args.grpc_batch, args.inflight = "cpu", "1,4", 4, "1,2"
        args.iters, args.big_iters, args.n, args.rounds, args.hf_compile_backend = 3, 2, 3, 1, "eager"
        args.tulip_args = "--spin-ms 0 " + args.tulip_args  # no core kept polling: the smoke's processes share two
    args.model = args.model or list(PRESETS)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.inflight = [int(k) for k in args.inflight.split(",")]
    import torch

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    work = args.work or Path(tempfile.mkdtemp(prefix="trellis-images-"))
    try:
        return max(run_model(args, m, work, device) for m in args.model)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
