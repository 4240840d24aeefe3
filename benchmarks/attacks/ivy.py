"""Issue 47, faults 9-12: attacks on Ivy's limits against a running stack (a real CPU Tulip serving the
default model, all-MiniLM-L6-v2, and one Ivy worker in front of it), each measured by the Ivy
worker's RSS growth (peak during the attack, `VmHWM` reset before it, less the RSS before) and the
latency of an independent small request (`/v1/embeddings` "hi", every 50 ms) while it runs.

    python -m benchmarks.attacks.ivy [--root /tmp/old] [--model preset:bge-m3] [--only NAME ...] [--out FILE.jsonl]

`--root`: the checkout whose `ivy` / `tulip` run (e.g. `git worktree add /tmp/old <commit>` for the
code before a fix); this checkout's venv runs them. Ivy is restarted before each attack (a clean
baseline: glibc keeps a worker's high-water memory). One JSON line per attack.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from benchmarks.common import free_port, stop

HERE = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def spawn(root: Path, args: list[str], log: Path, ready) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not ready():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{args[:2]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Probe:
    """A small request every 50 ms on its own keep-alive connection (`fresh`: a new connection for
    each); latencies (s) and non-200 statuses or errors."""

    def __init__(self, url: str, fresh: bool = False):
        self.url, self.lat, self.bad, self.fresh = url, [], [], fresh
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    r = (httpx if self.fresh else c).post(self.url + "/v1/embeddings", json={"input": "hi"}, timeout=120)
                    if r.status_code != 200:
                        self.bad.append(r.status_code)
                except httpx.HTTPError as e:
                    self.bad.append(type(e).__name__)
                self.lat.append(time.monotonic() - t0)
                self.stop.wait(0.05)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(130)


def post_raw(port: int, path: str, body: bytes, timeout: float = 120) -> tuple[int, int, float]:
    """(status, reply bytes, seconds) of one POST, read whole (a raw socket: no client-side JSON)."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    chunks = []
    while data := s.recv(1 << 20):
        chunks.append(data)
    s.close()
    reply = b"".join(chunks)
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1") else 0
    return status, len(reply), time.monotonic() - t0


TIMEOUT_S = 120.0  # a body attack's reply waited for this long (--timeout)


