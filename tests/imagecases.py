"""What tests/test_images_ivy.py builds its cases from: images in every mode and format, data URIs, a bomb's
header, mutated files for the fuzz, a recording stand-in for Tulip's gRPC services, and an image host."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import random
import struct
import threading
import zlib

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from PIL import Image

from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc

DIM = 4


# --- images ----------------------------------------------------------------------------------------

def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    # smooth-ish content (a gradient under the noise) so resampling filters matter
    grad = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 4), np.float32)
    img = Image.fromarray(((np.asarray(img, np.float32) * 0.3 + grad * 0.7)).astype(np.uint8), "RGBA")
    return img if mode == "RGBA" else img.convert(mode)


def varied_images() -> list[tuple[str, bytes]]:
    """(what, bytes): sizes and aspect ratios, every mode a photo or a graphic comes in, the four formats,
    the eight EXIF orientations."""
    out = []
    for i, (w, h) in enumerate([(1, 1), (7, 300), (300, 7), (33, 32), (640, 480), (31, 64), (48, 48)]):
        out.append((f"png RGB {w}x{h}", encode(noise(w, h, seed=i), "PNG")))
        out.append((f"jpeg RGB {w}x{h}", encode(noise(w, h, seed=i), "JPEG", quality=90)))
    base = noise(57, 41, "RGBA", seed=9)
    for mode in ("RGBA", "LA", "L", "1"):
        out.append((f"png {mode}", encode(base.convert(mode), "PNG")))
    p = base.convert("RGB").quantize(64)
    out.append(("png P with a transparent index", encode(p, "PNG", transparency=3)))
    out.append(("png P", encode(p, "PNG")))
    out.append(("png I;16", encode(Image.fromarray(np.random.default_rng(1).integers(0, 65535, (41, 57), dtype=np.uint16)),
                                   "PNG")))
    out.append(("jpeg CMYK", encode(base.convert("CMYK"), "JPEG")))
    out.append(("jpeg L", encode(base.convert("L"), "JPEG")))
    out.append(("webp RGB", encode(base.convert("RGB"), "WEBP", quality=80)))
    out.append(("webp RGBA lossless", encode(base, "WEBP", lossless=True)))
    frames = [base.convert("RGB").quantize(32), noise(57, 41, seed=3).convert("RGB").quantize(32)]
    out.append(("gif, two frames", encode(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=0)))
    for k in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = k
        out.append((f"jpeg EXIF orientation {k}", encode(noise(50, 30, seed=k), "JPEG", exif=exif)))
    return out


def data_uri(b: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(b).decode()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR says w x h (8-bit RGB) and whose pixels are one empty IDAT: a bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def mutations(seed_files: list[bytes], n: int, rng: random.Random):
    """n mutated copies: bit flips, truncations, spliced and duplicated ranges, overwritten header fields."""
    for _ in range(n):
        b = bytearray(rng.choice(seed_files))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(5)
            i = rng.randrange(len(b))
            if op == 0:
                b[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                del b[rng.randrange(8, len(b)):]
            elif op == 2:
                j = rng.randrange(len(b))
                b[i:i] = b[j: j + rng.randint(1, 64)]
            elif op == 3:
                b[i: i + 4] = rng.randbytes(4)
            else:
                b[8: 24] = bytes(rng.randrange(256) for _ in range(16))  # PNG's IHDR, JPEG's first segment, ...
        yield bytes(b)


def fuzz_seeds() -> list[bytes]:
    base = noise(40, 30, "RGBA", seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6
    return [encode(base, "PNG"), encode(base.convert("RGB"), "JPEG", exif=exif),
            encode(base.convert("RGB").quantize(16), "GIF"), encode(base, "WEBP"),
            encode(base.convert("RGB"), "JPEG", progressive=True), encode(base.convert("P"), "PNG", transparency=1)]


class Recorder(tulip_pb2_grpc.TulipServicer):
    """A Tulip's gRPC services without an engine: records every EmbedRequest; a text request's row i is
    [1, its length, its first token id, i], an image request's [2, the image's pixel mean, its first red value, i]."""

    def __init__(self, image_size: int):
        self.image_size, self.requests = image_size, []

    def reply(self, req: tulip_pb2.EmbedRequest) -> tulip_pb2.EmbedReply:
        self.requests.append(req)
        if req.images:
            s = self.image_size
            px = np.frombuffer(req.pixels, np.uint8).reshape(req.images, s, s, 3).astype(np.float32)
            rows = [[2.0, float(p.mean()), float(p[0, 0, 0]), i] for i, p in enumerate(px)]
        else:
            ids = np.frombuffer(req.token_ids, "<i4")
            starts = np.cumsum([0, *req.lengths])
            rows = [[1.0, float(n), float(ids[a]), i] for i, (n, a) in enumerate(zip(req.lengths, starts))]
        v = np.asarray(rows, np.float32)
        return tulip_pb2.EmbedReply(request_id=req.request_id, embeddings=v.tobytes(), shape=list(v.shape),
                                    prompt_tokens=int(sum(req.lengths)))

    async def Info(self, request, context):
        return tulip_pb2.InfoReply(model="recorder", vocab_size=500, embedding_dim=DIM, max_seq_len=64,
                                   encodings=[tulip_pb2.ENCODING_FLOAT32], normalized=False,
                                   image_size=self.image_size)

    async def Embed(self, request, context):
        return self.reply(request)

    async def EmbedStream(self, request_iterator, context):
        async for req in request_iterator:
            if not req.cancel:
                yield self.reply(req)


class Recorders:
    """Recorder servers on loopback, served by an event loop in a thread of the test process."""

    def __init__(self, sizes: dict[str, int]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers, self.recorders, self.targets = [], {}, {}
        for name, size in sizes.items():
            asyncio.run_coroutine_threadsafe(self._serve(name, size), self.loop).result(10)

    async def _serve(self, name: str, size: int):
        server = grpc.aio.server()
        rec = Recorder(size)
        tulip_pb2_grpc.add_TulipServicer_to_server(rec, server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        self.servers.append(server)
        self.recorders[name], self.targets[name] = rec, f"127.0.0.1:{port}"

    def close(self):
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class ImageHost(http.server.BaseHTTPRequestHandler):
    """Images over HTTP on loopback: /cat.png, /big.png (over --max-image-mb), /moved (a redirect)."""

    files: dict[str, bytes] = {}

    def do_GET(self):
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big.png":  # no length: Ivy must count the bytes as they come
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


CAT = encode(noise(64, 40, seed=11), "PNG")
