"""Random resize geometries for Ivy's resampler (ivy/resample.c), checked byte for byte against Pillow's own resize
and crop; optionally under the sanitizers.

    python -m benchmarks.fuzz_resample [--cases 200000] [--seed 0] [--sanitize]

Each case (`cases`): an RGB or L image of random size (1 to 4 pixels, up to 80, up to 700, and extreme aspect
ratios up to 3000 x 1), random content (noise, a smooth gradient with noise, or 0 / 255 stripes: the filters'
overshoot clipped), a random target size (independent, CLIP's shortest edge 224, or the same size), each of PIL's
filters (nearest, lanczos, bilinear, bicubic, box, hamming), and a crop of the resized image (whole, centred, or
anywhere); Pillow's pass order as ivy.images reads it. The C's pixels must equal
np.asarray(img.resize(size, filter))[crop]. `--sanitize` builds ivy/resample.c with
`-fsanitize=address,undefined -fno-sanitize-recover=all` and runs the cases again under it (the compiler's libasan
preloaded: an out-of-bounds read of a window aborts the run). Exit status 0: no difference and no sanitizer report.
tests/test_images_resample.py draws its cases from `cases` too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all")
MARK = "IVY_FUZZ_RESAMPLE_CHILD"  # set in the re-run under the preloaded sanitizer runtime


def cases(n: int, seed: int, most: int = 700):
    """n cases (image, (width, height), filter, (top, left, ch, cw)), seeded; sides up to `most` (extreme aspect
    ratios: up to 3000 x 3 at most 700, 2000 x 3 at most 200)."""
    from PIL import Image

    rng = np.random.default_rng(seed)

    def _side(rng: np.random.Generator) -> int:
        r = rng.random()
        return int(rng.integers(1, 5) if r < 0.15 else rng.integers(5, 81) if r < 0.7 else rng.integers(81, most + 1))

    for _ in range(n):
        if rng.random() < 0.05:  # extreme aspect ratio
            w, h = int(rng.integers(most, most * 10 + 1 if most < 300 else 3001)), int(rng.integers(1, 4))
            w, h = (w, h) if rng.random() < 0.5 else (h, w)
        else:
            w, h = _side(rng), _side(rng)
        mode = "RGB" if rng.random() < 0.7 else "L"
        shape = (h, w, 3) if mode == "RGB" else (h, w)
        kind = rng.random()
        if kind < 0.5:
            a = rng.integers(0, 256, shape, np.uint8)
        elif kind < 0.75:
            y, x = np.mgrid[0:h, 0:w]
            g = 128 + 100 * np.sin(x / max(w, 1) * rng.uniform(1, 9) + y / max(h, 1) * rng.uniform(1, 9))
            g = g[..., None] if mode == "RGB" else g
            a = np.clip(g + rng.normal(0, 12, shape), 0, 255).astype(np.uint8)
        else:
            a = (((np.arange(w)[None, :] // int(rng.integers(1, 4))) % 2) * 255).astype(np.uint8)
            a = np.broadcast_to(a[..., None] if mode == "RGB" else a, shape).copy()
        img = Image.fromarray(a, mode)
        r = rng.random()
        if r < 0.2 and max(w, h) <= 8 * min(w, h):  # CLIP's shortest edge (not to 224 x 300,000)
            size = (224, max(1, int(224 * h / w))) if w <= h else (max(1, int(224 * w / h)), 224)
        elif 0.2 <= r < 0.25:
            size = (w, h)
        elif 0.25 <= r < 0.35:  # one side kept: a single pass
            size = (w, _side(rng)) if rng.random() < 0.5 else (_side(rng), h)
        else:
            size = (_side(rng), _side(rng))
        nw, nh = size
        r = rng.random()
        if r < 0.3:
            box = (0, 0, nh, nw)
        elif r < 0.7:
            ch, cw = int(rng.integers(1, nh + 1)), int(rng.integers(1, nw + 1))
            box = ((nh - ch) // 2, (nw - cw) // 2, ch, cw)
        else:
            ch, cw = int(rng.integers(1, nh + 1)), int(rng.integers(1, nw + 1))
            box = (int(rng.integers(0, nh - ch + 1)), int(rng.integers(0, nw - cw + 1)), ch, cw)
        yield img, size, int(rng.integers(0, 6)), box


def pillow(img, size, resample: int, box) -> np.ndarray:
    """Pillow's resize, then the crop (top, left, ch, cw)."""
    from PIL import Image

    top, left, ch, cw = box
    return np.asarray(img.resize(size, Image.Resampling(resample)))[top: top + ch, left: left + cw]


def run(n: int, seed: int, lib=None, most: int = 700) -> tuple[int, dict]:
    """(cases that differ from Pillow, counts of what was covered), each difference printed."""
    from ivy.images import _vertical_first
    from ivy.resample import resize_crop

    differ = 0
    seen = {"rows first": 0, "columns first": 0, "one pass": 0, "no pass": 0, "RGB": 0, "L": 0}
    for img, size, f, box in cases(n, seed, most):
        w, h = img.size
        vfirst = _vertical_first(w, h, *size)
        got = resize_crop(img, size, f, box, vfirst, lib)
        want = pillow(img, size, f, box)
        if got.shape != want.shape or not np.array_equal(got, want):
            differ += 1
            if differ <= 10:
                print(f"  differs: {img.mode} {img.size} -> {size} filter {f} crop {box} vfirst {vfirst}", flush=True)
        passes = (size[0] != w) + (size[1] != h)
        seen[img.mode] += 1
        seen["no pass" if not passes else "one pass" if passes == 1 else "columns first" if vfirst
             else "rows first"] += 1
    return differ, seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sanitize", action="store_true", help="build with ASan + UBSan and run the cases under it")
    ap.add_argument("--so", help=argparse.SUPPRESS)  # the sanitized build, in the re-run
    args = ap.parse_args(argv)
    lib = None
    if os.environ.get(MARK):
        from ivy.resample import load

        lib = load(Path(args.so))
    elif args.sanitize:
        from benchmarks.fuzz_native import sanitized
        from ivy.resample import SOURCE

        rc = sanitized(SOURCE, SANITIZE, MARK, "benchmarks.fuzz_resample",
                       ["--cases", str(args.cases), "--seed", str(args.seed)])
        if rc is None:
            return 2
        print("clean: no sanitizer report, no difference" if rc == 0 else f"FAILED: exit status {rc}", flush=True)
        return rc
    t0 = time.monotonic()
    differ, seen = run(args.cases, args.seed, lib)
    print(f"{args.cases} cases{' under ASan + UBSan' if lib is not None else ''} in {time.monotonic() - t0:.1f} s: "
          f"{differ} differ from Pillow; {seen}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
