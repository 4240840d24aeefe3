"""Probe: where the 100 x 512 throughput cell's time goes. Per-step device time (CUDA events on the engine's
stream around each step, recorded by the host as it launches) against wall time, sustained (10 repeats) and
isolated; the budget's greedy split (32/32/32/4) against an even one (25 x 4); GPU clocks and power sampled."""
import json, os, subprocess, time, sys
import numpy as np, torch
from benchmarks.engine import budget_batches, rand_seqs
from rose.batch import Batch
from rose.engine import Engine, EngineConfig

smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader", "-lms", "200"], stdout=open(sys.argv[1], "w"), stderr=subprocess.DEVNULL)
eng = Engine(EngineConfig(model="bge-m3", device="cuda", dtype="bfloat16", compile=True))
seqs = rand_seqs([512] * 100, eng.spec.vocab_size, seed=1)
splits = {"greedy": budget_batches(seqs), "even25": [Batch.from_sequences(seqs[i:i + 25]) for i in range(0, 100, 25)],
          "even20": [Batch.from_sequences(seqs[i:i + 20]) for i in range(0, 100, 20)]}
for name, batches in splits.items():
    for _ in range(3):
        for b in batches:
            eng.step(b).synchronize()
def run(batches, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        lz = [eng.step(b) for b in batches]
        for z in lz:
            z.synchronize()
    return time.perf_counter() - t0
for rnd in range(2):
    for name, batches in splits.items():
        dt = run(batches, 10)
        print(json.dumps(dict(probe="throughput", split=name, sizes=[len(b.seq_lens) for b in batches],
                              round=rnd, reps=10, emb_per_s=round(1000 / dt, 1), ms_per_100=round(dt * 100, 2))), flush=True)
# isolated step times (synchronised, 20 each) per distinct batch
for name, batches in splits.items():
    for b in batches[:1] + batches[-1:]:
        ts = []
        for _ in range(20):
            torch.cuda.synchronize(); t = time.perf_counter(); eng.step(b).synchronize(); ts.append(time.perf_counter() - t)
        print(json.dumps(dict(probe="isolated", split=name, seqs=len(b.seq_lens),
                              p50_ms=round(float(np.median(ts)) * 1e3, 3))), flush=True)
smi.terminate()
