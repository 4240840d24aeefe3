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
  `torch.compile(mode="reduce-overhead")` on CUDA (default mode on a CPU), compile time in the row;
- `grpc`: a Tulip process (`python -m tulip`, its defaults plus `--tulip-args`), `trellis.client` here:
  `--grpc-batch` images a request (pre-processed uint8 pixels), images/s with 1 and 2 requests in flight, and
  one 224 x 224 image a request, p50 / p99 (`--n`), with Tulip's graph replays / oversize steps (its metrics);
- `ivy`: an Ivy process before that Tulip: one ~100 KB JPEG (640 x 480, drawn here deterministically: smooth
  gradients and noise, the quality chosen to come closest to `--jpeg-kb`) as a data URI in a Jina item on
  `/v1/embeddings`, sequential (http.client, one kept-alive connection), p50 / p99, decode and preprocessing
  included; its vector checked against Tulip's for the pixels `ivy.images` makes of the same file;
- `decode`: `ivy.images`' base64 + decode + preprocessing of that JPEG in this process, one thread (one core).
Charts: `images_<model>.png`: images/s per path, single-image p50 per path.
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
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


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

def timed(fn, n_images: int, iters: int, warmup: int) -> dict:
    """`fn()` (one step, synchronised) `warmup` times, then `iters` timed: p50 / p99 ms and images/s."""
    for _ in range(warmup):
        fn()
    ts = []
    t_all = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    total = time.perf_counter() - t_all
    return {**percentiles(ts), "images_per_s": round(n_images * iters / total, 1)}


def in_flight(launch, n_images: int, iters: int, depth: int = 2) -> dict:
    """`launch()` returns a LazyTensor; `depth` steps in flight (the next staged and launched while one runs)."""
    q: deque = deque()
    t0 = time.perf_counter()
    for _ in range(iters):
        q.append(launch())
        if len(q) >= depth:
            q.popleft().synchronize()
    while q:
        q.popleft().synchronize()
    return {"images_per_s": round(n_images * iters / (time.perf_counter() - t0), 1), "iters": iters, "in_flight": depth}


