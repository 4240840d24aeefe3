"""tulip.h2server against a hostile HTTP/2 peer (issue 47, faults 1-8): raw frames over a socket
(benchmarks.h2raw) to the server serving real handlers (test_h2server's echo and Direct methods,
grpc_health's servicer) in a thread of this process, and to a real Tulip process: CONTINUATION
floods and HPACK bombs, windows opened only for what was consumed, replies to a peer that does not
read, PING / SETTINGS floods, per-frame work independent of the calls open, rapid reset, preface /
idle / stall deadlines and the connection cap, and a table of malformed frames with the connection
or stream error (or gRPC status) each must get."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from benchmarks.h2raw import RawH2, frame, grpc_message, request_block
from tests.conftest import Proc, free_port
from tests.test_h2server import SERVICE, Handlers, Session, add, ident
from trellis.tulip.v1 import tulip_pb2
from tulip.h2limits import (COMPRESSION_ERROR, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, NO_ERROR,
                            PROTOCOL_ERROR, REFUSED_STREAM, STREAM_CLOSED, Limits)
from tulip.h2server import Direct, Server
from trellis.h2frames import (ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PADDED, PING,
                              PRIORITY, PUSH_PROMISE, RST_STREAM, SETTINGS, WINDOW_UPDATE)
from trellis.h2frames import literal as _literal

UNARY, BIDI, DIRECT_BIDI = f"/{SERVICE}/Unary", f"/{SERVICE}/Bidi", f"/{SERVICE}/DirectBidi"
CHECK = "/grpc.health.v1.Health/Check"
INVALID_ARGUMENT, RESOURCE_EXHAUSTED = 3, 8
# small limits, so each bound is reached in milliseconds (the defaults are the same code with other numbers)
LIMITS = Limits(control_burst=100, control_rate=10.0, reset_burst=100, reset_rate=10.0, stall_s=1.0, reply_stall_s=1.0,
                preface_timeout_s=0.5, idle_timeout_s=1.0, max_connections=40, conn_buffered=2 << 20,
                call_output=1 << 20, conn_output=2 << 20)


class Served:
    """A tulip.h2server.Server on an event loop in a thread of its own (the test talks raw sockets)."""

    def __init__(self, limits: Limits, max_message: int = 1 << 20):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            self.server = Server(max_message=max_message, limits=limits)
            self.h = Handlers()
            add(self.server, self.h)
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
            self.port = await self.server.listen("127.0.0.1", 0)

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)

    def raw(self, **kw) -> RawH2:
        return RawH2("127.0.0.1", self.port, **kw)

    def on_loop(self, fn):
        """fn() run on the server's loop; its result."""
        return asyncio.run_coroutine_threadsafe(_call(fn), self.loop).result(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _call(fn):
    return fn()


@pytest.fixture(scope="module")
def served():
    s = Served(LIMITS)
    yield s
    s.stop()


def settings(*pairs) -> bytes:
    return b"".join(struct.pack(">HL", k, v) for k, v in pairs)


def window_updates(got, sid: int) -> list[int]:
    return [struct.unpack(">L", p)[0] for t, _, s, p in got if t == WINDOW_UPDATE and s == sid]


# --- 1. header blocks --------------------------------------------------------------------------


def test_continuation_flood_and_hpack_bomb_close_the_connection(served):
    c = served.raw()
    c.send(frame(HEADERS, 0, 1, request_block(UNARY)))  # then 16 KiB CONTINUATIONs that never end the block
    c.send(frame(CONTINUATION, 0, 1, b"\x00" * 16384) * 3)
    assert c.goaway(timeout=0.3) is None  # 49 KiB: under the bound
    c.send(frame(CONTINUATION, 0, 1, b"\x00" * 16384))
    assert c.goaway() == ENHANCE_YOUR_CALM  # past 64 KiB: closed (before, it held 150 MB sent this way)
    c = served.raw()  # many empty CONTINUATIONs: the count is bounded too
    c.send(frame(HEADERS, 0, 1, request_block(UNARY)) + frame(CONTINUATION, 0, 1) * 40)
    assert c.goaway() == ENHANCE_YOUR_CALM
    # an HPACK bomb: one 4,000-byte field put in the dynamic table, then 40 one-byte references to it
    # (160 KB of headers from a 4 KB block), over the 64 KiB header list bound
    name, value = b"x-bomb", b"v" * 4000
    bomb = b"\x40" + bytes([len(name)]) + name + b"\x7f" + _int(len(value) - 127) + value + b"\xbe" * 40
    c = served.raw()
    c.send(frame(HEADERS, END_HEADERS, 1, request_block(UNARY) + bomb))
    assert c.goaway() == ENHANCE_YOUR_CALM


def _int(n: int) -> bytes:
    out = []
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes([*out, n])


# --- 2. flow control: windows opened for what was consumed -------------------------------------


def test_windows_open_only_for_consumed_bytes_and_stale_partials_are_dropped(served):
    c = served.raw()
    chunk = b"z" * 16000
    # 20 calls, each promising a 1,000,000-byte message and sending 800,000 of it: 16 MB held, no more
    for i in range(20):
        sid = 2 * i + 1
        c.send(c.headers(sid, BIDI) + frame(DATA, 0, sid, grpc_message(b"", 1_000_000)))
        for _ in range(50):
            c.send(frame(DATA, 0, sid, chunk))
    c.frames_until(lambda fs: False, 0.5)
    assert window_updates(c.got, 0) == [(16 << 20) - 65535]  # only the one with our SETTINGS
    held = served.on_loop(lambda: [conn.held for conn in served.server.connections])
    assert max(held) == 20 * 800_005
    # the peer may not send past the window it has
    c.send(frame(DATA, 0, 1, b"z" * 900_000))
    assert c.goaway() == FLOW_CONTROL_ERROR

    c = served.raw()
    c.send(c.headers(1, BIDI) + frame(DATA, 0, 1, grpc_message(b"", 1_000_000) + b"z" * 1000))
    assert c.status(1, timeout=4) == (RESOURCE_EXHAUSTED, "a request message got no bytes for 1 s (1005 of it came)")
    assert served.on_loop(lambda: sum(conn.held for conn in served.server.connections)) == 0
    for sid in range(3, 23, 2):  # 9 MB more, held: the window opens again once they are dropped
        c.send(c.headers(sid, BIDI) + frame(DATA, 0, sid, grpc_message(b"", 1_000_000) + b"z" * 900_000))
    assert c.status(21, timeout=4)[0] == RESOURCE_EXHAUSTED
    c.frames_until(lambda fs: len(window_updates(fs, 0)) == 2, 2)
    assert window_updates(c.got, 0)[1] >= 8 << 20


def test_a_message_larger_than_every_window_still_arrives():
    s = Served(LIMITS, max_message=40 << 20)
    try:
        async def big():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}", options=[
                    ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]) as ch:
                body = bytes(range(256)) * (96 << 10)  # 24 MiB: over the 16 MiB windows
                reply = await ch.unary_unary(UNARY)(body)
                return len(reply) == len(body) and reply == body
        assert asyncio.run(big())
    finally:
        s.stop()


