"""Where a step's device time goes: the kernels of one eager step under torch.profiler.

    python -m benchmarks.profile_step --model preset:bge-m3 --tokens 128 [--attention varlen] [--order]

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
    args = ap.parse_args(argv)
    e = Engine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16", attention=args.attention, graphs="off",
                            compile=args.compile, kernel_tokens=args.kernel_tokens))
    g = np.random.default_rng(0)
    batch = Batch.from_sequences([g.integers(5, 1000, args.tokens) for _ in range(args.seqs)])
    for _ in range(3):  # (compiles on the first)
        e.step(batch).synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e.step(batch).synchronize()
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(ev.device_time for ev in events) / 1e3
    print(f"{args.model} {args.seqs}x{args.tokens} attention={e.attention.name} triton={e.kernels}: {len(events)} kernels, "
          f"{total:.3f} ms of kernel time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.order:
        print("launch order (us, name):")
        for i, ev in enumerate(sorted(events, key=lambda ev: ev.time_range.start)):
            print(f"{i:4d} {ev.device_time:8.2f}  {ev.name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
