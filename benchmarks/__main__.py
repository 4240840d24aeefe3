"""One command for the benchmark suites, then the summary.

    python -m benchmarks run [--suite kernels|gemm|engine|hop|online|scoring|bulk|concurrency|all] [--model bge-m3] [--out DIR]
                             [--tulip-args "..."] [--quick]

`online`, `scoring` and `bulk` start one Tulip (benchmarks.online: correctness gate first);
`kernels` sweeps the attention backends and writes the selection table (benchmarks.kernels);
`gemm` times the model's linear layers per GEMM strategy (benchmarks.gemm);
`hop` measures the request path around the engine (benchmarks.hop: a null engine, then the model);
`concurrency` starts Ivy + Tulip(s) and sends text, then bulk token batches (benchmarks.concurrency;
Tulip settings through TULIP_* variables; `--replicas 1,2` repeats it with two Tulips on two GPUs); `engine` runs the in-process engine benchmark (benchmarks.engine); the end
writes DIR/SUMMARY.md and the charts (benchmarks.summary). `--quick` shrinks every cell (few requests, short sequences)
to check the harness end to end, e.g. on a CPU; its numbers are not results.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks import concurrency, engine, gemm, hop, kernels, online, summary

SUITES = ("kernels", "gemm", "engine", "hop", "online", "scoring", "bulk", "concurrency")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run suites and write the summary")
    run.add_argument("--suite", default="all", help=f"comma-separated: {', '.join(SUITES)}, or all")
    run.add_argument("--model", default="bge-m3")
    run.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    run.add_argument("--tulip-args", default="", help="extra flags for the Tulip the gRPC suites start")
    run.add_argument("--transport", default="stream", choices=("stream", "unary"),
                     help="online/scoring: messages on one open EmbedStream (Ivy's default) or unary calls")
    run.add_argument("--engine-args", default="", help="extra flags for benchmarks.engine")
    run.add_argument("--replicas", default="1", help="concurrency: Tulip replicas behind Ivy, e.g. 1,2 (one GPU each)")
    run.add_argument("--quick", action="store_true", help="tiny cells: a harness check, not a measurement")
    args = ap.parse_args(argv)

    suites = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    unknown = set(suites) - set(SUITES)
    if unknown:
        ap.error(f"unknown suite(s) {sorted(unknown)}; choose from {', '.join(SUITES)} or all")
    out = str(args.out)
    rc = 0
    if "kernels" in suites:
        quick = ["--heads", "4,4,16", "--seqs", "1,4", "--lengths", "16,64", "--iters", "3"] if args.quick else []
        rc |= kernels.main(["--out", out, *quick])
    if "gemm" in suites:
        rc |= gemm.main(["--model", args.model, "--out", out, *(["--tokens", "16"] if args.quick else [])])
    if "engine" in suites:
        quick = ["--iters", "5", "--repeats", "1", "--lengths", "16,64"] if args.quick else []
        rc |= engine.main(["--model", args.model, "--out", out, *quick, *shlex.split(args.engine_args)])
    if "hop" in suites:
        n = ["--n", "20"] if args.quick else []
        rc |= hop.main(["--out", out, "--device-ms", "1", *n])
        rc |= hop.main(["--out", out, "--model", args.model, *([] if args.quick else ["--compile"]), *n])
    grpc_suites = [s for s in suites if s in ("online", "scoring", "bulk")]
    if grpc_suites:
        quick = (["--n", "5", "--n-scoring", "2", "--lengths", "16,64", "--scoring-length", "32",
                  "--bulk-lengths", "32,64", "--bulk-requests", "1,1"] if args.quick else [])
        rc |= online.main(["--model", args.model, "--out", out, "--suites", ",".join(grpc_suites),
                           "--tulip-args", args.tulip_args, "--transport", args.transport, *quick])
    if "concurrency" in suites:
        quick = ["--n", "8", "--levels", "1,4", "--length", "64", "--bulk-requests", "1"] if args.quick else []
        for r in args.replicas.split(","):
            rc |= concurrency.main(["--model", args.model, "--out", out, "--replicas", r, *quick])
    summary.main([out])
    return rc


if __name__ == "__main__":
    sys.exit(main())
