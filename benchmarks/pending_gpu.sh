#!/usr/bin/env bash
# The GPU runs the 2026-12-06 sessions prepared and no device could make (none started that session): one device
# call per mode, each under 10 minutes on an H100 / H200, run in this order while the machine stays warm (calls
# back to back; a later mode reuses the wheels an earlier one installed under /tmp/site). Everything prints;
# rows under $OUT. Say which card ran what when committing them under benchmarks/results/.
#
#   prep                 here, once: .gpu/graphs_old.py (rose/graphs.py before the cuBLAS-workspace fix, 5b67968),
#                        .ray/ (Ray 2.60 without its Java jars, RLlib and dashboard build, xz: ~29 MB, plus the
#                        small wheels Ray needs; the device has numpy). `.whl`, `.gpu/site` and `.img` as
#                        gpu_checks.sh / images_gpu.sh prepare them.
#   suite    carry [".whl", ".gpu"]    ~6 min. tests/test_gpu_images.py's cuBLAS-workspace test on the code before
#                        the fix (expected: "unspecified launch failure" or a mismatch at the 256-image replay) and
#                        after (expected: passed), then the GPU suite one process per file (at 5b67968 on an
#                        H100: 245 passed, 3 skipped), the persistent layer's GPU test.
#   serve    carry [".img", ".gpu", ".prio-base"]   ~9 min. Issue 47: the never-reading peer after `hold_s`
#                        (benchmarks.attacks.h2, H100 before it: +129 MiB, worst probe 290 ms; aim <= ~100 MiB,
#                        <= ~1 s). Issue 50: online p99 beside a job (benchmarks.priority, old loop via
#                        .prio-base/ = tulip/{loop,scheduler}.py of c934d41, new at live caps 2,048 / 1,024;
#                        target p99 <= 2x idle), then the 100k x 512 job (target >= 0.95 x the engine).
#   kernels  carry [".whl", ".gpu"]    ~4 min. Issue 52: the persistent one-kernel layer against today's small step
#                        (benchmarks.persistent: us per layer, GB/s, WINS/LOSES), pplx-embed's bf16 100 x 512 in
#                        benchmarks.engine (500 emb/s in benchmarks.fp8 against the issue's 861: which is right), the
#                        kernels of a 256-image CLIP step (benchmarks.profile_step --images).
#   job      carry [".img"]    ~4 min. Issue 50: serve's last part alone, the 100k x 512 job (target >= 0.95 x the engine).
#   lane     carry [".img"]    ~8 min. Issue 50: the online lane (online steps on a high-priority CUDA stream with
#                        graphs of their own): tests/test_gpu_lane.py (an online step launched behind a bulk step
#                        finishes first; both equal their steps alone), then benchmarks.priority one stream vs the
#                        lane (--online-lane-tokens 0 2048; target p99 <= 2x idle; one stream before: 4.03 ms).
#   ray      carry [".ray"]  after `serve` on the same warm machine   ~4 min. Issue 50: the job on a local Ray
#                        with one GPU actor against in-process (target >= 0.90).
#   (fp8: benchmarks/fp8_gpu.sh, carry [".fp8"]: the new recipe's GPU test and fidelity at 3,000 sentences.)
#   (images: benchmarks/images_gpu.sh and `... stages`, carry [".img"]: after the C resampler and the uncopied
#    pixels; H100 before: Ivy one JPEG p50 11.6 ms, target 3.)
set -o pipefail
mode=${1:-suite}
if [ "$mode" = prep ]; then
  set -e
  for d in .gpu .ray .prio-base; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
  mkdir -p .gpu .prio-base .ray/whl
  git show 5b67968:rose/graphs.py > .gpu/graphs_old.py
  git show c934d41:tulip/loop.py > .prio-base/loop.py && git show c934d41:tulip/scheduler.py > .prio-base/scheduler.py
  PY=${PYTHON:-.venv/bin/python}
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" ray==2.60.0
  (cd "$tmp" && unzip -q ray-*.whl && rm -rf ray/jars ray/rllib ray/dashboard/client/build ray/llm \
    && find . -name '*.js.map' -delete && tar -cf - ray ray-*.dist-info | xz -T2 -6 > ray-stripped.tar.xz)
  mv "$tmp/ray-stripped.tar.xz" .ray/
  $PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .ray/whl jsonschema msgpack requests pandas
  rm -f .ray/whl/numpy-*.whl; rm -rf "$tmp"; du -sh .ray; exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
