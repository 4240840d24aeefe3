"""Before / after of the request path's tail on one machine: `benchmarks.hop` run once per variant,
then one compact table (p50, p99, p99 - p50 per transport, and where the slow requests' time went).

    python -m benchmarks.tailab --before .ab/before [--n 2000] [--out DIR]               # null engine, 1 ms step
    python -m benchmarks.tailab --before .ab/before --model preset:bge-m3 --compile [--n 2000]  # the real engine
    python -m benchmarks.tailab --table DIR                                               # the table of an earlier run

Variants, in this order: `before` (with `--before DIR`: a source tree, e.g. `git archive main | tar -x -C
DIR`; it is copied and this tree's `benchmarks/` laid over it, so both sides are measured by the same
harness and only Tulip / ROSE / trellis differ), `after` (this tree), `after+io` (this tree with
`GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener` in every process: gRPC's completion-queue
thread reads the sockets itself instead of EventEngine threads handing each message on to it, one
thread wake-up fewer per message each way; grpc reads the variable at import) and `after+cspin` (this
tree, the client's loop polling while a reply is due: `--client-spin-ms 2`; it tells whether the
client's wake-up is the tail); `--variants` picks (default: all four with the null engine,
`before,after,after+io` with `--model`). Each variant is one `benchmarks.hop` process (its servers on
the variant's gRPC I/O: `--server-io default`, so only `after+io` turns grpc's EventEngine off) with
`--device-ms 1` (or `--model`), `--stages`, and `--proto` with the null engine; with `--model` only the
stage-recording server is served (`--tail-only`: one model load and compile per variant, not two).
JSON lines per variant go to `--out` (default: a temporary directory), the table to stdout.

The table's `trellis.client` rows come from the server without stamps where it ran (`hop` rows), else
from the stamping one (`hop-tail`'s client-side times); the stamping Tulip's column has the client's
times against it and its own receipt-to-write total (which for the stream ends when gRPC reports the
send done, so it can exceed what the client saw); `slow` is the requests over the client's p99,
`worst` the segments most often the largest excess over their own median in them (`send`: client to
Tulip's deserializer; Tulip's stages; `back`: gRPC's core to the client's awaiting code), and `gc`
how many slow requests a collection overlapped (server / client).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import read_rows, results_files
from benchmarks.hop import INLINE_IO

ROOT = Path(__file__).resolve().parent.parent


def _tree(before: Path, work: Path) -> Path:
    """A copy of `before` with this tree's benchmarks/ over its own."""
    dst = work / "before-tree"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(before, dst, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".ab"), symlinks=True)
    shutil.copytree(ROOT / "benchmarks", dst / "benchmarks", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    return dst


def _run(name: str, tree: Path, hop_args: list[str], extra_env: dict, out: Path) -> Path:
    path = out / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.hop", *hop_args]
    print(f"== {name}: {' '.join(cmd[1:])} (in {tree}{', ' if extra_env else ''}"
          f"{' '.join(f'{k}={v!r}' for k, v in extra_env.items())})", file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra_env)
    if name == "before" and "TRELLIS_GIT_REV" not in os.environ:
        env["TRELLIS_GIT_REV"] = "before"
    with open(path, "w") as f:
        r = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.PIPE, text=True)
    tail = [line for line in r.stderr.splitlines() if line.startswith(("tail,", "  "))]
    print("\n".join(tail), file=sys.stderr, flush=True)
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"benchmarks.hop ({name}) exited {r.returncode}")
    return path


def _rows(path: Path) -> list[dict]:
    return read_rows(path)


