#!/bin/bash
# call J: the request path's tail with the host's CPUs held out of deep idle states (PM QoS: /dev/cpu_dma_latency = 0 while a holder process keeps it open) against without, taking turns
REV=$(cat exp/gpu/REV); export TRELLIS_GIT_REV=$REV
R=$OUT/r; mkdir -p $R
bash benchmarks/offline.sh install .whl-t 2>&1 | tail -1
source benchmarks/offline.sh env
(nvidia-smi -L; nproc; date -u; ls -l /dev/cpu_dma_latency; for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "$s $(cat $s/name) latency $(cat $s/latency) disable $(cat $s/disable)"; done; cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor* 2>&1; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1) > $R/host.txt 2>&1
cat $R/host.txt
hold() { python3 -c "
import os, time, struct
f = os.open('/dev/cpu_dma_latency', os.O_WRONLY); os.write(f, struct.pack('i', 0)); print('holding cpu_dma_latency 0', flush=True); time.sleep(3600)" & HOLDER=$!; sleep 0.5; }
show() { python3 -c "
import json,glob
for f in glob.glob('$R/$1/*.jsonl'):
    for l in open(f):
        r=json.loads(l)
        if 'p50_ms' in r and ('bge-m3' in str(r.get('server','')) or 'in-process' in str(r.get('transport',''))): print('  ', r.get('client'), r.get('transport'), r.get('socket'), r['p50_ms'], r['p99_ms'], round(r['p99_ms']-r['p50_ms'],3))"; }
for round in 1 2; do for q in 0 1; do
  P=--proto; [ $round = 2 ] && P=--no-proto
  HOLDER=; [ $q = 1 ] && hold
  T=140; [ $round = 2 ] && T=90
  timeout $T python3 -m benchmarks.hop --model bge-m3 --compile --n 2000 --no-stages $P --no-sync-floors --out $R/qos${q}_r$round > $R/qos${q}_r$round.log 2>&1
  echo "qos $q round $round rc $? $(date -u +%T)"; show qos${q}_r$round
  [ -n "$HOLDER" ] && kill $HOLDER
done; done
date -u >> $R/host.txt
tar czf $OUT/rJ.tgz -C $OUT r && rm -rf $R
exit 0