# --- 3. replies to a peer that does not read ---------------------------------------------------


def test_replies_to_a_peer_that_gives_no_window_are_bounded(served):
    c = served.raw(settings=settings((0x4, 0)))  # initial stream window 0: no reply can go out
    served.h.sessions.clear()
    c.send(c.headers(1, DIRECT_BIDI) + frame(DATA, 0, 1, grpc_message(b"r" * 500_000)) * 2)
    time.sleep(0.2)  # 1 MB of replies wait: over a quarter of the connection's bound, new calls are refused
    c.send(c.headers(3, DIRECT_BIDI))
    assert c.rst(3) == REFUSED_STREAM
    c.send(frame(DATA, 0, 1, grpc_message(b"r" * 500_000)))  # past the call's bound: reset, the session told
    assert c.rst(1) == ENHANCE_YOUR_CALM  # (grpc clients see RESOURCE_EXHAUSTED)
    assert served.on_loop(lambda: max(conn.queued_out for conn in served.server.connections)) == 0
    assert served.h.sessions[-1] == "gone"
    c.close()


def test_a_peer_that_never_reads_is_closed_after_the_stall_deadline(served):
    c = served.raw()
    peer = "ipv4:127.0.0.1:%d" % c.sock.getsockname()[1]
    open_ = lambda: any(conn.peer == peer for conn in served.server.connections)  # noqa: E731  (this one, not
    t = time.monotonic() + 5                                                      # another test's lingering)
    while not served.on_loop(open_) and time.monotonic() < t:
        time.sleep(0.01)
    assert served.on_loop(open_)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 30)))
    t0 = time.monotonic()
    for i in range(60):  # 60 x 900 KB of replies asked for, none read
        if not c.send(c.headers(2 * i + 1, UNARY) + frame(DATA, END_STREAM, 2 * i + 1, grpc_message(b"big:900000"))):
            break
    deadline = time.monotonic() + 5
    while served.on_loop(open_) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not served.on_loop(open_), "the connection that reads nothing was not closed"
    assert 1.0 <= time.monotonic() - t0 < 4.5


