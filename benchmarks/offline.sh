#!/usr/bin/env bash
# Installing what the benchmarks need on a GPU machine without network, from wheels carried in
# (each call of the machine used here carries at most 64 MiB, so they come in several calls while
# the machine stays warm; everything lands in one --target directory, /tmp/site by default).
#
#   bash benchmarks/offline.sh install .whl            # any directory of wheels (FlashInfer + tvm-ffi, web stack, ...)
#   bash benchmarks/offline.sh stash .whl-fa4a         # a wheel split in parts: keep this call's part outside the tree
#   bash benchmarks/offline.sh install .whl-fa4b       # joins stashed + carried *.partNN into their wheel, installs all
#                                                      # (a wheel whose parts are not all here yet stays stashed)
#   export TRELLIS_GIT_REV=abc1234; source benchmarks/offline.sh env   # PYTHONPATH (incl. FA4's dsl_packages), caches
#   TRELLIS_GIT_REV=abc1234 bash benchmarks/offline.sh run [DIR [ARGS]]  # the one benchmark command (README): part
#       after another while under MAX_MINUTES (2.5: no part runs past a 10-minute call), re-issued until it says
#       complete; results into DIR (/tmp/res) and $OUT/results.tgz;
#       ARGS are added to `python -m benchmarks run` (a later --model or --tulip-args wins)
#   TRELLIS_GIT_REV=abc1234 bash benchmarks/offline.sh test         # the GPU tests, on the same caches
#
# A split wheel: `split -b 46000000 -d -a 2 W.whl W.whl.part` gives W.whl.part00, W.whl.part01, ...
# A wheel too big for two calls can first be recompressed with LZMA, a zip method pip reads (nvidia-cutlass-dsl-libs-cu13
# 4.8.1: 92 -> 65.5 MB, split 55 + 10.5 MB; FA4's whole set then comes in two calls):
#   python3 -c "import sys,zipfile as z; a=z.ZipFile(sys.argv[1]); b=z.ZipFile(sys.argv[2],'w',z.ZIP_LZMA); [b.writestr(i,a.read(i),z.ZIP_LZMA) for i in a.infolist()]; b.close()" W.whl lz/W.whl

if [ "${1:-}" = env ]; then  # sourced: no shell options or helper variables are left in the caller
  export PYTHONPATH="${TRELLIS_SITE:-/tmp/site}:${TRELLIS_SITE:-/tmp/site}/nvidia_cutlass_dsl/dsl_packages:$PWD"
  export TRELLIS_CACHE=/tmp/trellis-cache PYTHONUNBUFFERED=1
  export TRELLIS_GIT_REV="${TRELLIS_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  return 0 2>/dev/null || exit 0
fi
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  echo "offline.sh: only 'env' is meant to be sourced; run the others with bash" >&2
  return 2
fi

set -euo pipefail
SITE=${TRELLIS_SITE:-/tmp/site}
STASH=${TRELLIS_STASH:-/tmp/wheel-parts}
case "${1:-}" in
  stash)
    mkdir -p "$STASH" && cp "$2"/* "$STASH"/ && ls "$STASH" ;;
  install)
    mkdir -p "$STASH" && cp "$2"/* "$STASH"/
    for first in "$STASH"/*.part00; do
      [ -e "$first" ] || continue
      whl=${first%.part00}
      cat "$whl".part?? > "$whl"
      if ! python3 -m zipfile -t "$whl" > /dev/null 2>&1; then  # a part is still to come: keep them, install the rest
        echo "offline.sh: $(basename "$whl") does not join yet (parts here: $(ls "$whl".part?? | xargs -n1 basename | tr '\n' ' '))" >&2
        rm -f "$whl"
        continue
      fi
      rm "$whl".part??
    done
    if compgen -G "$STASH/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$STASH"/*.whl 2>&1 | { grep -v "already exists" || true; }
      rm -f "$STASH"/*.whl
    fi
    echo "$(find "$SITE" -maxdepth 1 -name '*.dist-info' | wc -l) packages in $SITE" ;;
  run)
    RES=${2:-/tmp/res}
    source "$0" env
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    export TULIP_COMPILE=true TULIP_WARMUP=1-16x512,32x512 TULIP_ATTENTION_TABLE="$RES"
    rc=0
    python3 -m benchmarks run --suite all --model preset:bge-m3,preset:pplx-embed-1-0.6b=engine+online+bulk --out "$RES" \
      --replicas "$([ "$gpus" -ge 2 ] && echo 1,2 || echo 1)" --ivy-workers 4 --resume --max-minutes "${MAX_MINUTES:-2.5}" \
      --tulip-args "--compile --attention-table $RES --warmup 1x128 --warmup 1x512 --warmup 1x4096 --warmup 32x512 --max-queued-tokens 4000000" \
      --engine-args "--compile --attention-table $RES --hf-baseline --hf-compile" "${@:3}" || rc=$?
    if [ -n "${OUT:-}" ] && [ -d "$RES" ]; then tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
    exit $rc ;;
  test)
    source "$0" env
    python3 -m pytest -q tests/test_gpu.py ;;
  *)
    sed -n '2,20p' "$0"; exit 2 ;;
esac
