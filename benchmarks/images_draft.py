"""JPEG draft decoding (DCT-domain downscaling, Pillow's `Image.draft`) against the full decode, for CLIP's 224
preprocessing (issue 51): how far the uint8 pixels move, over varied JPEGs, and what it would save.

    python -m benchmarks.images_draft [--out DIR]

Issue 51's Done means asks Ivy's pixels to stay within 1/255 of transformers' image processor (which decodes the
whole image). `ivy.images` is byte-exact to it today; draft decoding would hand the resize a 1/2, 1/4 or 1/8 scale
decode instead. For each JPEG (10 sizes from 480 x 640 to 4032 x 3024, five contents: a photo-like picture,
uniform noise, high-contrast blocks and lines, a fine checkerboard, smooth gradients; four encodings: quality 95
4:4:4, 85 4:2:0, 75 4:2:2 progressive, 90 greyscale) it decodes with draft asking for `margin` times the resize's
size (1: the smallest scale Pillow allows; 2, 4: a larger decode left for the bicubic resize to filter), runs
`ivy.images`' preprocessing (shortest edge 224, bicubic, centre crop 224) on both, and reports the largest
absolute difference in uint8 levels (1 = 1/255) per margin, content and size. Rows: one JSON object per margin
(`bench: "images-draft"`), then one for the benchmark's own JPEG (640 x 480, ~100 KB) with the time each decode
+ preprocessing takes on one thread (p50 ms).
"""

from __future__ import annotations

import argparse
import io
import itertools
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder

SIZES = ((640, 480), (480, 640), (1024, 768), (1280, 720), (1920, 1080), (2048, 1536), (3000, 2000), (4032, 3024),
         (900, 900), (500, 2000))
CONTENTS = ("photo", "noise", "edges", "checker", "smooth")
ENCODINGS = ((95, 0, False, False), (85, 2, False, False), (75, 1, True, False), (90, 2, False, True))  # quality,
# Pillow's subsampling (0: 4:4:4, 1: 4:2:2, 2: 4:2:0), progressive, greyscale


def picture(kind: str, w: int, h: int, seed: int):
    from PIL import Image

    r = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "photo":  # as benchmarks.images_served.photo_jpeg draws, at any size
        img = np.zeros((h, w, 3), np.float32)
        for c in range(3):
            fx, fy, ph = r.uniform(0.5, 3), r.uniform(0.5, 3), r.uniform(0, 6.28)
            img[..., c] = 128 + 70 * np.sin(2 * np.pi * (fx * x / w + fy * y / h) + ph)
        for _ in range(12):
            cx, cy, rad = r.uniform(0, w), r.uniform(0, h), r.uniform(0.03, 0.2) * max(w, h)
            img += np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * rad * rad))[..., None] * r.uniform(-80, 80, 3)
        img += r.normal(0, 7, img.shape)
    elif kind == "noise":
        img = r.uniform(0, 255, (h, w, 3))
    elif kind == "edges":  # blocks and thin lines of colour on white: text- and chart-like
        img = np.full((h, w, 3), 255.0)
        for _ in range(300):
            x0, y0 = r.integers(0, w), r.integers(0, h)
            img[y0:y0 + r.integers(1, max(2, h // 20)), x0:x0 + r.integers(1, max(2, w // 10))] = r.uniform(0, 255, 3)
    elif kind == "checker":
        s = int(r.integers(1, 6))
        img = (((x // s + y // s) % 2) * 255)[..., None].repeat(3, 2)
    else:
        img = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], -1)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def jpeg(pic, quality: int, subsampling: int, progressive: bool, grey: bool) -> bytes:
    buf = io.BytesIO()
    (pic.convert("L") if grey else pic).save(buf, "JPEG", quality=quality, subsampling=subsampling,
                                             progressive=progressive)
    return buf.getvalue()


def pixels(data: bytes, prep, margin: float | None):
    """ivy.images' preprocessing of `data` decoded whole (margin None) or with draft at margin x the resize's size;
    (uint8 pixels, the decoded size)."""
    from PIL import Image

    from ivy.images import to_rgb

    img = Image.open(io.BytesIO(data))
    if margin is not None:
        w, h = img.size
        s = prep.resize / min(w, h)
        img.draft("L" if img.mode == "L" else "RGB", (max(1, round(w * s * margin)), max(1, round(h * s * margin))))
    img.load()
    return prep(to_rgb(img)), img.size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--margins", default="1,2,4")
    ap.add_argument("--n", type=int, default=300, help="timed decodes of the benchmark's JPEG, each way")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from benchmarks.images_served import photo_jpeg
    from ivy.images import Preprocessor

    prep = Preprocessor(224, 3, (224, 224), 224, 197)  # CLIP ViT-B/16's preprocessor_config.json
    margins = [float(m) for m in args.margins.split(",")]
    rec = Recorder(args.out, "images_draft")
    diffs: dict[float, list[tuple[str, tuple, int]]] = defaultdict(list)
    for n, (size, kind) in enumerate(itertools.product(SIZES, CONTENTS)):
        pic = picture(kind, *size, n)
        for enc in ENCODINGS:
            data = jpeg(pic, *enc)
            want = pixels(data, prep, None)[0].astype(int)
            for m in margins:
                got, decoded = pixels(data, prep, m)
                if decoded != size:  # draft took a smaller scale
                    diffs[m].append((kind, size, int(np.abs(got.astype(int) - want).max())))
    for m in margins:
        d = diffs[m]
        worst = [x for _, _, x in d]
        by_kind, by_size = defaultdict(int), defaultdict(int)
        for kind, size, x in d:
            by_kind[kind] = max(by_kind[kind], x)
            by_size[f"{size[0]}x{size[1]}"] = max(by_size[f"{size[0]}x{size[1]}"], x)
        rec.emit(bench="images-draft", margin=m, jpegs=len(SIZES) * len(CONTENTS) * len(ENCODINGS), drafted=len(d),
                 max_abs_diff=max(worst, default=0), median_max_abs_diff=float(np.median(worst)) if worst else 0,
                 share_within_1=round(float(np.mean([x <= 1 for x in worst])), 3) if worst else 1.0,
                 worst_by_content=dict(by_kind), worst_by_size=dict(by_size))
    data, quality = photo_jpeg(100)
    t: dict[str, list[float]] = {"full": [], "draft": []}
    for _ in range(args.n):  # the two ways in turns
        for way, m in (("full", None), ("draft", 1.0)):
            t0 = time.perf_counter()
            pixels(data, prep, m)
            t[way].append((time.perf_counter() - t0) * 1e3)
    full, drafted = pixels(data, prep, None)[0], pixels(data, prep, 1.0)
    rec.emit(bench="images-draft", jpeg="benchmark's 640x480", jpeg_bytes=len(data), jpeg_quality=quality,
             draft_size=f"{drafted[1][0]}x{drafted[1][1]}",
             max_abs_diff=int(np.abs(full.astype(int) - drafted[0].astype(int)).max()),
             full_p50_ms=round(float(np.median(t["full"])), 3), draft_p50_ms=round(float(np.median(t["draft"])), 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