class Holding(Session):
    """A Direct session that logs being told to hold its work and to resume it."""

    def hold(self) -> None:
        self.log.append("hold")

    def resume(self) -> None:
        self.log.append("resume")


def test_the_work_of_a_peer_whose_replies_wait_is_held_until_it_reads(served):
    log: list = []
    served.on_loop(lambda: served.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Holding", {"Bidi": Direct(lambda call: Holding(call, log), *ident, True, True)}),)))
    c = served.raw(settings=settings((0x4, 0)))  # stream window 0: no reply can go
    c.send(c.headers(1, "/t.Holding/Bidi") + frame(DATA, 0, 1, grpc_message(b"now")))
    t = time.monotonic() + 5
    while "hold" not in log and time.monotonic() < t:  # Limits.hold_s 0: as soon as a reply cannot go
        time.sleep(0.01)
    assert log == ["open", b"now", "hold"]
    c.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 1000)))  # the peer reads: its work resumes
    got = c.frames_until(lambda fs: any(f[0] == DATA and f[2] == 1 for f in fs), 5)
    assert [p for t_, _, s, p in got if t_ == DATA and s == 1] == [grpc_message(b"now!")]
    assert log == ["open", b"now", "hold", "resume"]
    c.close()


# --- 4. control-frame floods -------------------------------------------------------------------


@pytest.mark.parametrize("flood", [frame(PING, 0, 0, b"12345678"), frame(SETTINGS, 0, 0),
                                   frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10"), frame(0x20, 0, 0, b"x")],
                         ids=["PING", "SETTINGS", "PRIORITY", "unknown"])
def test_control_frame_floods_get_enhance_your_calm(served, flood):
    c = served.raw()
    c.send(flood * 400)
    assert c.goaway() == ENHANCE_YOUR_CALM
    acks = sum(1 for t, f, _, _ in c.got if t in (PING, SETTINGS) and f & ACK)
    assert acks <= 101 + 1  # the burst (100), our SETTINGS' ack aside


def test_keepalive_pings_are_welcome(served):
    c = served.raw()
    for _ in range(20):
        c.ping()
    c.call(1, UNARY, b"still")
    assert c.status(1) == (0, "")
    assert sum(1 for t, f, _, _ in c.got if t == PING and f & ACK) == 20


# --- 5. per-frame work independent of the calls open ------------------------------------------


def test_settings_and_window_updates_do_not_walk_the_calls(served):
    c = served.raw()
    for i in range(500):  # 500 Direct calls open, each waiting for its first message
        c.send(c.headers(2 * i + 1, DIRECT_BIDI))
    c.frames_until(lambda fs: False, 0.3)
    conn = served.on_loop(lambda: max(served.server.connections, key=lambda k: len(k.calls)))
    assert served.on_loop(lambda: len(conn.calls)) == 500
    flushes = []
    served.on_loop(lambda: setattr(conn, "flush", lambda call, f=conn.flush: (flushes.append(call), f(call))))
    entries = settings(*[(0x4, 65535 + i) for i in range(60)])  # one frame, 60 initial window changes
    c.send(frame(SETTINGS, 0, 0, entries) * 40 + frame(SETTINGS, 0, 0) * 40
           + frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1000)) * 200)
    c.call(1001, UNARY, b"after")
    assert c.status(1001) == (0, "")
    assert served.on_loop(lambda: conn.peer_initial) == 65535 + 59  # the last entry of the last frame
    assert len(flushes) <= 1  # the unary reply only: no frame walked the 500 calls
    c.close()


