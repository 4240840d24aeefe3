"""One command for the benchmark suites, then the summary.

    python -m benchmarks run [--suite kernels|gemm|engine|hop|online|scoring|bulk|concurrency|all] [--model preset:bge-m3] [--out DIR]
                             [--tulip-args "..."] [--quick]

`--model` takes several models, comma-separated, each optionally with its own suites after `=`
(joined by `+`): `--model preset:bge-m3,preset:pplx-embed-1-0.6b=engine+online+bulk` runs `--suite` for bge-m3 and
those three for pplx. The kernel sweep runs once (it covers both head shapes), and so does the hop,
each with the first model that lists it. Give the Tulip and the engine `--attention-table OUT` (the directory: --out's) so each
model takes the table of its own head shape.

`online`, `scoring` and `bulk` start one Tulip (benchmarks.online: correctness gate first);
`kernels` sweeps the attention backends and writes the selection table (benchmarks.kernels);
`gemm` times the model's linear layers per GEMM strategy (benchmarks.gemm);
`hop` measures the request path around the engine (benchmarks.hop: a null engine, then the model);
`concurrency` starts Ivy + Tulip(s) and sends text, then bulk token batches (benchmarks.concurrency;
Tulip settings through TULIP_* variables; `--replicas 1,2` repeats it with two Tulips on two GPUs); `engine` runs the in-process engine benchmark (benchmarks.engine); the end
writes DIR/SUMMARY.md and the charts (benchmarks.summary). `--quick` shrinks every cell (few requests, short sequences)
to check the harness end to end, e.g. on a CPU; its numbers are not results.

Machines lent for a few minutes at a time: `--resume` skips the parts this same command (same revision and
arguments) already finished in DIR (`DIR/run-state.json`), and `--max-minutes M` starts no new part after M
minutes; re-issue the same command until it says it is complete (exit status 3 until then). Each part writes into DIR/.partial/<part>
first and is merged into DIR only when it finishes (replacing its files of an earlier run), so a part cut
short leaves nothing behind; a part that fails leaves its server logs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from benchmarks import concurrency, engine, gemm, hop, kernels, online, summary
from benchmarks.common import git_rev
from trellis.cli import prog

SUITES = ("kernels", "gemm", "engine", "hop", "online", "scoring", "bulk", "concurrency")
INCOMPLETE = 3  # exit status of a run that stopped at --max-minutes with parts left (re-issue it with --resume)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m benchmarks"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run suites and write the summary")
    run.add_argument("--suite", default="all", help=f"comma-separated: {', '.join(SUITES)}, or all")
    run.add_argument("--model", default="preset:bge-m3", help="comma-separated model references (a Hub id, a "
                     "directory, preset:NAME), each optionally =SUITE+SUITE (default: preset:bge-m3, random weights)")
    run.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    run.add_argument("--tulip-args", default="", help="extra flags for the Tulip the gRPC suites start")
    run.add_argument("--transport", default="stream", choices=("stream", "unary"),
                     help="online/scoring: messages on one open EmbedStream (Ivy's default) or unary calls")
    run.add_argument("--engine-args", default="", help="extra flags for benchmarks.engine")
    run.add_argument("--replicas", default="1", help="concurrency: Tulip replicas behind Ivy, e.g. 1,2 (one GPU each)")
    run.add_argument("--ivy-workers", default="1", help="concurrency: Ivy worker processes")
    run.add_argument("--quick", action="store_true", help="tiny cells: a harness check, not a measurement")
    run.add_argument("--resume", action="store_true",
                     help="skip the parts this same command already finished in --out (see run-state.json)")
    run.add_argument("--max-minutes", type=float, default=0.0, help="start no new part after this long (0: no limit)")
    args = ap.parse_args(argv)

    suites = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    models = []  # (model, its suites)
    for spec in args.model.split(","):
        name, eq, own = spec.partition("=")
        models.append((name, tuple(own.split("+")) if eq else suites))
    unknown = {s for _, ss in models for s in ss} - set(SUITES)
    if unknown:
        ap.error(f"unknown suite(s) {sorted(unknown)}; choose from {', '.join(SUITES)} or all")
    args.out.mkdir(parents=True, exist_ok=True)
    once: set[str] = set()  # model-independent parts (the sweep; the hop, done with one model) run once
    todo = [part for i, (model, ss) in enumerate(models) for part in parts(args, model, ss, i == 0, once)]
    state_path = args.out / "run-state.json"
    signature = {"git": git_rev(), "suites": list(suites), "model": args.model, "tulip_args": args.tulip_args,
                 "engine_args": args.engine_args, "transport": args.transport, "replicas": args.replicas,
                 "ivy_workers": args.ivy_workers, "quick": args.quick}
    done: list[str] = []
    if args.resume and signature["git"] == "unknown":
        print("benchmarks: no git revision (set TRELLIS_GIT_REV) to resume against; starting over")
    elif args.resume and state_path.is_file():
        state = json.loads(state_path.read_text())
        if state.get("signature") == signature:
            done = state["done"]
        else:
            print("benchmarks: run-state.json is for another revision or other arguments; starting over")
    start, rc = time.monotonic(), 0
    for name, fn in todo:
        if name in done:
            print(f"benchmarks: {name} already done (--resume)")
            continue
        if args.max_minutes and time.monotonic() - start > args.max_minutes * 60:
            print(f"benchmarks: --max-minutes {args.max_minutes:g} reached; re-run with --resume to go on")
            break
        partial = args.out / ".partial" / name
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        part_rc = fn(str(partial))
        rc |= part_rc
        if part_rc == 0:
            merge(partial, args.out)
            done.append(name)
            state_path.write_text(json.dumps({"signature": signature, "done": done}, indent=1))
        else:
            merge(partial, args.out, "*.log")  # the Tulip / stack logs say why
        shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(args.out / ".partial", ignore_errors=True)
    left = [name for name, _ in todo if name not in done]
    print("benchmarks: complete" if not left else f"benchmarks: not yet run: {', '.join(left)}")
    summary.main([str(args.out)])
    return rc or (INCOMPLETE if left else 0)


def merge(src: Path, dst: Path, pattern: str = "*") -> None:
    """A part's files into the results, replacing what an earlier run of it wrote (as its Recorder would)."""
    for f in src.glob(pattern):
        if f.is_file():
            shutil.copy(f, dst / f.name)