def graph_fit(n: int, tokens: int) -> int:
    """The smallest valid `max_graph_tokens` (1,024, then steps of 256) that holds n images of `tokens`."""
    return max(16384, 1024 + -(-max(0, n * tokens - 1024) // 256) * 256)


def engine_cells(rec, common, directory: Path, hf, batches, iters, big_iters, device: str, gate_only=False) -> bool:
    """The gate, then ROSE's cells; False when the gate failed."""
    import torch

    from rose.engine import Engine, EngineConfig

    cuda = device == "cuda"
    side, tokens = _vision(directory)
    engine = Engine(EngineConfig(model=str(directory), device=device, max_graph_tokens=graph_fit(max(batches), tokens)))
    dtype = engine.dtype
    px = random_pixels(min(8, max(batches)), side, seed=1)
    got = engine.step_images(torch.from_numpy(px)).synchronize().clone()
    ref_model = hf.to(device, dtype)
    with torch.inference_mode():
        want = hf_features(ref_model)(hf_pixels(px, directory, device, dtype)).cpu()
    cos = torch.nn.functional.cosine_similarity(got, want).min().item()
    floor = 0.9999 if dtype == torch.float32 else 0.99
    rec.emit(**common, cell="gate", path="rose vs transformers", images=len(px), dtype=str(dtype)[6:],
             cos_min=round(cos, 6), floor=floor, passed=cos >= floor)
    if cos < floor or gate_only:
        return cos >= floor
    base = dict(**common, cell="engine", path="rose in-process", dtype=str(dtype)[6:],
                graphs=engine.images.graphs is not None, max_graph_tokens=engine.cfg.max_graph_tokens,
                input="uint8 host pixels, normalised on the device")
    stats = engine.runner.stats if engine.runner is not None else None
    for n in batches:
        x = torch.from_numpy(random_pixels(n, side, seed=n))
        k = iters if n == 1 else big_iters
        before = (stats.replays, stats.oversize) if stats else (0, 0)
        row = timed(lambda: engine.step_images(x).synchronize(), n, k, warmup=4)
        graphs = {"graph_replays": stats.replays - before[0], "oversize_steps": stats.oversize - before[1]} if stats else {}
        rec.emit(**base, batch=n, mode="one step at a time", **row, **graphs)
        if n > 1:
            rec.emit(**base, batch=n, mode="two steps in flight", **in_flight(lambda: engine.step_images(x), n, k))
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return True


def hf_cells(rec, common, directory: Path, hf, batches, iters, big_iters, device: str, compiled: bool,
             backend: str) -> None:
    import torch

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    side, _ = _vision(directory)
    model = hf.to(device, dtype)
    fn = hf_features(model)
    mode = "reduce-overhead" if cuda else None
    if compiled:
        fn = torch.compile(fn, mode=mode, backend=backend, dynamic=False)
    path = f"transformers torch.compile ({mode or 'default'} mode, {backend})" if compiled else "transformers eager"
    for n in batches:
        pv = hf_pixels(random_pixels(n, side, seed=n), directory, device, dtype)
        k = iters if n == 1 else big_iters
        with torch.inference_mode():
            t0 = time.perf_counter()
            fn(pv).cpu()  # a compiled function compiles here
            first_s = time.perf_counter() - t0
            row = timed(lambda: fn(pv).cpu(), n, k, warmup=3)
        rec.emit(**common, cell="hf-compile" if compiled else "hf-eager", path=path, model_class=type(hf).__name__,
                 dtype=str(dtype)[6:], attention=model.config._attn_implementation, batch=n, mode="one call at a time",
                 input="pixel_values on the device (prep not timed)", first_call_s=round(first_s, 2), **row)
    if cuda:
        torch.cuda.empty_cache()


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
    a.bar_label(bars, fmt="%.0f", fontsize=7)
    a.set_xlabel(f"images/s, {big} images a step or request")
    a.invert_yaxis()
    a.tick_params(axis="y", labelsize=7)
    y = np.arange(len(lat))
    b.barh(y - 0.2, [t[1] for t in lat], 0.4, label="p50")
    b.barh(y + 0.2, [t[2] for t in lat], 0.4, label="p99", color="tab:orange")
    b.set_yticks(y, [t[0] for t in lat], fontsize=7)
    for x, name in ((TARGETS["grpc 1 image p50"], "target: gRPC p50"), (TARGETS["ivy 1 JPEG p50"], "target: Ivy p50")):
        b.axvline(x, color="red", ls="--", lw=0.8)
        b.text(x, -0.6, name, color="red", fontsize=7)
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
    common = dict(bench="images", model=model, note=note, image_size=side, image_tokens=tokens, device=device)
    cells = set(args.cells)
    served = tag
    servers = None
    need_servers = bool(cells & {"grpc", "ivy"})
    logs = args.out or work
    tulip_args = args.tulip_args.split()
    if need_servers and args.smoke:  # start-up overlapped with the in-process cells: a harness check, not timings
        servers = Servers(directory, served, device, tulip_args, "ivy" in cells, logs)
    try:
        if not engine_cells(rec, common, directory, hf, args.batch, args.iters, args.big_iters, device,
                            gate_only="engine" not in cells):
            print(f"benchmarks.images: {model}: ROSE's vectors differ from transformers' (gate): no timings",
                  file=sys.stderr)
            return 1
        for compiled in [False] * ("hf" in cells) + [True] * ("hf-compile" in cells):
            hf_cells(rec, common, directory, hf, args.batch, args.iters, args.big_iters, device, compiled,
                     args.hf_compile_backend)
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
        if need_servers:
            servers = servers or Servers(directory, served, device, tulip_args, "ivy" in cells, logs)
            servers.ready()
        if "grpc" in cells:
            run_client(grpc_cells(rec, common, servers.target, servers.metrics_port, side, args.grpc_batch, args.n,
                                  args.big_iters, args.inflight))
        if cells & {"ivy", "decode"}:
            jpeg, quality = photo_jpeg(args.jpeg_kb)
            meta = dict(jpeg_bytes=len(jpeg), jpeg_size="640x480", jpeg_quality=quality)
            if "ivy" in cells:
                ivy_cell(rec, common, servers.ivy_port, served, servers.target, directory, jpeg, args.n, meta)
            if "decode" in cells:
                decode_cell(rec, common, directory, jpeg, args.n, meta)
    finally:
        if servers is not None:
            servers.stop()
    if args.out is not None:
        chart(rec.rows, args.out / f"images_{tag}.png")
    return 0


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
        args.iters, args.big_iters, args.n, args.hf_compile_backend = 3, 2, 3, "eager"
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