# --- 6. rapid reset ----------------------------------------------------------------------------


def test_rapid_reset_gets_enhance_your_calm_and_the_work_is_dropped(served):
    served.on_loop(served.h.cancelled.clear)
    served.on_loop(served.h.started.clear)
    c = served.raw()
    burst = b""
    for i in range(300):
        sid = 2 * i + 1
        burst += (c.headers(sid, UNARY) + frame(DATA, END_STREAM, sid, grpc_message(b"hang"))
                  + frame(RST_STREAM, 0, sid, struct.pack(">L", 8)))
    c.send(burst)
    assert c.goaway() == ENHANCE_YOUR_CALM
    time.sleep(0.2)
    assert served.on_loop(lambda: sum(len(k.calls) for k in served.server.connections)) == 0
    # the handlers were cancelled (those that had started: most never ran)
    assert served.on_loop(served.h.cancelled.is_set) or not served.on_loop(served.h.started.is_set)
    assert served.on_loop(lambda: sum(1 for t in asyncio.all_tasks() if "_serve" in repr(t))) == 0


# --- 7. preface, idle, cap ---------------------------------------------------------------------


def test_preface_and_idle_timeouts_and_the_connection_cap(served):
    silent = served.raw(preface=False)
    idle = served.raw()
    t0 = time.monotonic()
    assert idle.goaway(timeout=4) == NO_ERROR  # no call for 1 s: a graceful GOAWAY
    silent.frames_until(lambda fs: False, max(0.1, 3 - (time.monotonic() - t0)))
    assert silent.closed  # no preface within 0.5 s: closed
    n = served.on_loop(lambda: len(served.server.connections))
    socks = [served.raw() for _ in range(LIMITS.max_connections - n)]
    over = served.raw()
    over.frames_until(lambda fs: False, 1)
    assert over.closed and not over.got  # closed at once, no SETTINGS
    socks[0].call(1, UNARY, b"under the cap")
    assert socks[0].status(1) == (0, "")
    for s in socks:
        s.close()


# --- 8. conformance: malformed frames ----------------------------------------------------------

H = lambda sid, path=UNARY, extra=(), flags=END_HEADERS: frame(HEADERS, flags, sid, request_block(path, extra))  # noqa
CALL = lambda sid, msg=b"x", path=UNARY: H(sid, path) + frame(DATA, END_STREAM, sid, grpc_message(msg))  # noqa
WU = lambda sid, inc: frame(WINDOW_UPDATE, 0, sid, struct.pack(">L", inc))  # noqa

