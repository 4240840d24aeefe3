#!/usr/bin/env bash
# Installing what the benchmarks need on a GPU machine without network, from wheels carried in
# (each call of the machine used here carries at most 64 MiB, so they come in several calls while
# the machine stays warm; everything lands in one --target directory, /tmp/site by default).
#
#   bash benchmarks/offline.sh install .whl            # any directory of wheels (FlashInfer + tvm-ffi, web stack, ...)
#   bash benchmarks/offline.sh stash .whl-fa4a         # a wheel split in parts: keep this call's part outside the tree
#   bash benchmarks/offline.sh install .whl-fa4b       # joins stashed + carried *.partNN into their wheel, installs all
#   TRELLIS_GIT_REV=abc1234 source benchmarks/offline.sh env   # PYTHONPATH (incl. FA4's dsl_packages), caches, revision
#
# A split wheel: `split -b 46000000 -d -a 2 W.whl W.whl.part` gives W.whl.part00, W.whl.part01, ...
SITE=${TRELLIS_SITE:-/tmp/site}
STASH=${TRELLIS_STASH:-/tmp/wheel-parts}

if [ "${1:-}" = env ]; then  # sourced: set no shell options in the caller
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD"
  export TRELLIS_CACHE=/tmp/trellis-cache PYTHONUNBUFFERED=1
  TRELLIS_GIT_REV=${TRELLIS_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export TRELLIS_GIT_REV
  return 0 2>/dev/null || exit 0
fi
set -euo pipefail
case "${1:-}" in
  stash)
    mkdir -p "$STASH" && cp "$2"/* "$STASH"/ && ls "$STASH" ;;
  install)
    mkdir -p "$STASH" && cp "$2"/* "$STASH"/
    for first in "$STASH"/*.part00; do
      [ -e "$first" ] || continue
      whl=${first%.part00}
      cat "${whl}".part?? > "$whl" && rm "${whl}".part??
    done
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$STASH"/*.whl 2>&1 | grep -v "already exists" || true
    rm -f "$STASH"/*.whl
    ls "$SITE" | grep -c dist-info | xargs echo "dist-info directories in $SITE:" ;;
  *)
    sed -n '2,11p' "$0"; exit 2 ;;
esac