def table(paths: list[Path]) -> str:
    """The before / after table of hop runs (one JSON-lines file per variant, named by the variant)."""
    head = ("| variant | transport | trellis.client p50 / p99 | p99 - p50 | proto aio p50 / p99 | in-process p50 "
            "| stamping Tulip: client p50 / p99, inside p50 / p99 | slow: worst segments (of n) | slow: mean excess of the top 3 (ms) | gc in slow (srv / cli) "
            "| server collections gen0/1/2 |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for path in paths:
        rows = _rows(path)
        name = path.name.removesuffix(".gz").removesuffix(".jsonl")
        inproc = next((r for r in rows if r["bench"] == "hop" and r["transport"] == "in-process engine loop"), None)
        for transport in ("stream", "unary"):
            timed = next((r for r in rows if r["bench"] == "hop" and r["transport"] == transport and r["socket"] == "tcp"
                          and not r["server"].startswith("grpc echo")), None)
            tail = [r for r in rows if r["bench"] == "hop-tail" and r["transport"] == transport]
            total = next((r for r in tail if r["segment"] == "all"), None)
            if timed is None and total is not None:
                timed = total  # the stamping server's own client times
            if timed is None:
                continue
            proto = next((r for r in rows if r["bench"] == "hop-proto" and r.get("client") == "aio"
                          and r["transport"] == transport and r["server"] != "grpc echo"
                          and not r["server"].startswith("grpc echo")), None)
            inside = next((r for r in rows if r["bench"] == "hop-stages" and r["transport"] == transport
                           and r["stage"] == "total"), None)
            segs = [r for r in tail if r["segment"] != "all"]
            worst = sorted(segs, key=lambda r: -r["slow_worst"])[:3]
            top = sorted(segs, key=lambda r: -r["slow_excess_ms"])[:3]
            gcs = (f"{total['gc_server_slow']} / {total['gc_client_slow']} (all: {total['gc_server_all']} / "
                   f"{total['gc_client_all']})" if total else "")
            gens = "/".join(str(v["n"]) for v in total["gc_server"].values()) if total else ""
            out.append(
                f"| {name} | {transport} | {timed['p50_ms']:.3f} / {timed['p99_ms']:.3f} | "
                f"{timed['p99_ms'] - timed['p50_ms']:.3f} | "
                + (f"{proto['p50_ms']:.3f} / {proto['p99_ms']:.3f}" if proto else "") + " | "
                + (f"{inproc['p50_ms']:.3f}" if inproc else "") + " | "
                + (f"{total['p50_ms']:.3f} / {total['p99_ms']:.3f}, " if total else "")
                + (f"{inside['p50_ms']:.3f} / {inside['p99_ms']:.3f}" if inside else "") + " | "
                + ", ".join(f"{r['segment']} {r['slow_worst']}" for r in worst if r["slow_worst"])
                + (f" (of {total['slow']})" if total else "") + " | "
                + ", ".join(f"{r['segment']} {r['slow_excess_ms']:.3f}" for r in top) + f" | {gcs} | {gens} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, default=None, help="a source tree to measure as `before`")
    ap.add_argument("--model", default="", help="benchmarks.hop --model (default: the null engine, a 1 ms step)")
    ap.add_argument("--compile", action="store_true", help="with --model")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--variants", default="",
                    help="comma-separated, of before (needs --before), after, after+io, after+cspin; default: all "
                         "with the null engine, before,after,after+io with --model")
    ap.add_argument("--out", type=Path, default=None, help="directory for each variant's JSON lines")
    ap.add_argument("--table", type=Path, default=None, help="only print the table of the *.jsonl[.gz] in this directory")
    args = ap.parse_args(argv)
    if args.table is not None:
        order = {"before": 0, "after": 1, "after+io": 2, "after+cspin": 3}
        stem = lambda p: p.name.removesuffix(".gz").removesuffix(".jsonl")  # noqa: E731
        print(table(sorted(results_files(args.table), key=lambda p: (order.get(stem(p), 9), stem(p)))))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="tailab-"))
    out.mkdir(parents=True, exist_ok=True)
    hop = ["--n", str(args.n), "--stages", "--server-io", "default"]  # the variants set gRPC's I/O themselves
    hop += (["--model", args.model, "--tail-only"] + (["--compile"] if args.compile else [])) if args.model else \
        ["--device-ms", "1", "--proto", "--no-sync-floors"]
    wanted = args.variants.split(",") if args.variants else (
        ["before", "after", "after+io"] if args.model else ["before", "after", "after+io", "after+cspin"])
    if args.before is None:
        wanted = [v for v in wanted if v != "before"]
    known = {
        "before": lambda: (_tree(args.before.resolve(), out), hop, {}),
        "after": lambda: (ROOT, hop, {}),
        "after+io": lambda: (ROOT, hop, {"GRPC_EXPERIMENTS": INLINE_IO}),
        "after+cspin": lambda: (ROOT, hop + ["--client-spin-ms", "2"], {}),
    }
    if unknown := set(wanted) - set(known):
        ap.error(f"unknown variants {sorted(unknown)} (known: {', '.join(known)})")
    paths = [_run(name, *known[name](), out) for name in wanted]
    print(f"JSON lines in {out}", file=sys.stderr)
    print(table(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