MALFORMED = [  # (name, bytes after the preface and SETTINGS, expected outcome on stream 1 or the connection)
    ("DATA on stream 0", frame(DATA, 0, 0, b"x"), ("goaway", PROTOCOL_ERROR)),
    ("DATA on a stream never opened", frame(DATA, 0, 5, b"x"), ("goaway", PROTOCOL_ERROR)),
    ("DATA padded past its end", H(1) + frame(DATA, PADDED, 1, b"\x05abc"), ("goaway", PROTOCOL_ERROR)),
    ("DATA after END_STREAM", CALL(1, b"hang") + frame(DATA, 0, 1, b"x"), ("rst", STREAM_CLOSED)),
    ("HEADERS on stream 0", H(0), ("goaway", PROTOCOL_ERROR)),
    ("HEADERS on an even stream", H(2), ("goaway", PROTOCOL_ERROR)),
    ("HEADERS padded past its end", frame(HEADERS, END_HEADERS | PADDED, 1, b"\xff" + request_block(UNARY)),
     ("goaway", PROTOCOL_ERROR)),
    ("HEADERS below the last stream opened", CALL(5) + H(3), ("goaway", PROTOCOL_ERROR)),
    ("HEADERS that do not decode", frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff"), ("goaway", COMPRESSION_ERROR)),
    ("HEADERS then a frame of another type", H(1, flags=0) + frame(PING, 0, 0, b"12345678"), ("goaway", PROTOCOL_ERROR)),
    ("CONTINUATION that continues nothing", frame(CONTINUATION, END_HEADERS, 1, b""), ("goaway", PROTOCOL_ERROR)),
    ("an upper-case header name", H(1, extra=((b"X-Upper", b"1"),)), ("rst", PROTOCOL_ERROR)),
    ("connection: keep-alive", H(1, extra=((b"connection", b"keep-alive"),)), ("rst", PROTOCOL_ERROR)),
    ("transfer-encoding", H(1, extra=((b"transfer-encoding", b"chunked"),)), ("rst", PROTOCOL_ERROR)),
    ("upgrade", H(1, extra=((b"upgrade", b"h2c"),)), ("rst", PROTOCOL_ERROR)),
    ("te: gzip", H(1, extra=((b"te", b"gzip"),)), ("rst", PROTOCOL_ERROR)),
    ("no :path", frame(HEADERS, END_HEADERS, 1, request_block("", pseudo=((b":method", b"POST"),
                                                                          (b":scheme", b"http")))), ("rst", PROTOCOL_ERROR)),
    ("a pseudo-header after a regular one", frame(HEADERS, END_HEADERS, 1, request_block(UNARY)
                                                  + _literal(b":status", b"200")), ("rst", PROTOCOL_ERROR)),
    ("PRIORITY on stream 0", frame(PRIORITY, 0, 0, b"\x00" * 5), ("goaway", PROTOCOL_ERROR)),
    ("PRIORITY of 4 bytes", frame(PRIORITY, 0, 1, b"\x00" * 4), ("rst", FRAME_SIZE_ERROR)),
    ("RST_STREAM on stream 0", frame(RST_STREAM, 0, 0, b"\x00" * 4), ("goaway", PROTOCOL_ERROR)),
    ("RST_STREAM of 3 bytes", H(1) + frame(RST_STREAM, 0, 1, b"\x00" * 3), ("goaway", FRAME_SIZE_ERROR)),
    ("RST_STREAM on a stream never opened", frame(RST_STREAM, 0, 9, b"\x00" * 4), ("goaway", PROTOCOL_ERROR)),
    ("SETTINGS on a stream", frame(SETTINGS, 0, 1, b""), ("goaway", PROTOCOL_ERROR)),
    ("SETTINGS not in 6-byte entries", frame(SETTINGS, 0, 0, b"\x00" * 5), ("goaway", FRAME_SIZE_ERROR)),
    ("SETTINGS ACK with a payload", frame(SETTINGS, ACK, 0, settings((0x4, 1))), ("goaway", FRAME_SIZE_ERROR)),
    ("SETTINGS_ENABLE_PUSH 2", frame(SETTINGS, 0, 0, settings((0x2, 2))), ("goaway", PROTOCOL_ERROR)),
    ("SETTINGS_INITIAL_WINDOW_SIZE 2^31", frame(SETTINGS, 0, 0, settings((0x4, 1 << 31))), ("goaway", FLOW_CONTROL_ERROR)),
    ("SETTINGS_MAX_FRAME_SIZE 100", frame(SETTINGS, 0, 0, settings((0x5, 100))), ("goaway", PROTOCOL_ERROR)),
    ("SETTINGS with 100 entries", frame(SETTINGS, 0, 0, settings(*[(0x4, 65535)] * 100)), ("goaway", ENHANCE_YOUR_CALM)),
    ("PUSH_PROMISE from a client", frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02"), ("goaway", PROTOCOL_ERROR)),
    ("PING of 7 bytes", frame(PING, 0, 0, b"1234567"), ("goaway", FRAME_SIZE_ERROR)),
    ("PING on a stream", frame(PING, 0, 1, b"12345678"), ("goaway", PROTOCOL_ERROR)),
    ("GOAWAY on a stream", frame(GOAWAY, 0, 1, b"\x00" * 8), ("goaway", PROTOCOL_ERROR)),
    ("WINDOW_UPDATE of 3 bytes", frame(WINDOW_UPDATE, 0, 0, b"\x00" * 3), ("goaway", FRAME_SIZE_ERROR)),
    ("WINDOW_UPDATE of 0 on the connection", WU(0, 0), ("goaway", PROTOCOL_ERROR)),
    ("WINDOW_UPDATE of 0 on a stream", H(1) + WU(1, 0), ("rst", PROTOCOL_ERROR)),
    ("the connection's window past 2^31 - 1", WU(0, 0x7FFFFFFF), ("goaway", FLOW_CONTROL_ERROR)),
    ("a stream's window past 2^31 - 1", H(1) + WU(1, 0x7FFFFFFF), ("rst", FLOW_CONTROL_ERROR)),
    ("WINDOW_UPDATE on a stream never opened", WU(7, 1), ("goaway", PROTOCOL_ERROR)),
    ("a frame over SETTINGS_MAX_FRAME_SIZE", b"\x10\x00\x01\x00\x00\x00\x00\x00\x01", ("goaway", FRAME_SIZE_ERROR)),
    # gRPC: the request is not one (the docs promise INVALID_ARGUMENT; grpcio's server gives INTERNAL or UNKNOWN)
    ("a truncated message", H(1) + frame(DATA, END_STREAM, 1, grpc_message(b"abc", 10)), ("status", INVALID_ARGUMENT)),
    ("a unary call with no message", H(1, flags=END_HEADERS | END_STREAM), ("status", INVALID_ARGUMENT)),
    ("a malformed grpc-timeout", H(1, extra=((b"grpc-timeout", b"abc"),)), ("status", INVALID_ARGUMENT)),
    ("grpc-timeout of 9 digits", H(1, extra=((b"grpc-timeout", b"123456789S"),)), ("status", INVALID_ARGUMENT)),
    ("garbage to health Check", CALL(1, b"\xff\xff\xff\xff", CHECK), ("status", INVALID_ARGUMENT)),
    ("a compressed message", H(1) + frame(DATA, END_STREAM, 1, b"\x01" + grpc_message(b"x")[1:]), ("status", 12)),
    ("a message over the limit", H(1) + frame(DATA, 0, 1, grpc_message(b"", 2 << 20)), ("status", RESOURCE_EXHAUSTED)),
]


def test_malformed_frames_get_the_errors_rfc_9113_and_grpc_require(served):
    wrong = []
    for name, data, expected in MALFORMED:  # (DATA past the windows: in the flow-control test above)
        c = served.raw()
        c.send(data)
        got = c.outcome(1, timeout=2)
        if got != expected:
            wrong.append(f"{name}: {got} (expected {expected})")
        c.close()
    assert not wrong, "\n".join(wrong)
    assert len(MALFORMED) >= 20


# --- against a real Tulip ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tulip(tmp_path_factory):
    port, metrics = free_port(), free_port()
    # steps of 1,024 tokens: a test's work is many short steps, so what is dropped shows in the count
    proc = Proc(["-m", "tulip", "--model", "default", "--port", str(port), "--device", "cpu", "--max-batch-tokens",
                 "1024", "--max-queued-tokens", "1000000", "--drain-seconds", "10", "--metrics-port", str(metrics)],
                tmp_path_factory.mktemp("tulip"))
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    yield port, proc, metrics
    proc.stop(check=False)


def embed_request(n: int = 16, seqs: int = 1) -> bytes:
    ids = struct.pack(f"<{n}I", *range(100, 100 + n)) * seqs
    return tulip_pb2.EmbedRequest(request_id="r", token_ids=ids, lengths=[n] * seqs).SerializeToString()


def tulip_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in r.read().decode().splitlines())
                if k and not k.startswith("#")}


