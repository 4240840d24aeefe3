#!/bin/bash
# call G: pipelined attention key loop + add_norm one-pass statistics: kernel probe, engine A/B taking turns, GPU tests with both on
REV=$(cat exp/gpu/REV); export TRELLIS_GIT_REV=$REV
R=$OUT/r; mkdir -p $R/engine
(nvidia-smi -L; nproc; date -u) > $R/host.txt
source benchmarks/offline.sh env
timeout 170 python3 exp/gpu/probe.py > $R/probe.jsonl 2> $R/probe.err; echo "probe rc $? $(date -u +%T)"; grep -v '^{' $R/probe.jsonl | head -40; tail -3 $R/probe.err
python3 - $R/probe.jsonl <<'PY'
import json,sys,collections
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith('{'):
        r=json.loads(l)
        if r['op']=='attention': d[(r['op'],tuple(r['heads']),r['seqs'],r['length'],tuple(r['tile']),r['default'],r['pipe'])].append(r['us'])
        else: d[(r['op'],r['tokens'],r['one_pass'],r['max_err'])].append(r['us'])
for k,v in sorted(d.items(), key=str): print(k, v)
PY
run() { # name env...
  local name=$1; shift
  env "$@" timeout 100 python3 -m benchmarks.engine --model $M --compile --lengths 128,512 --scoring 5x512 --iters 250 --repeats 2 --out $R/engine/$name > $R/engine/$name.log 2>&1
  echo "$name rc $? $(date -u +%T) $(python3 -c "
import json,glob
for f in glob.glob('$R/engine/$name/*.jsonl'):
    for l in open(f):
        r=json.loads(l)
        if 'p50_ms' in r: print(r['cell'].split()[-1], r['p50_ms'], end='  ')
        elif 'emb_per_s' in r: print(r['cell'].split()[0], r['emb_per_s'], end='  ')")"
}
M=bge-m3
for round in 1 2; do
  run bge_base_r$round ROSE_X=0
  run bge_pipe_r$round ROSE_ATTENTION_PIPELINE=1
  run bge_one1_r$round ROSE_NORM_ONE_PASS=1
  run bge_one2_r$round ROSE_NORM_ONE_PASS=2
  run bge_both_r$round ROSE_ATTENTION_PIPELINE=1 ROSE_NORM_ONE_PASS=1
done
M=pplx-embed-1-0.6b
run pplx_base ROSE_X=0
run pplx_pipe ROSE_ATTENTION_PIPELINE=1
ROSE_ATTENTION_PIPELINE=1 ROSE_NORM_ONE_PASS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py -x > $R/test_gpu_knobs_$REV.txt 2>&1; echo "tests rc $? $(date -u +%T)"; tail -3 $R/test_gpu_knobs_$REV.txt
date -u >> $R/host.txt
tar czf $OUT/rG.tgz -C $OUT r && rm -rf $R
exit 0
