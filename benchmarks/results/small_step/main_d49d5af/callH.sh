#!/bin/bash
# call H: the tree as it lands: add_norm's tiles again, engine both families, 1 x 128 profile, GPU tests
REV=$(cat exp/gpu/REV); export TRELLIS_GIT_REV=$REV
R=$OUT/r; mkdir -p $R/engine
(nvidia-smi -L; nproc; date -u) > $R/host.txt
source benchmarks/offline.sh env
timeout 90 python3 - > $R/norm_tiles.jsonl 2>$R/norm_tiles.err <<'PY'
import json, os, time, torch
from benchmarks.small_step import time_graph, set_mode, NORM_TILES
from rose.kernels import gemm
dev, dt, L = torch.device("cuda"), torch.bfloat16, 24
set_mode("pdl"); h = 1024
meta = dict(when=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), gpu=torch.cuda.get_device_name(), torch=torch.__version__, git=os.environ["TRELLIS_GIT_REV"], layers=L, iters=40)
for tokens in (128, 512):
    _, split, _ = gemm.plan(tokens, h, h)
    parts = [torch.randn(split, tokens, h, device=dev) for _ in range(L)]
    res = torch.randn(tokens, h, device=dev, dtype=dt); g = torch.ones(h, device=dev, dtype=dt); beta = torch.zeros(h, device=dev, dtype=dt); bias = torch.randn(h, device=dev, dtype=dt)
    for rep in range(2):
        for t in NORM_TILES:
            us = time_graph(lambda i, t=t: gemm.add_norm(parts[i], bias, res, g, beta, 1e-5, config=t), L, 40)
            print(json.dumps(dict(op="add_norm-tile", tokens=tokens, split=split, config=list(t), default=t == (1, 8), rep=rep, us=round(us, 3), **meta)), flush=True)
PY
echo "norm tiles rc $? $(date -u +%T)"
python3 - $R/norm_tiles.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    r=json.loads(l); d[(r['tokens'],tuple(r['config']))].append(r['us'])
for tok in (128,512):
    rows=sorted((min(v),k[1],v) for k,v in d.items() if k[0]==tok)
    print(tok, 'default', d[(tok,(1,8))], 'best', rows[:4])
PY
timeout 150 python3 -m benchmarks.engine --model bge-m3 --compile --lengths 128,512 --scoring 5x512 --iters 250 --repeats 3 --out $R/engine > $R/engine_bge.log 2>&1; echo "bge rc $? $(date -u +%T)"; grep -o '"cell": "[^"]*"\|"p50_ms": [0-9.]*\|"emb_per_s": [0-9.]*' $R/engine_bge.log | paste -sd' ' 
timeout 120 python3 -m benchmarks.engine --model pplx-embed-1-0.6b --compile --lengths 128,512 --scoring 5x512 --iters 250 --repeats 1 --out $R/engine > $R/engine_pplx.log 2>&1; echo "pplx rc $? $(date -u +%T)"; grep -o '"cell": "[^"]*"\|"p50_ms": [0-9.]*\|"emb_per_s": [0-9.]*' $R/engine_pplx.log | paste -sd' '
timeout 90 python3 -m benchmarks.profile_step --model bge-m3 --tokens 128 --compile > $R/profile_bge-m3_1x128.txt 2>&1; echo "profile rc $? $(date -u +%T)"; grep -m1 "kernels," $R/profile_bge-m3_1x128.txt; grep "_add_norm_kernel" $R/profile_bge-m3_1x128.txt | head -1 | tr -s ' ' | cut -c1-200
tar czf $OUT/rH.tgz -C $OUT r
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py > $R/test_gpu_$REV.txt 2>&1; echo "tests rc $? $(date -u +%T)"; tail -3 $R/test_gpu_$REV.txt
date -u >> $R/host.txt
tar czf $OUT/rH.tgz -C $OUT r && rm -rf $R
exit 0