wheels=.whl; case "$mode" in serve|job|lane) wheels=.img/whl ;; esac
[ "$mode" = ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 TRELLIS_CACHE=/tmp/trellis-cache
export TRELLIS_GIT_REV="${TRELLIS_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
echo "revision $TRELLIS_GIT_REV, mode $mode, $(nproc) cores, $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
case "$mode" in
suite)
  cp rose/graphs.py /tmp/graphs_new.py && cp .gpu/graphs_old.py rose/graphs.py
  echo "== cuBLAS-workspace test, rose/graphs.py before the fix"
  timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/test_gpu_images.py -k cublas 2>&1 | tail -4
  cp /tmp/graphs_new.py rose/graphs.py
  echo "== the same, after"
  timeout 120 python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/test_gpu_images.py -k cublas 2>&1 | tail -2
  for f in test_gpu test_gpu_images test_gpu_families test_gpu_decoders test_gpu_request_path test_gpu_lane test_gpu_fp8 test_kernels test_persistent; do
    timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 "tests/$f.py" > "/tmp/$f.log" 2>&1
    echo "$f: $(tail -1 "/tmp/$f.log")"; grep -E "^(FAILED|ERROR)" "/tmp/$f.log" | head -5
    # a call brings back at most 8 files: every file's log appended to one, as each ends (tracebacks in it)
    { echo "===== $f"; cat "/tmp/$f.log"; } >> "$OUT/suite_logs.txt"
  done | tee "$OUT/suite.txt" ;;
serve)
  echo "== issue 47: the never-reading peer"
  timeout 120 python3 -m benchmarks.attacks.h2 --model preset:bge-m3 --device cuda --only read_replies unread_replies \
    --seconds 10 --warm-s 5 --out "$OUT/attacks_h2.jsonl" 2>&1 | tail -6
  echo "== issue 50: online beside a job"
  timeout 240 python3 -m benchmarks.priority --model preset:bge-m3 --device cuda --bulk 8 --seqs 100 --length 512 \
    --online-length 128 --n 300 --gap-ms 5 --alone-s 3 --online-batch-step-tokens 0 1024 --base .prio-base \
    --out "$OUT" 2>&1 | grep -E "priority-summary|Error" | tail -8
  echo "== issue 50: the 100k x 512 job"
  timeout 200 python3 -m benchmarks.embed_job --model preset:bge-m3 --device cuda --rows 100000 --length 512 --runs 1 \
    --out "$OUT/embed_job.json" 2>&1 | tail -8 ;;
kernels)
  echo "== issue 52: the persistent layer"
  timeout 170 python3 -m benchmarks.persistent --max-seconds 75 --out "$OUT" 2>&1 | tee "$OUT/persistent.log" \
    | grep -v -e '^{' -e Warning -e warn_once
  echo "== pplx-embed bf16 in benchmarks.engine"
  timeout 90 python3 -m benchmarks.engine --model preset:pplx-embed-1-0.6b --device cuda --lengths 512 --scoring "" \
    --iters 20 --repeats 3 2>&1 | tail -6
  echo "== issue 51: where a 256-image CLIP step's time goes (ROSE 7,262 img/s < transformers eager 8,572 on an H100)"
  timeout 90 python3 -m benchmarks.profile_step --model preset:clip-vit-base-patch16 --images 256 --rows 15 2>&1 \
    | grep -v "RANDOM WEIGHTS\|Writing model" | tail -22 ;;
job)
  echo "== issue 50: the 100k x 512 job"
  timeout 400 python3 -m benchmarks.embed_job --model preset:bge-m3 --device cuda --rows 100000 --length 512 --runs 1 \
    --out "$OUT/embed_job.json" 2>&1 | tail -8 ;;
lane)
  echo "== issue 50: the online lane's GPU test"
  timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 180 tests/test_gpu_lane.py 2>&1 | tail -4
  echo "== issue 50: online beside a job, one stream / the online lane"
  timeout 330 python3 -m benchmarks.priority --model preset:bge-m3 --device cuda --bulk 8 --seqs 100 --length 512 \
    --online-length 128 --n 300 --gap-ms 5 --alone-s 3 --online-lane-tokens 0 2048 --out "$OUT" 2>&1 \
    | grep -E "priority-summary|Error" | tail -8 ;;
ray)
  tar -xJf .ray/ray-stripped.tar.xz -C /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .ray/whl/*.whl 2>&1 | grep -v "already exists" | tail -3
  timeout 330 python3 -m benchmarks.embed_job --model preset:bge-m3 --device cuda --rows 20000 --length 512 --runs 1 \
    --engine-rows 5000 --ray --ray-actors 1 --out "$OUT/embed_job_ray.json" 2>&1 | tail -10 ;;
*) echo "mode: prep | suite | serve | kernels | job | lane | ray"; exit 2 ;;
esac
