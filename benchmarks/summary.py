"""Summarise committed results: a Markdown table beside the published numbers, and a chart.

    python -m benchmarks.summary benchmarks/results

Reads the rows of the runs DIR/summary-inputs.txt names (one glob a line, relative to DIR: the committed results
keep each run in a dated folder of its own), or, without that list, every *.jsonl / *.jsonl.gz in DIR (a
`benchmarks run --out DIR`); writes DIR/SUMMARY.md and DIR/summary_<model>.png. For each published cell it
takes the best Trellis measurement (naming its configuration) and says whether it beats, ties
(within 2 %) or misses the published Rust Tulip and vLLM 0.22 figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import ENGINE_TARGETS, PUBLISHED, pyplot, read_rows, results_files

INPUTS = "summary-inputs.txt"

SCORING = {5: {"vllm-0.22": 9.60, "tulip-rust": 6.17}, 25: {"vllm-0.22": 26.59, "tulip-rust": 22.43},
           50: {"vllm-0.22": 47.29, "tulip-rust": 40.45}}


def verdict(ours: float, theirs: float, higher_is_better: bool) -> str:
    ratio = ours / theirs if higher_is_better else theirs / ours
    if ratio > 1.02:
        return f"beats ({ratio:.2f}x)"
    if ratio >= 0.98:
        return "ties"
    return f"**misses** ({ratio:.2f}x)"


def inputs(d: Path) -> list[Path]:
    """The results files the summary of `d` reads: those `d/summary-inputs.txt` names, else `d`'s own."""
    listed = d / INPUTS
    if not listed.is_file():
        return results_files(d)
    files = []
    for line in listed.read_text().splitlines():
        pattern = line.split("#", 1)[0].strip()
        if pattern:
            found = sorted(d.glob(pattern))
            if not found:
                raise SystemExit(f"{listed}: {pattern!r} names no file")
            files += [f for f in found if f not in files]
    return files


def load(d: Path) -> list[dict]:
    rows = []
    for f in inputs(d):
        for row in read_rows(f):
            if isinstance(row.get("model"), str):  # preset:NAME and the bare NAME of runs before the prefix
                row["model"] = row["model"].removeprefix("preset:")
            rows.append({**row, "_file": str(f.relative_to(d))})
    return rows


def _config(r: dict) -> str:
    words = r.get("backend", "").split()
    attn = r.get("attention") or (words[words.index("--attention") + 1] if "--attention" in words
                                  else "table" if "--attention-table" in words else "auto")
    stream = ", stream" if r.get("transport") == "grpc-stream" else ""
    spin = f", client spins {r['client_spin_ms']:g} ms" if r.get("client_spin_ms") else ""
    served = dict(w.split("=", 1) for w in r.get("server_env", "").split() if "=" in w)  # the servers' TULIP_* settings
    compiled = "--compile" in words or _flag(served.get("TULIP_COMPILE", "false"))
    return attn + (" + compile" if compiled else "") + stream + spin


def _flag(value: str) -> bool:
    """A TULIP_* boolean as Tulip reads it (`trellis.cli.parse_bool`); a value Tulip would refuse: False."""
    from trellis.cli import parse_bool

    try:
        return parse_bool(value)
    except ValueError:
        return False


NONE = {"tulip-rust": float("nan"), "vllm-0.22": float("nan")}


def _vs(v: float, ref: float, hib: bool) -> str:
    return "-" if ref != ref else verdict(v, ref, hib)


