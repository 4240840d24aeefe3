"""Where a step's device time goes: the kernels of one eager step under torch.profiler.

    python -m benchmarks.profile_step --model preset:bge-m3 --tokens 128 [--attention varlen] [--order]
    python -m benchmarks.profile_step --model preset:clip-vit-base-patch16 --images 256   (an image step)

Prints the top kernels by total CUDA time and the kernel count; `--order` also lists every kernel
in launch order with its time (where the step's kernels outside the layers are). Eager, not graph replay,
because the profiler sees a replayed graph as one launch; the kernels are the same.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from rose.batch import Batch
from rose.engine import Engine, EngineConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="as Tulip --compile")
    ap.add_argument("--kernel-tokens", type=int, default=EngineConfig.kernel_tokens,
                    help="steps of up to this many tokens take ROSE's Triton path (0: torch's)")
    ap.add_argument("--order", action="store_true", help="also list every kernel in launch order")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a check of the script, no kernel times)")
    ap.add_argument("--images", type=int, default=0, help="profile a step of this many images (a model with an "
                    "image tower: CLIP, SigLIP) instead of --seqs x --tokens text")
    args = ap.parse_args(argv)
    e = Engine(EngineConfig(model=args.model, device=args.device, dtype="bfloat16", attention=args.attention, graphs="off",
                            compile=args.compile, kernel_tokens=args.kernel_tokens))
    g = np.random.default_rng(0)
    if args.images:
        side = e.image_size
        pixels = torch.from_numpy(g.integers(0, 256, (args.images, side, side, 3), dtype=np.uint8))
        shape = f"{args.images} images of {side}x{side} ({e.image_tokens} tokens each, attention {e.images.attention.name})"

        def step():
            return e.step_images(pixels)
    else:
        batch = Batch.from_sequences([g.integers(5, 1000, args.tokens) for _ in range(args.seqs)])
        shape = f"{args.seqs}x{args.tokens}"

        def step():
            return e.step(batch)
    for _ in range(3):  # (compiles on the first)
        step().synchronize()
    with profile(activities=[ProfilerActivity.CUDA if e.device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        step().synchronize()
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(ev.device_time for ev in events) / 1e3
    print(f"{args.model} {shape} attention={e.attention.name} triton={e.kernels}: {len(events)} kernels, "
          f"{total:.3f} ms of kernel time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.order:
        print("launch order (us, name):")
        for i, ev in enumerate(sorted(events, key=lambda ev: ev.time_range.start)):
            print(f"{i:4d} {ev.device_time:8.2f}  {ev.name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
