#!/usr/bin/env bash
# Issue 51's image benchmark on a GPU, one device call: benchmarks/images.py for the CLIP ViT-B/16 and SigLIP base
# presets (random weights, real shapes), each in one process of at most 280 s (two presets: under a 10-minute
# call; not yet run on a GPU, so the time each takes is not known here). Results under $OUT:
#   gpu.txt                                   GPU, clocks, driver; torch / transformers / Pillow versions; revision
#   images_clip-vit-base-patch16.jsonl        the rows of benchmarks/images.py (see its docstring), per preset
#   images_siglip-base-patch16-224.jsonl
#   tulip-<preset>.log, ivy-<preset>.log      the servers the run started
#   run.log                                   everything printed
# run.log holds, per preset, a line "== benchmarks.images preset:NAME" and then 13 JSON rows: cell "gate"
# (passed: true, cos_min >= 0.99; false stops that preset, exit 1), "engine" at batch 1 and 256 (one step at a time,
# p50 / p99 ms, images/s, graph_replays > 0 and oversize_steps 0) and 256 two steps in flight, "hf-eager" and
# "hf-compile" at batch 1 and 256, "grpc" at 256 images with 1 and 2 requests in flight and at 1 image (p50 against
# target_p50_ms 1.0), "ivy" (one ~100 KB JPEG, p50 against target_p50_ms 3.0, cos_vs_tulip ~1) and "decode";
# "timeout: ..." or a Python traceback instead means that preset did not finish. The device has no matplotlib:
# draw the charts here afterwards with `python -m benchmarks.images --chart DIR`.
#
# Prepare here once (the device has torch, triton and numpy but no network): `bash benchmarks/images_gpu.sh prep`
# fills .img/whl (ignored: it adds /.img/ to .git/info/exclude) with the wheels of .whl/ the run needs (see
# gpu_checks.sh for how .whl is downloaded; the test-only and scikit-learn wheels left out) and three .whl lacks:
# Pillow (Ivy decodes with it), uvloop (Ivy's event loop) and annotated-doc (FastAPI 0.165 imports it), taken from
# .whl/ or $EXTRA_WHEELS where there, else downloaded with pip (cp312, manylinux). 44 MB; with the tree (~9 MB)
# under a call's 64 MiB.
# Then call the device with carry [".img"] and the command:  bash benchmarks/images_gpu.sh
# (or `bash benchmarks/images_gpu.sh stages`: benchmarks/images_stages.py alone, the CLIP preset on the GPU, rows in
# $OUT/images_stages.jsonl: Ivy's stages and CPU per request, gRPC back to back and after 8 ms idle, the thread steps)
set -o pipefail
EXTRA="pillow-13.0.0 uvloop-0.23.0 annotated_doc-0.0.7"  # not in .whl; the versions `make test`'s venv runs
if [ "${1:-}" = prep ]; then
  set -e
  grep -qx '/.img/' .git/info/exclude 2>/dev/null || echo /.img/ >> .git/info/exclude
  rm -rf .img && mkdir -p .img/whl
  for w in .whl/*.whl; do
    case "$(basename "$w")" in
      scikit_learn-*|joblib-*|threadpoolctl-*|sentence_transformers-*|pytest-*|pytest_timeout-*|pluggy-*|iniconfig-*) ;;
      *) cp "$w" .img/whl/ ;;
    esac
  done
  for want in $EXTRA; do
    found=$(ls .whl/"$want"-*.whl ${EXTRA_WHEELS:+"$EXTRA_WHEELS"/"$want"-*.whl} 2>/dev/null | head -1 || true)
    if [ -n "$found" ]; then
      cp "$found" .img/whl/
    else
      ${PYTHON:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .img/whl "${want%-*}==${want##*-}"
    fi
  done
  ls .img/whl | wc -l; du -sh .img; exit 0
fi

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .img/whl/*.whl 2>&1 \
  | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRELLIS_CACHE=/tmp/trellis-cache
export TRELLIS_GIT_REV="${TRELLIS_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, PIL; print('torch', torch.__version__, 'transformers', transformers.__version__, 'Pillow', PIL.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
echo "revision $TRELLIS_GIT_REV, $(nproc) cores" | tee -a "$OUT/gpu.txt"
if [ "${1:-}" = stages ]; then  # where one JPEG's time goes in Ivy before a GPU Tulip (CLIP preset), not the cells below
  timeout 400 python3 -m benchmarks.images_stages --device cuda --n 1000 --rounds 5 --out "$OUT" \
    --work /tmp/images-stages 2>&1 | grep -v "RANDOM WEIGHTS\|Writing model shards" | tee "$OUT/run.log"
  exit "${PIPESTATUS[0]}"
fi
{
  for m in preset:clip-vit-base-patch16 preset:siglip-base-patch16-224; do
    echo "== benchmarks.images $m"
    timeout 280 python3 -m benchmarks.images --model "$m" --device cuda --out "$OUT" --work /tmp/images-work \
      || echo "benchmarks.images $m: exit $? (124: timeout)"
  done
} 2>&1 | grep -v "RANDOM WEIGHTS\|Writing model shards" | tee "$OUT/run.log"