def tulip_table(rows: list[dict], model: str) -> tuple[list[str], list[tuple]]:
    pub = PUBLISHED.get(model, {})
    out = ["| workload | Trellis (best run) | config | published Tulip | vs Tulip | published vLLM 0.22 | vs vLLM |",
           "|---|---|---|---|---|---|---|"]
    chart = []
    mine = [r for r in rows if r.get("model") == model and r.get("bench") in ("online", "scoring", "bulk")]
    shapes = sorted({(r["bench"], r["tokens"], r["seqs"]) for r in mine},
                    key=lambda c: (("online", "scoring", "bulk").index(c[0]), c[2], c[1]))
    cells = []
    for bench, L, n in shapes:
        if bench == "online":
            ref = pub.get("online_p50_ms", {}).get(L, NONE)
        elif bench == "scoring":
            ref = SCORING.get(n, NONE) if model == "bge-m3" and L == 512 else NONE  # published for BGE-M3 only
        else:
            ref = pub.get("bulk_emb_per_s", {}).get(L, NONE)
        cells.append((bench, L, n, ref))
    for bench, L, n, ref in cells:
        cand = [r for r in mine if r["bench"] == bench and r["tokens"] == L and r["seqs"] == n]
        hib = bench == "bulk"
        key = "emb_per_s" if hib else "p50_ms"
        best = max(cand, key=lambda r: r[key]) if hib else min(cand, key=lambda r: r[key])
        v = best[key]
        unit = "emb/s" if hib else f"ms p50 (p99 {best['p99_ms']:.2f})"
        name = f"{bench} {n}x{L}" + (", 4 clients" if hib else "")
        t, vl = ref["tulip-rust"], ref["vllm-0.22"]
        out.append(f"| {name} | {v:.2f} {unit} | {_config(best)} | {'-' if t != t else t} | {_vs(v, t, hib)} | "
                   f"{'-' if vl != vl else vl} | {_vs(v, vl, hib)} |")
        chart.append((name, v, ref["tulip-rust"], ref["vllm-0.22"], hib))
    return out, chart


def engine_table(rows: list[dict], model: str) -> list[str]:
    tgt = ENGINE_TARGETS.get(model, {})
    eng = [r for r in rows if r.get("bench") == "engine" and r.get("model") == model
           and r.get("backend", "").startswith("rose") and "first-run" not in r["_file"]]
    # One row per (config, result file): a config measured in several files (say, with two kernel
    # tables) gets the file's name beside it.
    configs = sorted({(r["backend"], r["_file"]) for r in eng})
    shared = {b for b, _ in configs if sum(b == c for c, _ in configs) > 1}
    out = ["| engine config | 1x128 p50 (device) | 1x512 | 1x4096 | 100x512 emb/s | 100 mixed emb/s |",
           "|---|---|---|---|---|---|"]
    for b, f in configs:
        cell = {r["cell"]: r for r in eng if r["backend"] == b and r["_file"] == f}
        label = f"{b} ({Path(f).stem})" if b in shared else b

        def lat(L):
            r = cell.get(f"step 1x{L}")
            return f"{r['p50_ms']:.2f} ({r['device_p50_ms']:.2f})" if r else "-"

        thr = cell.get("100x512 throughput", {}).get("emb_per_s", "-")
        mix = next((r["emb_per_s"] for c, r in cell.items() if c.startswith("100 mixed")), "-")
        out.append(f"| {label} | {lat(128)} | {lat(512)} | {lat(4096)} | {thr} | {mix} |")
    if tgt:
        s = tgt["step_p50_ms"]
        out.append(f"| *target* | *{s[128]}* | *{s[512]}* | *{s[4096]}* | *{tgt['emb_per_s_100x512']}* | "
                   f"*{tgt['emb_per_s_mixed']}* |")
    # Baselines, each cell with ROSE's best config's speed-up over it in brackets.
    best_lat = {L: min((r["p50_ms"] for r in eng if r["cell"] == f"step 1x{L}"), default=None) for L in (128, 512, 4096)}
    best_thr = max((r["emb_per_s"] for r in eng if r["cell"] == "100x512 throughput"), default=None)
    for name, label in (("hf-eager-sdpa", "HF transformers eager bf16 SDPA (padded, same shapes)"),
                        ("hf-compile-reduce-overhead", "HF + torch.compile(mode=reduce-overhead)")):
        hf = {r["cell"]: r for r in rows if r.get("backend", "").startswith(name) and r.get("model") == model}
        if hf:
            cls = next(iter(hf.values()))["backend"].removeprefix(name).strip()  # e.g. "(XLMRobertaModel)"
            label = f"{label} {cls}".rstrip()
            def p50(L, hf=hf):
                r = hf.get(f"step 1x{L}")
                if not r:
                    return "-"
                return f"{r['p50_ms']:.2f}" + (f" (ROSE {r['p50_ms'] / best_lat[L]:.1f}x)" if best_lat[L] else "")

            thr = hf.get("100x512 throughput", {}).get("emb_per_s")
            thr = "-" if thr is None else f"{thr}" + (f" (ROSE {best_thr / thr:.2f}x)" if best_thr else "")
            out.append(f"| {label} | {p50(128)} | {p50(512)} | {p50(4096)} | {thr} | - |")
    return out


