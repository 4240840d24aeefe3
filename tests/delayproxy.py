"""A TCP proxy that can add latency: `python tests/delayproxy.py LISTEN_IP:PORT TARGET_IP:PORT`.

The kernel here has no `tc netem`, so tests/test_multihost.py adds its 50 ms this way: the proxy runs in
a host's network namespace in front of that host's Tulip, the name resolves to the proxy's address, and
SIGUSR1 sets the delay to DELAY_MS (SIGUSR2 back to 0). Every byte the client sends is held that long
before it is forwarded, in order (what netem's delay does to packets on one direction of a link);
replies are copied at once. Prints PROXY_READY once listening.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

DELAY_MS = 50.0
delay_s = 0.0


async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Client to Tulip: each chunk forwarded `delay_s` (as it was when the chunk arrived) after it came."""
    queue: asyncio.Queue = asyncio.Queue()

    async def forward():
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.write_eof()

    task = asyncio.ensure_future(forward())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s, data))
    finally:
        queue.put_nowait(None)
        await task


async def copied(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.write_eof()


async def main(listen: str, target: str) -> None:
    loop = asyncio.get_running_loop()

    def set_delay(ms: float) -> None:
        global delay_s
        delay_s = ms / 1e3
        print(f"delay {ms:g} ms", flush=True)

    loop.add_signal_handler(signal.SIGUSR1, set_delay, DELAY_MS)
    loop.add_signal_handler(signal.SIGUSR2, set_delay, 0.0)
    t_host, t_port = target.rsplit(":", 1)

    async def handle(c_reader, c_writer):
        try:
            t_reader, t_writer = await asyncio.open_connection(t_host, int(t_port))
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(held(c_reader, t_writer), copied(t_reader, c_writer))
        except (OSError, ConnectionError):
            pass
        finally:
            for w in (c_writer, t_writer):
                w.close()

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    print("PROXY_READY", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