def parts(args, model: str, suites, first: bool = True, once: set | None = None) -> list[tuple[str, object]]:
    """One model's parts in order, each (name, out_dir -> exit status); one Tulip serves online, scoring
    and bulk. Parts of models after the first are named `part@model`; the kernel sweep and the hop
    run once, with the first model that lists them (`once` collects what has been placed)."""
    once = set() if once is None else once
    q = args.quick
    out: list[tuple[str, object]] = []
    if "kernels" in suites and "kernels" not in once:
        once.add("kernels")
        quick = ["--heads", "4,4,16", "--seqs", "1,4", "--lengths", "16,64", "--iters", "3"] if q else []
        out.append(("kernels", lambda d, quick=quick: kernels.main(["--out", d, *quick])))
    if "gemm" in suites:
        out.append(("gemm", lambda d: gemm.main(["--model", model, "--out", d, *(["--tokens", "16"] if q else [])])))
    if "engine" in suites:
        quick = ["--iters", "5", "--repeats", "1", "--lengths", "16,64"] if q else []
        out.append(("engine", lambda d, quick=quick: engine.main(["--model", model, "--out", d, *quick,
                                                                  *shlex.split(args.engine_args)])))
    if "hop" in suites and "hop" not in once:
        once.add("hop")
        n = ["--n", "20"] if q else []
        out.append(("hop", lambda d: hop.main(["--out", d, "--device-ms", "1", *n])
                    | hop.main(["--out", d, "--model", model, *([] if q else ["--compile"]), *n])))
    grpc_suites = [s for s in suites if s in ("online", "scoring", "bulk")]
    if grpc_suites:
        quick = (["--n", "5", "--n-scoring", "2", "--lengths", "16,64", "--scoring-length", "32",
                  "--bulk-lengths", "32,64", "--bulk-requests", "1,1"] if q else [])
        out.append(("+".join(grpc_suites), lambda d, quick=quick: online.main(
            ["--model", model, "--out", d, "--suites", ",".join(grpc_suites), "--tulip-args", args.tulip_args,
             "--transport", args.transport, *quick])))
    if "concurrency" in suites:
        quick = ["--n", "8", "--levels", "1,4", "--length", "64", "--bulk-requests", "1"] if q else []
        for r in args.replicas.split(","):
            out.append((f"concurrency-replicas-{r}", lambda d, r=r, quick=quick: concurrency.main(
                ["--model", model, "--out", d, "--replicas", r, "--ivy-workers", args.ivy_workers, *quick])))
    return out if first else [(f"{name}@{model}", fn) for name, fn in out]


if __name__ == "__main__":
    sys.exit(main())