def ivy_table(rows: list[dict], model: str) -> list[str]:
    """Concurrency (text in) and bulk through Ivy, per replica and Ivy worker count, and the
    two-replica scale-out check."""
    def setup(r):
        return r.get("replicas", 1), r.get("ivy_workers", 1)

    conc = [r for r in rows if r.get("bench") == "concurrency" and r.get("model") == model]
    bulk = {setup(r): r for r in rows if r.get("bench") == "bulk-ivy" and r.get("model") == model}
    if not conc and not bulk:
        return []
    def client(r):  # the HTTP client library of the latency cells (httpx before it was recorded)
        return r.get("client", "httpx").split()[0]

    out = [f"## {model}: through Ivy over HTTP", "",
           "| replicas | Ivy workers | HTTP client | clients | p50 ms | p99 ms | requests | published Tulip (approx.) | "
           "published vLLM 0.22 (approx.) |", "|---|---|---|---|---|---|---|---|---|"]
    p99 = {}
    for r in sorted(conc, key=lambda r: (*setup(r), client(r), r["clients"])):
        pub = r.get("published_approx") or {}
        p99[(*setup(r), client(r), r["clients"])] = r["p99_ms"]
        out.append(f"| {setup(r)[0]} | {setup(r)[1]} | {client(r)} | {r['clients']} x 1x{r['tokens']} text | "
                   f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['n']} | {pub.get('tulip-rust', '-')} | "
                   f"{pub.get('vllm-0.22', '-')} |")
    out.append("")
    if bulk:
        out += ["| replicas | Ivy workers | bulk via Ivy (4 clients, 100 token lists each) | emb/s |", "|---|---|---|---|"]
        out += [f"| {n} | {w} | {r['cell']} | {r['emb_per_s']} |" for (n, w), r in sorted(bulk.items())]
        out.append("")
    for w in sorted({w for _, w in bulk}):
        if (1, w) in bulk and (2, w) in bulk:
            ratio = bulk[(2, w)]["emb_per_s"] / bulk[(1, w)]["emb_per_s"]
            out.append(f"Two replicas ({w} Ivy workers): bulk {ratio:.2f}x one replica (target >= 1.9x: "
                       f"{'met' if ratio >= 1.9 else '**missed**'}).")
        for c in sorted({k[2] for k in p99}):
            if (2, w, c, 16) in p99 and (1, w, c, 8) in p99:
                a, b = p99[(2, w, c, 16)], p99[(1, w, c, 8)]
                out.append(f"Two replicas at 16 clients ({c}): p99 {a:.2f} ms vs one replica at 8: {b:.2f} ms "
                           f"(target: no worse: {'met' if a <= b else '**missed**'}).")
    return out + [""]


def gemm_table(rows: list[dict], model: str) -> list[str]:
    """Per linear layer and token count: microseconds per call for each GEMM strategy (latest run)."""
    g = [r for r in rows if r.get("bench") == "gemm" and r.get("model") == model]
    if not g:
        return []
    strategies = sorted({r["strategy"] for r in g})
    cell: dict = {}
    for r in sorted(g, key=lambda r: r["when"]):
        cell[(r["layer"], r["m"], r["k"], r["n"], r["strategy"])] = r
    out = [f"## {model}: GEMMs of one block (benchmarks.gemm, us per call in a CUDA graph; weight GB/s of the best)", "",
           "| layer | M x K x N | " + " | ".join(strategies) + " | best GB/s |", "|---|---|" + "---|" * (len(strategies) + 1)]
    for layer, m, k, n in sorted({key[:4] for key in cell}, key=lambda c: (c[0], c[1])):
        got = {s: cell.get((layer, m, k, n, s)) for s in strategies}
        # the GEMM + GELU rows compute more than a GEMM: they are compared with each other, not here
        plain = [r for s, r in got.items() if r and "gelu" not in s] or [r for r in got.values() if r]
        best = min(plain, key=lambda r: r["us"])
        out.append(f"| {layer} | {m} x {k} x {n} | " + " | ".join(f"{r['us']:.1f}" if r else "-" for r in got.values())
                   + f" | {best['weight_gb_s']} ({best['strategy']}) |")
    return out + [f"GPU: {g[0]['gpu']}, {g[0]['when'][:10]}.", ""]


