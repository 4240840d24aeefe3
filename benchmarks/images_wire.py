"""Where a big image request's time goes on the wire (issue 51): one request of 256 uint8 pictures of 224 x 224
(38.5 MB of pixels) from `trellis.client` to a Tulip over a null image engine (its step copies the pixels into a
staging buffer, as the GPU engine's pinned staging does, and answers zeros: the request path is all there is).

    python -m benchmarks.images_wire [--n 12] [--images 256] [--side 224] [--rounds 3] [--root OLD_TREE ...]
    python -m benchmarks.images_wire --profile DIR     # cProfile of both processes (pstats + top functions)

The Tulip (tulip.h2server, EngineLoop, TulipServicer, as `python -m tulip` serves; uvloop) runs in a process of its
own with stage stamps on (tulip.stages) and a stamp of each socket read; the client (TulipClient.embed_images on
uvloop) in another. `perf_counter_ns` is one clock across a host's processes, so each request splits into:
`client_send` (the call until the client's last frame was written to its socket), `wire_first` (the call until
Tulip read the first byte), `server_read` (Tulip's first read to its last of the message), `assemble` (the last
read to the deserializer: the message put together), Tulip's stages (tulip.stages.POINTS after `receipt`),
`reply_wire` (Tulip's `write` stamp to the client's next socket read) and `client_recv` (that read until the caller
has the vectors); `total` is the caller's wall time, and each process's CPU
seconds per request. `--root DIR` (repeatable): other source trees (e.g. a `git worktree` of an older revision),
each served and called by its own code, in turns with this tree's (`rounds` turns of `n` requests each), so a
before / after shares the machine's moment. Prints one JSON line per tree (the p50 of each part) to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import write_profile

HERE = Path(__file__).resolve()
TREE = HERE.parents[1]
PARTS = ("client_send", "wire_first", "server_read", "assemble")


# --- the Tulip's process ------------------------------------------------------------------------------------------

def serve(args) -> None:
    """A Tulip over the null image engine; prints its port, then answers "stats" lines on stdin with the
    requests' stamps and socket reads since the last ones (one JSON line), until stdin closes."""
    import resource
    from time import perf_counter_ns

    import torch
    import uvloop

    import tulip.h2conn as h2conn
    from benchmarks.hop import NullEngine
    from rose.lazy import LazyTensor
    from tulip.config import TulipConfig
    from tulip.h2server import Server
    from tulip.loop import EngineLoop
    from tulip.server import TulipServicer, add_tulip

    tokens = (args.side // 16) ** 2 + 1

    class NullImageEngine(NullEngine):
        """NullEngine with an image tower of `side` pixels (16-pixel patches, as CLIP ViT-B/16): a step copies
        the pixels into a staging buffer (as the GPU engine's pinned staging copy) and answers zeros."""

        image_size, image_tokens, image_batch = args.side, tokens, args.images

        def __init__(self):
            super().__init__(0.0, 512)
            self.staging = torch.empty(args.images, args.side, args.side, 3, dtype=torch.uint8)
            self.rows = torch.zeros(args.images, self.embedding_dim)

        def step_images(self, pixels):
            self.staging[:len(pixels)].copy_(pixels)
            return LazyTensor(self.rows[:len(pixels)], None)

    reads: list[tuple[int, int]] = []  # Tulip's socket reads (a BufferedProtocol's, or data_received's before)
    hook = "buffer_updated" if hasattr(h2conn.Connection, "buffer_updated") else "data_received"
    received = getattr(h2conn.Connection, hook)

    def stamped(self, data, _received=received):
        reads.append((perf_counter_ns(), data if type(data) is int else len(data)))
        _received(self, data)

    setattr(h2conn.Connection, hook, stamped)

    async def main():
        budget = args.images * tokens
        loop = EngineLoop(NullImageEngine(), TulipConfig(max_batch_tokens=budget, max_queued_tokens=4 * budget,
                                                         stage_samples=4096, spin_ms=args.spin_ms))
        loop.start()
        server = Server(64 << 20)
        add_tulip(server, TulipServicer(loop, "null-images"))
        port = await server.listen("127.0.0.1", 0)
        prof = None
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
        print(json.dumps({"port": port}), flush=True)
        aloop = asyncio.get_running_loop()
        while True:
            line = await aloop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            if line.strip() == "profile" and prof is not None:
                prof.enable()
                continue
            ru = resource.getrusage(resource.RUSAGE_SELF)
            stamps = list(loop.stages.ring)
            loop.stages.ring.clear()
            got = list(reads)
            reads.clear()
            print(json.dumps({"stamps": stamps, "reads": got, "cpu": ru.ru_utime + ru.ru_stime}), flush=True)
        if prof is not None:
            prof.disable()
            write_profile(prof, Path(args.profile) / "tulip")

    uvloop.install()
    asyncio.run(main())


# --- the client's process -----------------------------------------------------------------------------------------

def client(args) -> None:
    """Starts its tree's Tulip, then for each "run N" line on stdin times N requests and prints their splits
    (one JSON line); a "profile" line turns cProfile on in both processes."""
    import resource
    from time import perf_counter_ns

    import uvloop

    import trellis.h2stream as h2stream
    from tulip.stages import POINTS, RECEIPT
    from trellis.client import TulipClient

    env = dict(os.environ, PYTHONPATH=str(Path.cwd()))
    srv = subprocess.Popen([sys.executable, "-P", str(HERE), "--serve", "--images", str(args.images), "--side",
                            str(args.side), "--spin-ms", str(args.spin_ms)] + (["--profile", args.profile] if args.profile else []),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    port = json.loads(srv.stdout.readline())["port"]
    pixels = np.random.default_rng(6).integers(0, 256, (args.images, args.side, args.side, 3), dtype=np.uint8)

    writes: list[int] = []  # when the client's connection handed bytes to its socket
    made = h2stream.StreamConnection.connection_made

    def connection_made(self, transport, _made=made):
        class Timed:  # the transport, its writes stamped
            def __getattr__(_, name):
                return getattr(transport, name)

            def write(_, data):
                writes.append(perf_counter_ns())
                transport.write(data)

            def writelines(_, seq):
                writes.append(perf_counter_ns())
                transport.writelines(seq)

        _made(self, Timed())

    h2stream.StreamConnection.connection_made = connection_made
    got_at: list[int] = []  # when the client's connection read bytes
    received = h2stream.StreamConnection.data_received

    def data_received(self, data, _received=received):
        got_at.append(perf_counter_ns())
        _received(self, data)

    h2stream.StreamConnection.data_received = data_received

    def server_stats() -> dict:
        srv.stdin.write("stats\n")
        srv.stdin.flush()
        return json.loads(srv.stdout.readline())

    async def main():
        prof = None
        async with TulipClient(f"127.0.0.1:{port}") as c:
            for _ in range(3):  # warm: the stream open, the loop's first image step
                await c.embed_images(pixels)
            server_stats()
            for line in sys.stdin:
                cmd = line.split()
                if cmd[0] == "profile":
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                    srv.stdin.write("profile\n")
                    srv.stdin.flush()
                    continue
                rows = []
                for _ in range(int(cmd[1])):
                    await asyncio.sleep(0.05)  # both processes idle between requests, as a paced caller's
                    writes.clear()
                    got_at.clear()
                    before = server_stats()["cpu"]
                    ru0 = resource.getrusage(resource.RUSAGE_SELF)
                    t0 = perf_counter_ns()
                    vec = await c.embed_images(pixels)
                    t1 = perf_counter_ns()
                    ru1 = resource.getrusage(resource.RUSAGE_SELF)
                    assert vec.shape == (args.images, 512)
                    s = server_stats()
                    (stamps,) = s["stamps"]
                    reads = [t for t, _ in s["reads"]]
                    row = {"total": t1 - t0, "client_send": writes[-1] - t0, "wire_first": reads[0] - t0,
                           "server_read": reads[-1] - reads[0], "assemble": stamps[RECEIPT] - reads[-1]}
                    for i in range(RECEIPT + 1, len(POINTS)):
                        row[POINTS[i]] = stamps[i] - stamps[i - 1]
                    first = min((t for t in got_at if t > stamps[-1]), default=t1)
                    row["reply_wire"] = first - stamps[-1]  # Tulip's write stamp to the client's first read after it
                    row["client_recv"] = t1 - first  # ... to the caller holding the vectors
                    row = {k: v / 1e6 for k, v in row.items()}  # ms
                    row["client_cpu"] = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) * 1e3
                    row["tulip_cpu"] = (s["cpu"] - before) * 1e3
                    row["reads"] = len(reads)
                    rows.append(row)
                print(json.dumps(rows), flush=True)
        if prof is not None:
            prof.disable()
            write_profile(prof, Path(args.profile) / "client")

    uvloop.install()
    try:
        asyncio.run(main())
    finally:
        srv.stdin.close()
        srv.wait(30)


# --- the runner ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=12, help="requests a turn")
    ap.add_argument("--rounds", type=int, default=3, help="turns per tree")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--spin-ms", type=float, default=10.0, help="Tulip's --spin-ms (its default: 10)")
    ap.add_argument("--root", action="append", default=[], type=Path, help="another source tree, in turns")
    ap.add_argument("--profile", default="", help="write cProfile of both processes here (this tree only)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args) or 0
    if args.client:
        return client(args) or 0
    trees = [TREE] + [r.resolve() for r in args.root]
    procs = []
    for tree in trees:
        extra = ["--profile", str(Path(args.profile).resolve())] if args.profile and tree == TREE else []
        procs.append(subprocess.Popen([sys.executable, "-P", str(HERE), "--client", "--images", str(args.images),
                                       "--side", str(args.side), "--spin-ms", str(args.spin_ms)] + extra, cwd=tree, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(tree))))
    rows: dict[Path, list] = {t: [] for t in trees}
    try:
        for r in range(args.rounds):
            for tree, p in zip(trees, procs):
                if args.profile and r == 0 and tree == TREE:
                    p.stdin.write("profile\n")
                p.stdin.write(f"run {args.n}\n")
                p.stdin.flush()
                rows[tree] += json.loads(p.stdout.readline())
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(60)
    for tree in trees:
        got = rows[tree]
        p50 = {k: round(float(np.median([x[k] for x in got])), 2) for k in got[0]}
        print(json.dumps({"tree": str(tree), "requests": len(got), "mb": round(args.images * args.side ** 2 * 3 / 1e6, 1),
                          "p50_ms": p50, "date": time.strftime("%Y-%m-%d")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