def test_a_real_tulip_refuses_rapid_reset_and_garbage_and_another_caller_is_served(tulip):
    port, _, _ = tulip
    c = RawH2("127.0.0.1", port)
    c.call(1, "/trellis.tulip.v1.Tulip/Info", b"\xff\xff\xff")
    assert c.status(1)[0] == INVALID_ARGUMENT
    c.send(c.headers(3, "/trellis.tulip.v1.Tulip/Embed", extra=((b"grpc-timeout", b"5Q"),)))
    assert c.status(3)[0] == INVALID_ARGUMENT
    burst = b"".join(c.headers(sid, "/trellis.tulip.v1.Tulip/Embed") + frame(DATA, END_STREAM, sid,
                                                                          grpc_message(embed_request()))
                     + frame(RST_STREAM, 0, sid, struct.pack(">L", 8)) for sid in range(5, 5 + 2 * 3000, 2))
    probe = grpc.insecure_channel(f"127.0.0.1:{port}")
    info = probe.unary_unary("/trellis.tulip.v1.Tulip/Info", request_serializer=None, response_deserializer=None)
    info(b"", timeout=10)
    c.send(burst)
    assert c.goaway() == ENHANCE_YOUR_CALM
    t0 = time.perf_counter()
    info(b"", timeout=10)
    assert time.perf_counter() - t0 < 1.0
    probe.close()


