"""tulip.h2server, Tulip's own gRPC server, against grpcio's clients (the C core's HTTP/2): every
kind of call, Direct (callback) methods, the statuses, deadlines, cancellation, flow control on big
messages, limits, compression refused, health, a non-gRPC request, graceful stop."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tulip.h2server import Direct, Server

SERVICE = "test.Echo"
ident = (lambda b: b, lambda b: b)


class Handlers:
    """Raw-bytes methods: the reply is the request (or derived from it)."""

    def __init__(self):
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.metadata = None
        self.finished = []

    async def unary(self, request: bytes, context):
        self.metadata = dict(context.invocation_metadata())
        context.add_done_callback(lambda c: self.finished.append(c.code))
        if request == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "aborted: naïve % reason\nline two")
        if request == b"raise":
            raise RuntimeError("boom")
        if request.startswith(b"big:"):
            return bytes(range(256)) * (int(request[4:]) // 256)
        if request == b"hang":
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request == b"remaining":
            return repr(round(context.time_remaining() or -1)).encode()
        return request

    async def bidi(self, requests, context):
        async for r in requests:
            if r == b"stop":
                return
            yield r + b"!"

    async def server_stream(self, request: bytes, context):
        for i in range(int(request)):
            await context.write(str(i).encode())

    async def client_stream(self, requests, context):
        return b"".join([r async for r in requests])


class Session:
    """A Direct method's session: a streamed request answered later from a loop callback (as Tulip's
    engine loop answers), b"now" at once, b"raise" raises; each session's events are logged."""

    def __init__(self, call, log: list):
        self.call, self.log, self.pending = call, log, 0
        self.ended = False
        log.append("open")

    def message(self, request: bytes) -> None:
        self.log.append(request)
        if request == b"raise":
            raise RuntimeError("boom in a session")
        if request == b"hang":  # never answered
            self.pending += 1
            return
        if request == b"now":
            return self.call.reply(b"now!")
        self.pending += 1
        asyncio.get_running_loop().call_later(0.001, self.answer, request)

    def answer(self, request: bytes) -> None:
        self.pending -= 1
        self.call.reply(request + b"?")
        if self.ended and not self.pending:
            self.call.finish(grpc.StatusCode.OK)

    def end(self) -> None:
        self.log.append("end")
        self.ended = True
        if not self.pending:
            self.call.finish(grpc.StatusCode.OK)

    def gone(self) -> None:
        self.log.append("gone")


