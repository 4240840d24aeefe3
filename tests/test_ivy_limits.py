"""Issue 47, faults 9-12: Ivy's limits against a real Tulip + Ivy on loopback (one stack for the module,
the default MiniLM model, 256 tokens at most): long texts tokenized only as far as a request needs
(memory and time follow the tokens kept, not the text), the request's token and reply limits, a
small body with large work cancelled when its client leaves, the connection cap and the descriptor
limit, and an empty API key refused at start-up."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.conftest import ROOT, Child, Proc, free_port, metric
from tests.sentences import SENTENCES

MAX_TOKENS = 40_000  # --max-request-tokens
MAX_CONNECTIONS = 40
FDS = 1024  # Ivy is started with this soft descriptor limit; it raises it to the hard one


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _kib(pid: int, key: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    tport, metrics = free_port(), free_port()
    tulip = Proc(["-m", "tulip", "--model", "default", "--port", str(tport), "--device", "cpu",
                  "--max-batch-tokens", "512", "--metrics-port", str(metrics)], tmp)
    port = free_port()
    ivy = Child(["bash", "-c", f"ulimit -Sn {FDS} && exec {sys.executable} -m ivy --port {port} --tulip 127.0.0.1:{tport} "
                 f"--max-request-tokens {MAX_TOKENS} --max-reply-mb 1 --max-connections {MAX_CONNECTIONS}"],
                tmp / "ivy.log")
    url = f"http://127.0.0.1:{port}"
    try:
        tulip.wait_for(lambda: "TULIP_READY" in tulip.output())
        ivy.wait_for(lambda: _status(url + "/ready") == 200, timeout=60)
        yield url, port, ivy, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        ivy.stop()
        tulip.stop()


@pytest.fixture(scope="module")
def tok(model_path):
    t = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    t.no_truncation()
    t.no_padding()
    return t


def test_long_texts_cost_the_tokens_kept_not_their_length(stack, tok):
    """Fault 9: 4 MiB of text (2 M tokens) to /v1/tokenize, TEI's /tokenize, /v1/embeddings without
    truncation and TEI's /embed truncating: a 413 / 400 / 200 in well under a second each, Ivy's peak
    RSS up < 100 MiB for all of it (before: 200s after seconds, +1-2 GB each); token-exact replies."""
    url, _, ivy, _ = stack
    big = "a " * (2 << 20)
    Path(f"/proc/{ivy.p.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _kib(ivy.p.pid, "VmRSS")
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c:
        r = c.post(url + "/v1/tokenize", json={"input": big})
        assert r.status_code == 413 and f"more than {MAX_TOKENS} tokens" in r.json()["error"]["message"], r.text[:300]
        r = c.post(url + "/tokenize", json={"inputs": big})
        assert r.status_code == 413 and r.json()["error_type"] == "Validation", r.text[:300]
        r = c.post(url + "/v1/embeddings", json={"input": big})
        assert r.status_code == 400 and "more than this model's maximum of 256" in r.text, r.text[:300]
        r = c.post(url + "/embed", json={"inputs": big, "truncate": True})
        assert r.status_code == 200, r.text[:300]
        cut = np.array(c.post(url + "/embed", json={"inputs": "a " * 300, "truncate": True}).json())
        assert np.allclose(np.array(r.json()), cut, atol=1e-6)  # the same first 254 tokens
        r = c.post(url + "/tokenize", json={"inputs": "a " * 100_000})  # 100,002 tokens of JSON: over 1 MiB
        assert r.status_code == 413 and "--max-reply-mb" in r.json()["error"], r.text[:300]
    took = time.monotonic() - t0
    grew = (_kib(ivy.p.pid, "VmHWM") - before) / 1024
    print(f"IVY_LIMITS long texts: {took:.2f} s, peak RSS +{grew:.1f} MiB")
    assert grew < 100, grew
    assert took < 10, took

    # exact where whole: a 30,000-character text (several segments) as `tokenizers` tokenizes it
    text = " ".join(SENTENCES[k % len(SENTENCES)] for k in range(400))
    assert len(text) > 30_000
    with httpx.Client(timeout=60) as c:
        got = c.post(url + "/v1/tokenize", json={"input": [text, "hi"]}).json()["data"]
        assert got[0]["tokens"] == tok.encode(text).ids and got[1]["tokens"] == tok.encode("hi").ids
        rows = c.post(url + "/tokenize", json={"inputs": text}).json()[0]
        enc = tok.encode(text)
        assert [t["id"] for t in rows] == enc.ids
        assert [(t["start"], t["stop"]) for t in rows[1:-1]] == [tuple(len(text[:x].encode()) for x in o)
                                                                for o in enc.offsets[1:-1]]
        assert c.post(url + "/v1/tokenize", json={"input": text, "truncate": True}).json()["data"][0]["tokens"] == \
            enc.ids[:255] + [102]


def test_a_small_body_with_large_work_is_cancelled_when_its_client_leaves(stack):
    """Fault 10: 16,000 commas (16 KB, under WATCH_BYTES) with truncate "chunk" are ~16,000 tokens of
    Tulip work: its client disconnecting must cancel it (Tulip counts it CANCELLED); before, only
    bodies over 16 KiB were watched and the work ran to the end."""
    url, port, _, metrics = stack

    def cancelled() -> float:
        return metric(httpx.get(metrics).text, "tulip_requests_total", status="CANCELLED")

    def queued() -> float:
        return metric(httpx.get(metrics).text, "tulip_queue_tokens")

    before = cancelled()
    body = json.dumps({"input": "," * 16000, "truncate": "chunk"}).encode()
    assert len(body) < 16 << 10
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 20
    while queued() <= 0:
        assert time.monotonic() < deadline, "the work never reached Tulip's queue"
        time.sleep(0.02)
    s.close()
    t0 = time.monotonic()
    while cancelled() <= before:
        assert time.monotonic() - t0 < 5, "Tulip saw no cancellation"
        time.sleep(0.05)
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 200



class _SlowCpu:
    """A CPU engine (steps run in Tulip's step thread) whose step takes 0.2 s; each row is its
    sequence's first token id. `ran`: the tokens of each step it ran."""

    device = torch.device("cpu")
    embedding_dim, dtype, extra_outputs, sparse_rows, image_size = 4, torch.float32, (), False, 0
    spec = types.SimpleNamespace(max_seq_len=256, vocab_size=1000, pooling="mean", normalize=False,
                                 special_token_ids=(), quantized_outputs=False)

    def __init__(self):
        self.ran, self.started = [], threading.Event()

    def step(self, batch, extras=frozenset(), urgent=False):
        self.ran.append(int(batch.num_tokens))
        self.started.set()
        time.sleep(0.2)
        out = batch.input_ids[batch.cu_seqlens[:-1].long()].float().unsqueeze(1).repeat(1, 4)
        return types.SimpleNamespace(synchronize=lambda: out)


def test_cancelled_work_stops_at_the_next_cpu_piece():
    """Fault 10, Tulip's side: ten disconnected 16,000-token requests still held a probe 15 s, because
    the CPU step running when they left ran whole and a second one, formed while it ran, waited in the
    step thread's queue and ran after it though all its requests were cancelled. Now a CPU step runs
    CPU_PIECE_TOKENS at a time, skipping pieces whose requests are all cancelled, and no step is formed
    while one runs: of two cancelled requests of two pieces each, one piece runs (before: both
    requests whole, [4096, 4096]). A request not cancelled gets its rows from every piece, in order."""
    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop, Request
    from tulip.steps import CPU_PIECE_TOKENS

    seq = 256
    n = 2 * CPU_PIECE_TOKENS // seq  # two pieces

    def big(first: int = 1) -> Request:
        return Request(np.repeat(np.arange(first, first + n, dtype=np.int32), seq), [seq] * n)

    engine = _SlowCpu()

    async def main():
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=4 * CPU_PIECE_TOKENS, max_inflight=2))
        loop.start()
        tasks = [asyncio.ensure_future(loop.submit(big())) for _ in range(2)]
        await asyncio.sleep(0)
        assert await asyncio.to_thread(engine.started.wait, 5)
        for t in tasks:
            t.cancel()
        probe = await asyncio.wait_for(loop.submit(Request(np.full(4, 7, dtype=np.int32), [4])), 5)
        assert probe[0, 0] == 7
        ran_before = list(engine.ran)
        rows = await asyncio.wait_for(loop.submit(big(100)), 5)
        await loop.stop()
        return ran_before, rows

    ran, rows = asyncio.run(main())
    assert ran == [CPU_PIECE_TOKENS, 4], ran
    assert engine.ran[2:] == [CPU_PIECE_TOKENS, CPU_PIECE_TOKENS], engine.ran
    assert rows[:, 0].tolist() == list(range(100, 100 + n))