def test_a_real_tulip_computes_next_to_nothing_for_a_peer_that_takes_no_reply(tulip):
    """Fault 3, the work: 800 Embed calls of 1,024 tokens (replies of ~200 KB) from a peer whose
    stream window is 0 and whose socket is never read. Once its first reply cannot go, the rest of
    its queued work is held (`Limits.hold_s`): another caller is answered at once while that peer's
    connection is still open, and the engine computes nothing more for it; `reply_stall_s` (5 s)
    later it is closed and its calls cancelled, the held work dropped. Before holding, every call
    queued for it was computed until the close: 8,192-10,240 tokens in the 5 s, the other caller
    waiting for the close; before `reply_stall_s`, 20 s (the attack bench: another caller stalled 41 s)."""
    port, _, metrics = tulip
    calls, tokens = 800, 1024
    probe = grpc.insecure_channel(f"127.0.0.1:{port}")
    embed = probe.unary_unary("/trellis.tulip.v1.Tulip/Embed", request_serializer=None, response_deserializer=None)
    embed(embed_request(), timeout=10)
    m0 = tulip_metrics(metrics)
    c = RawH2("127.0.0.1", port, settings=settings((0x4, 0)))
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    req = grpc_message(embed_request(8, tokens // 8))
    c.send(b"".join(c.headers(sid, "/trellis.tulip.v1.Tulip/Embed") + frame(DATA, END_STREAM, sid, req)
                    for sid in range(1, 2 * calls, 2)))
    c.frames_until(lambda fs: any(f[0] == HEADERS for f in fs), 10)  # a reply's headers: its DATA waits
    t1 = time.monotonic()
    embed(embed_request(), timeout=10)  # behind ~790 queued calls, were they not held
    probe_s = time.monotonic() - t1
    computed_open = tulip_metrics(metrics)["tulip_batch_tokens_sum"] - m0["tulip_batch_tokens_sum"]
    c.frames_until(lambda fs: False, Limits().reply_stall_s + 2.5)  # until the server closes it (or not)
    waited = time.monotonic() - t1
    assert c.closed, f"the connection that takes no reply is still open {waited:.1f} s after its first reply"
    assert waited < Limits().reply_stall_s + 2.5  # (the deadline is looked at once a second)
    m1 = tulip_metrics(metrics)
    computed = m1["tulip_batch_tokens_sum"] - m0["tulip_batch_tokens_sum"]
    cancelled = m1['tulip_requests_total{status="CANCELLED"}'] - m0.get('tulip_requests_total{status="CANCELLED"}', 0)
    assert m1["tulip_queue_tokens"] == 0  # what was queued for it is gone
    assert cancelled >= calls // 2, cancelled
    # the steps formed before its first reply could not go (here one: the first call came alone), and
    # the probe's 16 tokens; nothing between the hold and the close
    assert computed <= 2 * tokens + 16, f"{computed:.0f} of {calls * tokens} tokens computed"
    assert computed == computed_open
    assert probe_s < 1.5, f"another caller waited {probe_s:.2f} s while that peer's connection was open"
    probe.close()


def test_sigterm_does_not_wait_for_a_health_watch(tulip):
    port, proc, _ = tulip
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    t0 = time.monotonic()
    proc.p.send_signal(15)
    assert proc.p.wait(8) == 0
    assert time.monotonic() - t0 < 3.0  # its grace (--drain-seconds) is 10 s
    seen = [r.status for r in _drain(watch)]
    assert seen[:1] in ([health_pb2.HealthCheckResponse.NOT_SERVING], [])
    ch.close()


def _drain(watch):
    try:
        yield from watch
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
