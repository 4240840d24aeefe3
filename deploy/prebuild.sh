#!/usr/bin/env bash
# Pre-build the kernel caches into the cache volume, then exit: start one Tulip with the serving
# flags ("$@", the same --model, --compile, --warmup ... as the service), wait until its warm-up is
# done (SERVING), stop it (SIGTERM: it drains and exits). Inductor, Triton and FlashInfer keep what
# they compiled under /cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE),
# so replicas started on that volume later load kernels instead of compiling them.
#   deploy/prebuild.sh --model BAAI/bge-m3 --compile --warmup 1x128 --warmup 1-16x512
set -euo pipefail
port=${PREBUILD_PORT:-50099}
timeout_s=${PREBUILD_TIMEOUT_S:-1800}
python -m tulip --host 127.0.0.1 --port "$port" "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' EXIT
for ((waited = 0; waited < timeout_s; waited += 2)); do
  if python -m tulip.probe "127.0.0.1:$port" >/dev/null 2>&1; then
    kill -TERM "$pid"
    wait "$pid"
    trap - EXIT
    echo "prebuild: kernel caches written after ${waited}s"
    exit 0
  fi
  kill -0 "$pid" 2>/dev/null || { echo "prebuild: tulip exited before SERVING" >&2; exit 1; }
  sleep 2
done
echo "prebuild: not SERVING after ${timeout_s}s" >&2
exit 1