def test_one_byte_connections_cannot_take_every_descriptor(stack):
    """Fault 11: 300 connections that each send one byte and wait: Ivy holds at most
    --max-connections of them (the longest-waiting closed to make room), a new client is served at
    once meanwhile, and Ivy raised its soft descriptor limit to the hard one at start (before: it
    held every connection until the 30 s read timeout, 20,000 filled its descriptors)."""
    url, port, ivy, _ = stack
    limits = Path(f"/proc/{ivy.p.pid}/limits").read_text()
    soft, hard = next(x for x in limits.splitlines() if x.startswith("Max open files")).split()[3:5]
    assert soft == hard and int(soft) > FDS, (soft, hard)
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"P")
            socks.append(s)
        time.sleep(0.5)
        fds = len(list(Path(f"/proc/{ivy.p.pid}/fd").iterdir()))
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=10)
        waited = time.monotonic() - t0
        assert r.status_code == 200 and waited < 1, (r.status_code, waited)
        assert fds < MAX_CONNECTIONS + 60, fds  # the cap, and the worker's own descriptors (channels, logs, loop)
    finally:
        for s in socks:
            s.close()


def test_an_empty_api_key_is_refused_at_start_up(tmp_path):
    """Fault 12: `--api-keys ""` (an unset variable expanded) let `Authorization: Bearer` with no key
    in. Now it is a start-up error (exit 2, one line naming the flag); IVY_API_KEYS="" still means no
    keys (documented: compose's default), as an unset variable does."""
    from ivy.config import IvyConfig

    p = subprocess.run([sys.executable, "-m", "ivy", "--tulip", f"127.0.0.1:{free_port()}", "--port",
                        str(free_port()), "--api-keys", ""], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert p.stderr.strip().splitlines()[-1].startswith("__main__.py: error: --api-keys: '' is not a usable API key")
    for bad in ("", " ", "k\n", "a b"):
        with pytest.raises(ValueError, match="--api-keys"):
            IvyConfig(tulip=("127.0.0.1:1",), api_keys=("k1", bad))
    assert IvyConfig(tulip=("127.0.0.1:1",), api_keys=("k1",)).api_keys == ("k1",)