def add(server, h: Handlers) -> None:
    h.sessions = []
    direct = lambda call: Session(call, h.sessions)  # noqa: E731
    handlers = {
        "DirectUnary": Direct(direct, *ident, False, False),
        "DirectBidi": Direct(direct, *ident, True, True),
        "Unary": grpc.unary_unary_rpc_method_handler(h.unary, *ident),
        "Bidi": grpc.stream_stream_rpc_method_handler(h.bidi, *ident),
        "ServerStream": grpc.unary_stream_rpc_method_handler(h.server_stream, *ident),
        "ClientStream": grpc.stream_unary_rpc_method_handler(h.client_stream, *ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def run(test, max_message=1 << 20):
    async def main():
        server = Server(max_message=max_message)
        h = Handlers()
        add(server, h)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = await server.listen("127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        try:
            return await test(channel, h, server, hs, port)
        finally:
            await channel.close()
            await server.stop(0)

    return asyncio.run(main())


def method(channel, name, kind="unary_unary"):
    return getattr(channel, kind)(f"/{SERVICE}/{name}", request_serializer=None, response_deserializer=None)


def test_unary_echo_metadata_and_status_ok():
    async def t(ch, h, *_):
        call = method(ch, "Unary")(b"hello", metadata=(("traceparent", "00-ab-cd-01"),))
        assert await call == b"hello"
        assert await call.code() == grpc.StatusCode.OK
        assert h.metadata["traceparent"] == "00-ab-cd-01"
        await asyncio.sleep(0.05)
        assert h.finished == [grpc.StatusCode.OK]  # the done callback ran once the call was over
        assert await method(ch, "Unary")(b"") == b""  # an empty message
    run(t)


def test_abort_and_handler_errors_become_statuses():
    async def t(ch, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(b"abort")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == "aborted: naïve % reason\nline two"  # percent-encoded on the wire, intact here
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(b"raise")
        assert e.value.code() == grpc.StatusCode.UNKNOWN and "boom" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Nope")(b"x")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await method(ch, "Unary")(b"still fine") == b"still fine"  # the connection carried on
    run(t)


def test_streams_of_every_kind_and_many_at_once():
    async def t(ch, *_):
        bidi = method(ch, "Bidi", "stream_stream")()
        for i in range(50):
            await bidi.write(str(i).encode())
            assert await bidi.read() == f"{i}!".encode()
        await bidi.done_writing()
        assert await bidi.read() == grpc.aio.EOF
        assert await bidi.code() == grpc.StatusCode.OK
        got = [m async for m in method(ch, "ServerStream", "unary_stream")(b"5")]
        assert got == [b"0", b"1", b"2", b"3", b"4"]

        async def gen():
            for p in (b"a", b"bc", b"d"):
                yield p
        assert await method(ch, "ClientStream", "stream_unary")(gen()) == b"abcd"
        # the server ends a bidi call before the client closes its side
        early = method(ch, "Bidi", "stream_stream")()
        await early.write(b"stop")
        assert await early.read() == grpc.aio.EOF and await early.code() == grpc.StatusCode.OK
        # 200 calls in flight on one connection
        replies = await asyncio.gather(*(method(ch, "Unary")(str(i).encode()) for i in range(200)))
        assert replies == [str(i).encode() for i in range(200)]
    run(t)


def test_big_messages_cross_flow_control_both_ways():
    async def t(ch, *_):
        body = bytes(range(256)) * (12 << 12)  # 12 MiB: over every initial window and frame size
        assert await method(ch, "Unary")(body) == body
        big = await method(ch, "Unary")(b"big:%d" % (24 << 20))
        assert big == bytes(range(256)) * ((24 << 20) // 256)
        bidi = method(ch, "Bidi", "stream_stream")()
        for _ in range(3):
            await bidi.write(body)
            assert await bidi.read() == body + b"!"
        await bidi.done_writing()
    run(t, max_message=32 << 20)


def test_message_limit_and_compression_are_refused_clearly():
    async def t(ch, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(bytes(2 << 20))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(b"x" * 1000, compression=grpc.Compression.Gzip)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "identity" in e.value.details()
        assert await method(ch, "Unary")(b"ok") == b"ok"
    run(t)


def test_deadline_and_cancel_stop_the_handler():
    async def t(ch, h, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(b"hang", timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(h.cancelled.wait(), 5)  # abandoned work is dropped
        assert await method(ch, "Unary")(b"remaining", timeout=30) in (b"29", b"30")
        h.cancelled.clear()
        h.started.clear()
        call = method(ch, "Unary")(b"hang")
        await asyncio.wait_for(h.started.wait(), 5)
        call.cancel()
        await asyncio.wait_for(h.cancelled.wait(), 5)
    run(t)


def test_direct_methods_take_each_message_by_callback_and_hear_when_the_call_is_gone():
    async def t(ch, h, *_):
        assert await method(ch, "DirectUnary")(b"one") == b"one?"
        assert h.sessions == ["open", b"one", "end"]
        bidi = method(ch, "DirectBidi", "stream_stream")()
        for i in range(20):
            await bidi.write(str(i).encode())
            assert await bidi.read() == f"{i}?".encode()
        await bidi.write(b"now")
        assert await bidi.read() == b"now!"
        await bidi.write(b"x")
        await bidi.done_writing()  # the session ends the call once its last reply is out
        assert await bidi.read() == b"x?" and await bidi.read() == grpc.aio.EOF
        assert await bidi.code() == grpc.StatusCode.OK
        h.sessions.clear()
        with pytest.raises(grpc.aio.AioRpcError) as e:  # an exception in a session: UNKNOWN, and told it is gone
            await method(ch, "DirectUnary")(b"raise")
        assert e.value.code() == grpc.StatusCode.UNKNOWN and "boom in a session" in e.value.details()
        assert h.sessions == ["open", b"raise", "gone"]
        h.sessions.clear()
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a deadline: the session hears it once
            await method(ch, "DirectUnary")(b"hang", timeout=0.2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.05)
        assert h.sessions == ["open", b"hang", "end", "gone"]
        h.sessions.clear()
        bidi = method(ch, "DirectBidi", "stream_stream")()  # the client cancels: gone
        await bidi.write(b"hang")
        while b"hang" not in h.sessions:
            await asyncio.sleep(0.01)
        bidi.cancel()
        for _ in range(100):
            if "gone" in h.sessions:
                break
            await asyncio.sleep(0.01)
        assert h.sessions == ["open", b"hang", "gone"]
        assert await method(ch, "DirectUnary")(b"after") == b"after?"  # the connection carried on
    run(t)


def test_health_check_and_watch():
    async def t(ch, h, server, hs, port):
        stub = health_pb2_grpc.HealthStub(ch)
        await hs.set("svc", health_pb2.HealthCheckResponse.SERVING)
        r = await stub.Check(health_pb2.HealthCheckRequest(service="svc"))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="unknown"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await hs.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    run(t)


def test_http1_on_the_port_gets_a_400_that_says_why():
    async def t(ch, h, server, hs, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await asyncio.wait_for(r.read(), 5)
        assert data.startswith(b"HTTP/1.1 400") and b"gRPC" in data
        w.close()
        assert await method(ch, "Unary")(b"after") == b"after"
    run(t)


async def started():
    server = Server()
    h = Handlers()
    add(server, h)
    port = await server.listen("127.0.0.1", 0)
    return server, h, port, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_stop_lets_calls_in_flight_finish_and_refuses_new_ones():
    async def main():
        server, h, port, ch = await started()
        bidi = method(ch, "Bidi", "stream_stream")()
        await bidi.write(b"a")
        assert await bidi.read() == b"a!"
        stopping = asyncio.create_task(server.stop(5))
        await asyncio.sleep(0.2)
        await bidi.write(b"b")  # the open call goes on through the grace period
        assert await bidi.read() == b"b!"
        await bidi.done_writing()
        assert await bidi.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 5)  # it returns once the last call ended, not after the grace
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(ch, "Unary")(b"x", timeout=2)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        await ch.close()
        with socket.socket() as s:  # the port is free again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))

    asyncio.run(main())


def test_stop_cancels_what_outlives_the_grace():
    async def main():
        server, h, port, ch = await started()
        call = method(ch, "Unary")(b"hang")
        await asyncio.wait_for(h.started.wait(), 5)
        await server.stop(0.2)
        await asyncio.wait_for(h.cancelled.wait(), 5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        await ch.close()

    asyncio.run(main())
