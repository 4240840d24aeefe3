"""The gateway installs and serves without torch, and the kernel-cache pre-build runs, each as the
images do it but without a container runtime (none runs here: tests/test_deploy_files.py).

The gateway: the project's wheel built from what deploy/Dockerfile.gateway COPYs (the contracts and
Ivy: no tulip/, rose/ or presets/), with its `gateway` extra and deploy/constraints.txt, into a fresh
venv (~25 s with pip's cache warm; it needs the package index), no torch in it, then Ivy from that
venv in front of a real Tulip (from the test environment) answers /health, /ready and an embedding
equal to sentence-transformers'.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port, http_status
from tests.deployfiles import DOCKERFILES, copies

ROOT = Path(__file__).resolve().parents[1]
NETWORK_ERRORS = ("NewConnectionError", "Name or service not known", "Temporary failure in name resolution",
                  "Network is unreachable", "No matching distribution found")


def test_gateway_installs_without_torch_and_serves(tmp_path, tulip_server, st_model, model_path):
    pytest.importorskip("setuptools")
    # pip run with nothing of this checkout on its path (PYTHONPATH would show it the in-tree egg-info
    # a wheel build leaves, and it would count trellis as installed)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("IVY_")}
    # the image's /app: what Dockerfile.gateway COPYs, and nothing else of the checkout
    app = tmp_path / "app"
    for src, dest in copies(DOCKERFILES["gateway"]):
        to = app / Path(dest).relative_to("/app")
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, to, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / src, to)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(app)], check=True, cwd=tmp_path, timeout=300, env=clean)
    (wheel,) = wheels.glob("trellis-*.whl")
    packages = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/__init__.py")}
    assert packages == {"trellis", "ivy"}, packages  # the gateway needs neither tulip nor rose nor presets
    venv = tmp_path / "gateway"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-compile",
                        "-c", str(ROOT / "deploy" / "constraints.txt"), f"{wheel}[gateway]"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=clean)
    if r.returncode and any(e in r.stdout + r.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"the package index cannot be reached: {(r.stdout + r.stderr)[-300:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "list", "--format", "json"],
                            capture_output=True, text=True, check=True, timeout=120, env=clean)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"trellis", "fastapi", "tokenizers", "grpcio"} <= names
    assert not {n for n in names if n in ("torch", "triton", "safetensors") or n.startswith("nvidia-")}, names

    # Ivy from that venv alone: nothing of this checkout on its path, the default model's directory
    target, _ = tulip_server
    port = free_port()
    log = (tmp_path / "ivy.log").open("w")
    ivy = subprocess.Popen([str(py), "-m", "ivy", "--model", str(model_path), "--served-model-name",
                            "all-MiniLM-L6-v2", "--port", str(port), "--tulip", target],
                           cwd=tmp_path, env=clean, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while http_status(f"http://127.0.0.1:{port}/ready") != 200:
            assert ivy.poll() is None, (tmp_path / "ivy.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "ivy.log").read_text()
            time.sleep(0.2)
        assert http_status(f"http://127.0.0.1:{port}/health") == 200
        maps = Path(f"/proc/{ivy.pid}/maps").read_text()
        assert "torch" not in maps and str(venv) in maps  # its own packages, none of torch's libraries
        texts = ["a gateway without torch", "tokenizes and routes"]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", method="POST",
                                     data=json.dumps({"input": texts, "model": "all-MiniLM-L6-v2"}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            got = np.array([d["embedding"] for d in json.loads(resp.read())["data"]])
        want = st_model.encode(texts, normalize_embeddings=True)
        assert (np.sum(got * want, axis=1) > 0.9999).all()
    finally:
        ivy.send_signal(signal.SIGTERM)
        assert ivy.wait(30) == 0
        log.close()


def test_prebuild_script_warms_up_then_exits(tmp_path):
    """deploy/prebuild.sh starts a Tulip with the service's settings (here from TULIP_* variables, as
    the compose prebuild service gives them), waits for SERVING, stops it and exits 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PREBUILD_PORT=str(free_port()), TULIP_MODEL="default", TULIP_DEVICE="cpu", TULIP_WARMUP="2x16")
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / "deploy" / "prebuild.sh")], env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "prebuild: kernel caches written" in out and "tulip: stopped" in out  # drained, not killed
    assert time.monotonic() - t0 < 120