def spin_client(r: dict) -> str:
    return f" / client {r['client_spin_ms']:g}" if r.get("client_spin_ms") else ""


def hop_table(rows: list[dict]) -> list[str]:
    """What a 1x128 request costs besides the GPU (benchmarks.hop), per machine."""
    hop = [r for r in rows if r.get("bench") == "hop"]
    if not hop:
        return []
    out = ["## The hop: one pre-tokenized 1x128 request at a time (benchmarks.hop)", "",
           "The gRPC floor (an echo servicer), then Tulip's engine loop in-process (submit -> result), then the",
           "same Tulip through gRPC: the differences are the breakdown. `spin` is Tulip's --spin-ms (0: the",
           "completion is awaited in a waiter thread), then the client's spin_ms where it polled too. Each run of",
           "benchmarks.hop measures its own echo floor just before its Tulip (the two echo rows show the noise).", "",
           "| machine | server | device step | spin ms | path | p50 ms | p99 ms | n | git |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(hop, key=lambda r: (r["gpu"], r.get("when", ""), not r["server"].startswith("grpc echo"), str(r.get("device_ms")),
                                        -(r.get("spin_ms") or 0), r["transport"] != "in-process engine loop")):
        step = "real" if "(" in r["server"] else ("-" if r.get("device_ms") is None else f"{r['device_ms']:g} ms")
        path = r["transport"] + ("" if r.get("socket") in (None, "tcp") else f" ({r['socket']} socket)")
        out.append(f"| {r['gpu']}, {r.get('cpus', '?')} cores | {r['server']} | {step} | "
                   f"{'-' if r.get('spin_ms') is None else r['spin_ms']}{spin_client(r)} | {path} | {r['p50_ms']:.2f} | "
                   f"{r['p99_ms']:.2f} | {r['n']} | {r['git']} |")
    return out + [""]


