#!/bin/bash
# call I: the 100 x 512 throughput cell: sustained vs isolated step time, greedy vs even splits, clocks and power
REV=$(cat exp/gpu/REV); export TRELLIS_GIT_REV=$REV
R=$OUT/r; mkdir -p $R
(nvidia-smi -L; nproc; date -u; nvidia-smi -q -d CLOCK,POWER | head -60) > $R/host.txt
source benchmarks/offline.sh env
timeout 200 python3 exp/gpu/tput.py $R/smi.csv > $R/tput.jsonl 2> $R/tput.err; echo "tput rc $? $(date -u +%T)"; cat $R/tput.jsonl; tail -3 $R/tput.err
python3 - $R/smi.csv <<'PY'
import sys
rows=[l.strip().split(', ') for l in open(sys.argv[1]) if l.strip()]
print(len(rows),'samples'); 
for r in rows[::max(1,len(rows)//40)]: print(r)
PY
date -u >> $R/host.txt
tar czf $OUT/rI.tgz -C $OUT r && rm -rf $R
exit 0