def big_text(mib: int) -> str:
    return "a " * (mib * MiB // 2)  # one token per 2 bytes


ATTACKS = {
    "tokenize_16mib": ("/v1/tokenize", lambda: {"input": big_text(16)}),
    "tei_tokenize_16mib": ("/tokenize", lambda: {"inputs": big_text(16)}),
    "tei_embed_truncating_16mib": ("/embed", lambda: {"inputs": big_text(16), "truncate": True}),
    "embeddings_too_long_8mib": ("/v1/embeddings", lambda: {"input": big_text(8)}),
    "embeddings_end_16mib": ("/v1/embeddings", lambda: {"input": big_text(16), "truncate": "end"}),
    "tokenize_commas_16mib": ("/v1/tokenize", lambda: {"input": "," * (16 * MiB)}),
}


def body_attack(port: int, pid: int, name: str) -> dict:
    path, make = ATTACKS[name]
    body = json.dumps(make()).encode()
    t0 = time.monotonic()
    try:
        status, size, secs = post_raw(port, path, body, timeout=TIMEOUT_S)
    except TimeoutError:  # recorded as such (the peak RSS is still read after it)
        status, size, secs = f"no reply in {TIMEOUT_S:g} s", 0, time.monotonic() - t0
    return {"status": status, "reply_bytes": size, "seconds": round(secs, 2), "body_bytes": len(body)}


def chunk_disconnect(port: int, pid: int, tulip_pid: int, n: int = 10) -> dict:
    """Fault 10: n small-bodied requests of ~16,000 tokens each (commas, truncate "chunk"), their
    connections closed 0.3 s after sending; Tulip's CPU seconds over the next 10 s."""
    body = json.dumps({"input": "," * 16000, "truncate": "chunk"}).encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(s)
    time.sleep(0.3)
    c0 = cpu_s(tulip_pid)
    for s in socks:
        s.close()
    time.sleep(10)
    return {"body_bytes": len(body), "requests": n, "tulip_cpu_s_after_disconnect": round(cpu_s(tulip_pid) - c0, 2)}


_FLOOD = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = []
for _ in range(min(int(sys.argv[2]), hard - 30)):
    try:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", int(sys.argv[1])))
        socks.append(s)
    except OSError:
        break
time.sleep(1)
for s in socks:
    try:
        s.send(b"P")
    except OSError:
        pass
time.sleep(4)
print(len(socks), flush=True)
time.sleep(4)
for s in socks:
    s.close()
"""


def one_byte_connections(port: int, pid: int, n: int = 20000) -> dict:
    """Fault 11: n connections that each send one byte and wait; how many Ivy took (its open
    descriptors, 5 s in), and whether a new client is served meanwhile (the probe). The connections
    come from a child process: a flood loop in this one would hold the GIL the probe's thread needs
    and add its own waits to the probe's latency."""
    child = subprocess.Popen([sys.executable, "-c", _FLOOD, str(port), str(n)], stdout=subprocess.PIPE, text=True)
    made = int(child.stdout.readline() or 0)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    child.wait(60)
    return {"connections": made, "ivy_fds": fds}


def main(argv=None) -> int:
    global TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=HERE)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--model", default="default", help="the model Tulip and Ivy serve (e.g. preset:bge-m3: "
                    "XLM-R's Unigram tokenizer, the one fault 9 was found on)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a body attack's reply is waited for")
    ap.add_argument("--ivy-args", default="")
    ap.add_argument("--tulip-args", default="", help="e.g. '--max-batch-tokens 2048' (a CPU step of the default "
                    "16,384 tokens takes seconds, and a running step is never cut short)")
    args = ap.parse_args(argv)
    TIMEOUT_S = args.timeout
    root, logs = args.root.resolve(), Path("/tmp") / f"attacks-ivy-{os.getpid()}"
    logs.mkdir(exist_ok=True)
    names = args.only or [*ATTACKS, "chunk_disconnect", "one_byte_connections"]
    tport, mport = free_port(), free_port()
    tulip = spawn(root, ["-m", "tulip", "--model", args.model, "--port", str(tport), "--device", "cpu",
                         "--metrics-port", str(mport), *args.tulip_args.split()], logs / "tulip.log",
                  lambda: "TULIP_READY" in (logs / "tulip.log").read_text())
    rows = []
    try:
        for name in names:
            port = free_port()
            url = f"http://127.0.0.1:{port}"

            def ready():
                try:
                    return httpx.get(url + "/ready", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            ivy = spawn(root, ["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{tport}", "--model", args.model,
                               *args.ivy_args.split()], logs / f"ivy-{name}.log", ready)
            try:
                for _ in range(20):  # warm: the first requests build caches
                    httpx.post(url + "/v1/embeddings", json={"input": "hi there"}, timeout=30)
                with Probe(url) as idle:
                    time.sleep(1.5)
                Path(f"/proc/{ivy.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                before = status_kib(ivy.pid, "VmRSS")
                with Probe(url, fresh=name == "one_byte_connections") as probe:
                    t0 = time.monotonic()
                    if name in ATTACKS:
                        got = body_attack(port, ivy.pid, name)
                    elif name == "chunk_disconnect":
                        got = chunk_disconnect(port, ivy.pid, tulip.pid)
                    else:
                        got = one_byte_connections(port, ivy.pid)
                    wall = time.monotonic() - t0
                peak = status_kib(ivy.pid, "VmHWM")
                row = {"attack": name, **got, "attack_s": round(wall, 2), "ivy_rss_before_mib": round(before / 1024, 1),
                       "ivy_rss_growth_mib": round((peak - before) / 1024, 1),
                       "probe_idle_p50_ms": round(statistics.median(idle.lat) * 1e3, 1),
                       "probe_max_ms": round(max(probe.lat) * 1e3, 1) if probe.lat else None, "probe_n": len(probe.lat),
                       "probe_failures": probe.bad[:5] + ([f"+{len(probe.bad) - 5}"] if len(probe.bad) > 5 else []),
                       "model": args.model, "root": str(root), "date": time.strftime("%Y-%m-%d")}
            finally:
                stop(ivy, signal.SIGINT)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        tulip.send_signal(signal.SIGTERM)
        tulip.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
