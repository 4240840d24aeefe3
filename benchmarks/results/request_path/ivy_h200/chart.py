import json, sys
from pathlib import Path
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
D = Path("benchmarks/results/request_path/ivy_h200")
order = ["receive", "decode", "checks", "template", "tokenize", "balancer", "grpc", "encode", "send"]
runs = ["before_1", "after_1", "before_2", "after_2"]
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
for ax, enc in zip(axes, ("float", "base64")):
    for i, run in enumerate(runs):
        rows = [json.loads(l) for l in open(D / f"gateway_{run}.jsonl")]
        st = {r["stage"]: r["p50_us"] for r in rows if r["bench"] == "ivy-stage" and r["encoding"] == enc}
        left = 0
        for j, s in enumerate(order):
            v = st.get(s, 0)
            ax.barh(i, v, left=left, color=plt.cm.tab10(j), label=s if i == 0 else None)
            left += v
        ax.text(left + 10, i, f"{left:.0f} us", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [r.replace("_", " #") for r in runs])
    ax.set_title(f"Ivy stage p50s, 512-token text, {enc}")
    ax.set_xlabel("sum of stage p50s, us (stand-in Tulip)")
fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, ncol=9, loc="lower center")
fig.suptitle("Ivy on an H200 host (16 cores): before = 4454128, after = 3c116bb (tokie flat batch, one write)", fontsize=9)
fig.tight_layout(rect=(0, 0.08, 1, 1))
fig.savefig(D / "ivy_stages.png", dpi=110)
