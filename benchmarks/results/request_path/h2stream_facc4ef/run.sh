#!/bin/bash
# call 1: Ivy alone A/B, then the stack (after), then the stack (before)
set -x
bash benchmarks/offline.sh install .whl-web > /dev/null
REV=$(cat exp/gpu/REV); export TRELLIS_GIT_REV=$REV; source benchmarks/offline.sh env
R=$OUT/r; mkdir -p $R/gw $R/after $R/before
nproc > $R/host.txt; python3 -c "import hpack; print('hpack', hpack.__version__)" >> $R/host.txt
for i in 1 2; do
  (cd .ab/before && PYTHONPATH=/tmp/site:$PWD TRELLIS_GIT_REV=$(cat REVISION) timeout 120 python3 -m benchmarks.gateway --model bge-m3 --stages --n 2000 --label before_$i --out $R/gw) > $R/gw/before_$i.log 2>&1
  timeout 120 python3 -m benchmarks.gateway --model bge-m3 --stages --n 2000 --label after_$i --out $R/gw > $R/gw/after_$i.log 2>&1
done
TULIP_COMPILE=true TULIP_WARMUP=1x128,1x512 timeout 200 python3 -m benchmarks.online --model bge-m3 --suites online --lengths 128,512 --n 2000 --transport stream --out $R/after > $R/after/online.log 2>&1
TULIP_COMPILE=true TULIP_WARMUP=1-16x512 timeout 200 python3 -m benchmarks.concurrency --model bge-m3 --levels 1,16 --n 1600 --bulk-requests 0 --ivy-workers 4 --out $R/after > $R/after/conc.log 2>&1
cd .ab/before; export TRELLIS_GIT_REV=$(cat REVISION); export PYTHONPATH=/tmp/site:$PWD
TULIP_COMPILE=true TULIP_WARMUP=1x128,1x512 timeout 200 python3 -m benchmarks.online --model bge-m3 --suites online --lengths 128,512 --n 2000 --transport stream --out $R/before > $R/before/online.log 2>&1
TULIP_COMPILE=true TULIP_WARMUP=1-16x512 timeout 150 python3 -m benchmarks.concurrency --model bge-m3 --levels 1,16 --n 1600 --bulk-requests 0 --ivy-workers 4 --out $R/before > $R/before/conc.log 2>&1
cd $OUT && tar czf r.tgz r
