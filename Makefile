# Trellis: `make serve` runs the local stack (`trellis serve`), `make test` runs every test.
# Both create .venv and install what they need. Without a GPU (no nvidia-smi)
# the CPU build of torch is pinned; with one, the GPU extra is added.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
comma := ,
TORCH := $(if $(HAS_GPU),torch>=2.10,torch==2.13.0)
EXTRAS := $(if $(HAS_GPU),test$(comma)gpu,test)
MODEL ?= default
REPLICAS ?= 1
PORT ?= 8000
# make test: pytest-xdist workers, each taking whole files (module-scoped servers stay one per file)
TEST_WORKERS ?= 2

.PHONY: install serve test test-slow proto clean

# deploy/constraints.txt pins every version (python -m deploy.lock writes it); the images install the same.
$(BIN)/.installed: pyproject.toml deploy/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c deploy/constraints.txt "$(TORCH)"
	$(BIN)/pip install -q -c deploy/constraints.txt -e ".[$(EXTRAS)]"
	touch $@

install: $(BIN)/.installed

# MODEL: a Hugging Face Hub id (ORG/NAME[@REVISION], downloaded once into the Hugging Face cache), a model
# directory, default (all-MiniLM-L6-v2) or preset:NAME (random weights); trellis serve --help
serve: install
	$(BIN)/trellis serve --model $(MODEL) --replicas $(REPLICAS) --port $(PORT)

# tests/test_interop.py's Node client (@grpc/grpc-js, @grpc/proto-loader at tests/node's lock), where npm is
# installed (the test skips without node / npm). Its h2load case needs `apt-get install nghttp2-client`.
NPM := $(shell command -v npm 2>/dev/null)
tests/node/node_modules/.installed: tests/node/package.json tests/node/package-lock.json
	npm ci --no-audit --no-fund --prefix tests/node
	touch $@

test: install $(if $(NPM),tests/node/node_modules/.installed)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests marked slow too (the benchmark harness's own features; ~2 minutes more).
test-slow: install $(if $(NPM),tests/node/node_modules/.installed)
	TRELLIS_SLOW=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Regenerate the gRPC stubs from proto/ (grpcio-tools pinned in pyproject.toml).
proto: install
	$(BIN)/python -m tulip.protogen

clean:
	rm -rf $(VENV) build *.egg-info
