"""Spinner: the loop is kept polling after a kick, for a bounded time, while it is wanted."""

import asyncio
import time

from trellis.spin import Spinner


def test_spinner_keeps_the_loop_polling_then_stops():
    async def main():
        ticks = 0

        def wanted():
            nonlocal ticks
            ticks += 1
            return True

        s = Spinner(0.02, wanted)
        s.kick()
        assert s.spinning
        t0 = time.monotonic()
        while s.spinning:
            await asyncio.sleep(0.001)
        elapsed = time.monotonic() - t0
        assert 0.015 <= elapsed < 0.5 and ticks > 5  # polled on many iterations, stopped near its budget
        s.kick()  # kicks again after stopping
        assert s.spinning

    asyncio.run(main())


def test_spinner_stops_when_no_longer_wanted_and_zero_is_off():
    async def main():
        busy = [True]
        s = Spinner(10.0, lambda: busy[0])
        s.kick()
        await asyncio.sleep(0.005)
        assert s.spinning
        busy[0] = False
        await asyncio.sleep(0.005)
        assert not s.spinning  # long before its 10 s budget
        off = Spinner(0.0)
        off.kick()
        assert not off.spinning

    asyncio.run(main())
