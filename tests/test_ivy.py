"""Ivy with no reachable Tulip: alive, not ready, and a clean 503 (never a 500)."""

import signal

import httpx

from tests.conftest import Proc, free_port, http_status


def test_no_tulip_means_503_not_500(tmp_path):
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{free_port()}"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/health") == 200, timeout=60)
        assert http_status(url + "/ready") == 0  # urllib raises on 503
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 503, r.text
        assert "no inference server" in r.json()["error"]["message"]
    finally:
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in proc.output()


def test_multiple_workers(tulip_server, tmp_path):
    """--workers 2 runs uvicorn's process manager with the app factory (config through IVY_CONFIG_JSON)."""
    target, _ = tulip_server
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", target, "--workers", "2"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/ready") == 200, timeout=90)
        for _ in range(6):
            r = httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=30)
            assert r.status_code == 200 and len(r.json()["data"]) == 2
    finally:
        proc.stop()
    assert "Traceback" not in proc.output()