def draw_hop(rows: list[dict], path: Path) -> bool:
    """Stacked bars per (machine, server): Tulip's engine loop in-process, the gRPC floor (echo on a
    stream), and the rest of a streamed request (Tulip's servicer around the loop). Latest run each."""
    plt = pyplot()
    hop = [r for r in rows if r.get("bench") == "hop"]
    bars = []
    for gpu, server, spin, client in sorted({(r["gpu"], r["server"], r.get("spin_ms") or 0, r.get("client_spin_ms") or 0)
                                             for r in hop if not r["server"].startswith("grpc echo")}):
        def latest(pred):
            c = [r for r in hop if r["gpu"] == gpu and (r.get("client_spin_ms") or 0) == client and pred(r)]
            return max(c, key=lambda r: r["when"]) if c else None

        def mine(r):
            return r["server"] == server and (r.get("spin_ms") or 0) == spin

        loop = latest(lambda r: mine(r) and r["transport"] == "in-process engine loop")
        stream = latest(lambda r: mine(r) and r["transport"] == "stream" and r.get("socket") == "tcp")
        echo = latest(lambda r: r["server"] == "grpc echo" and r["transport"] == "stream" and r.get("socket") == "tcp")
        if loop and stream and echo:
            rest = max(0.0, stream["p50_ms"] - loop["p50_ms"] - echo["p50_ms"])
            label = f"{gpu}\n{server}, spin {spin:g} ms" + (f", client spins {client:g} ms" if client else "")
            bars.append((label, loop["p50_ms"], echo["p50_ms"], rest))
    if plt is None or not bars:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(bars) + 2.0))
    y = range(len(bars))
    left = [0.0] * len(bars)
    for i, (label, color) in enumerate([("engine loop in-process (step + wait)", "#4c72b0"),
                                        ("gRPC floor (echo, one stream)", "#dd8452"),
                                        ("Tulip servicer + client around it", "#c44e52")]):
        vals = [b[1 + i] for b in bars]
        ax.barh(list(y), vals, left=left, color=color, label=label)
        for j, v in enumerate(vals):
            if v > 0.05:
                ax.text(left[j] + v / 2, j, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(list(y), [b[0] for b in bars], fontsize=7)
    ax.set_xlabel("p50 ms, one pre-tokenized 1 x 128 request at a time over an open EmbedStream")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def draw(chart: list[tuple], model: str, env: dict, path: Path) -> None:
    import numpy as np

    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for ax, hib in zip(axes, (False, True)):
        cells = [c for c in chart if c[4] == hib]
        if not cells:
            ax.set_axis_off()
            continue
        x = np.arange(len(cells))
        for i, (label, idx) in enumerate([("Trellis (measured)", 1), ("published Tulip (Rust)", 2),
                                          ("published vLLM 0.22", 3)]):
            bars = ax.bar(x + (i - 1) * 0.27, [c[idx] for c in cells], 0.27, label=label)
            ax.bar_label(bars, fmt="%.0f" if hib else "%.2f", fontsize=7)
        ax.set_xticks(x, [c[0] for c in cells], fontsize=8, rotation=10)
        if hib:
            ax.set_ylabel("embeddings / s (higher is better)")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("p50 latency, ms, log (lower is better)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{model} through Tulip gRPC (client in another process), {env.get('gpu')}, "
                 f"torch {env.get('torch')}, {env.get('when', '')[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    d = Path((argv or sys.argv[1:] or ["benchmarks/results"])[0])
    rows = load(d)
    source = (f"the runs `{INPUTS}` names (their folders' READMEs say what ran, where and how)"
              if (d / INPUTS).is_file() else "the JSON lines in this folder")
    lines = ["# Benchmark summary", "",
             f"Generated by `python -m benchmarks.summary` from {source}; every row there",
             "says when, on what GPU, torch and git revision it was measured. Presets (`preset:bge-m3`, `preset:pplx-embed-*`)",
             "have the real shapes and random weights. Published figures: ../shared/DESIGN.md (end to end,",
             "client in another process). `ties` means within 2 %.", ""]
    models = list(PUBLISHED) + sorted({r["model"] for r in rows if "model" in r} - set(PUBLISHED))
    for model in models:
        t, chart = tulip_table(rows, model)
        if len(t) > 2:
            gates = [r for r in rows if r.get("bench") == "gate" and r.get("model") == model] or [{"min_cosine": float("nan")}]
            n = {b: sorted({r["n"] for r in rows if r.get("model") == model and r.get("bench") == b})
                 for b in ("online", "scoring")}
            lines += [f"## {model}: through Tulip over gRPC", "",
                      f"Correctness gate before timing: min cosine {min(g['min_cosine'] for g in gates):.6f} against "
                      f"the float32 eager engine (threshold 0.999). Requests per latency cell: {n['online']} online, "
                      f"{n['scoring'] or '-'} scoring (published: 10,000). Bulk: 4 client processes.",
                      "", *t, ""]
            env = next(r for r in rows if r.get("bench") in ("online", "scoring", "bulk") and r.get("model") == model)
            lines.insert(len(lines) - len(t) - 1, f"Measured on {env.get('gpu')}, torch {env.get('torch')}, "
                                                  f"{env.get('when', '')[:10]}.\n")
            png = d / f"summary_{Path(model).name}.png"
            draw(chart, model, env, png)
            if png.is_file():
                lines += [f"![{model} through Tulip]({png.name})", ""]
        lines += ivy_table(rows, model)
        lines += gemm_table(rows, model)
        e = engine_table(rows, model)
        if len(e) > 2 and not e[2].startswith("| *target*"):
            lines += [f"## {model}: engine step in-process (no gRPC)", "",
                      "Wall clock of `step()` + copy + sync, p50 ms, device time in brackets.", "", *e, ""]
    hop = hop_table(rows)
    if hop and draw_hop(rows, d / "hop_breakdown.png"):
        hop += ["![the hop, broken down](hop_breakdown.png)", ""]
    lines += hop
    (d / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
