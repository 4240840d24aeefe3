"""Image inputs for models with an image tower (CLIP, SigLIP): each input's bytes (a data URI, bare
base64, or an allowed http(s) URL: `ivy.imagefetch`) decoded with Pillow under the limits, then
preprocessed as the model's image processor (its preprocessor_config.json) preprocesses, up to the
uint8 pixels an EmbedRequest carries: EXIF orientation applied, RGB (transparency over white),
resized, centre-cropped; not rescaled or normalised (Tulip does that on the device).

Why by hand and not `transformers`' processor: the gateway installs neither transformers nor torch.
The steps are transformers' PIL backend's (`CLIPImageProcessorPil` / `SiglipImageProcessorPil`:
`convert_to_rgb`, `get_resize_output_image_size`, `resize` through PIL for uint8 input, numpy
`center_crop`), so the pixels are equal to its, byte for byte (tests/test_images_ivy.py). With
torchvision installed, transformers' default backend resizes with torchvision instead (not PIL):
not what this module reproduces.

Decoding runs in a thread pool (Pillow releases the GIL while it decodes, the resampler while it resizes), off
the event loop; a request has at most `WORKERS` images in the pool at once, so one request of many images does
not hold every other request's images behind all of its own. The resize (`resize_crop`) computes only what the
centre crop keeps, in C (`ivy.resample`; Pillow's own resize where that cannot be built or differs from this
Pillow): the same pixels as Pillow's whole resize, in less time.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import PIL
from PIL import Image, ImageOps

from ivy import resample as _resample
from ivy.errors import APIError

log = logging.getLogger("ivy.images")

# The formats Ivy opens: Image.open would otherwise try every plugin Pillow has (EPS hands the bytes to
# Ghostscript, others are rarely hardened); a file of another format is a 400.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
WORKERS = max(1, min(4, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="ivy-image")

# transformers' class defaults where a preprocessor_config.json leaves a field out, by image_processor_type
# without its Fast / Pil suffix (transformers 5: CLIPImageProcessorPil, SiglipImageProcessorPil)
_CLIP = {"do_resize": True, "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True,
         "crop_size": {"height": 224, "width": 224}, "do_convert_rgb": True}
_SIGLIP = {"do_resize": True, "size": {"height": 224, "width": 224}, "resample": 3, "do_center_crop": False,
           "do_convert_rgb": True}
PROCESSORS = {"CLIPImageProcessor": _CLIP, "CLIPFeatureExtractor": _CLIP, "SiglipImageProcessor": _SIGLIP}
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # PIL's numbers


def _size(v, what: str) -> tuple[int, int] | int:
    """A processor's size field: (height, width), or an int for a shortest edge."""
    if isinstance(v, int):
        return v  # transformers' get_size_dict(int, default_to_square=False): the shortest edge
    if isinstance(v, dict):
        if set(v) == {"shortest_edge"}:
            return int(v["shortest_edge"])
        if set(v) == {"height", "width"}:
            return int(v["height"]), int(v["width"])
    raise ValueError(f"{what} {v!r}: this gateway implements {{height, width}} and {{shortest_edge}}")


@dataclass(frozen=True)
class Preprocessor:
    """A model's image preprocessing up to the uint8 pixels (see the module docstring).

    resize:     (height, width) to resize to, or an int: the shortest edge to resize to (the aspect ratio
                kept, the long edge int(size * long / short)); None: no resize.
    resample:   PIL's filter number (3: bicubic).
    crop:       (height, width) of the centre crop (zero-padded where the image is smaller), None: none.
    side:       the side of the square pixels it makes (Info's image_size must be the same).
    tokens:     patch tokens per image (the tower's sequence): what the balancer budgets an image as.
    """

    resize: tuple[int, int] | int | None
    resample: int
    crop: tuple[int, int] | None
    side: int
    tokens: int

    @classmethod
    def read(cls, path: Path) -> "Preprocessor | None":
        """The preprocessing of the model directory `path` (its preprocessor_config.json, else processor_config.json's
        `image_processor`, at the top or in a sentence-transformers module's folder), None where it has none (a
        text model). A processor type or field this module does not implement is a ValueError saying which."""
        found = _find(path)
        if found is None:
            return None
        found, cfg = found
        kind = str(cfg.get("image_processor_type") or cfg.get("feature_extractor_type") or "")
        base = kind.removesuffix("Fast").removesuffix("Pil")
        if base not in PROCESSORS:
            raise ValueError(f"{found}: image_processor_type {kind!r} is not one this gateway implements "
                             f"({', '.join(sorted(PROCESSORS))})")
        cfg = {**PROCESSORS[base], **{k: v for k, v in cfg.items() if v is not None}}
        resize = _size(cfg["size"], f"{found}: size") if cfg["do_resize"] else None
        crop = None
        if cfg["do_center_crop"]:
            crop = _size(cfg["crop_size"], f"{found}: crop_size")
            crop = (crop, crop) if isinstance(crop, int) else crop  # get_size_dict(int): a square
        out = crop or resize
        if not isinstance(out, tuple) or out[0] != out[1] or out[0] < 1:
            raise ValueError(f"{found}: the pixels it makes are not a fixed square (size {cfg['size']}, crop "
                             f"{cfg.get('crop_size') if cfg['do_center_crop'] else None})")
        resample = int(cfg["resample"])
        if resample not in RESAMPLE:
            raise ValueError(f"{found}: resample {resample} is not one of PIL's filters {sorted(RESAMPLE)}")
        return cls(resize, resample, crop, out[0], _patch_tokens(path, out[0]))

    def __call__(self, img: Image.Image) -> np.ndarray:
        """An RGB image (`to_rgb`'s) -> uint8 [side, side, 3], as transformers' PIL backend makes it."""
        size = img.size
        if self.resize is not None:
            w, h = img.size
            if isinstance(self.resize, int):  # get_resize_output_image_size(default_to_square=False)
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = self.resize, int(self.resize * long / short)
                new_h, new_w = (new_long, new_short) if w <= h else (new_short, new_long)
            else:
                new_h, new_w = self.resize
            size = (new_w, new_h)
        return resize_crop(img, size, self.resample, self.crop)


# Pillow's resampling filters' reach in input pixels at scale 1 (`support` in its libImaging/Resample.c), by number
_SUPPORT = {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 1.0}
_PILLOW = tuple(int(x) for x in re.findall(r"\d+", PIL.__version__)[:2])  # (13, 0)


def _vertical_first(w: int, h: int, nw: int, nh: int) -> bool:
    """Whether Pillow resizes w x h to nw x nh columns first: from 13.0 when the height shrinks by more than twice
    what the width does (ImagingResampleInner's `horizontal_first`), before 13.0 never."""
    return _PILLOW >= (13, 0) and 0 < h - nh and h - nh > (w - nw) * 2


def _reach(n: int, new: int, start: int, count: int, resample: int) -> tuple[int, int]:
    """The input pixels [lo, hi) that outputs [start, start + count) of a pass from n to `new` pixels read (Pillow's
    precompute_coeffs bounds, one pixel wider each side); a pass that keeps the length: those outputs themselves."""
    if n == new:
        return start, start + count
    scale = n / new
    support = _SUPPORT[resample] * max(scale, 1.0)
    return (max(0, int((start + 0.5) * scale - support + 0.5) - 1),
            min(n, int((start + count - 0.5) * scale + support + 0.5) + 1))


def resize_crop(img: Image.Image, size: tuple[int, int], resample: int, crop: tuple[int, int] | None = None
                ) -> np.ndarray:
    """`img` resized to `size` (width, height) with PIL's filter `resample`, then `center_crop`ped to `crop`
    (height, width; None: none): equal byte for byte to center_crop(np.asarray(img.resize(size, resample)), *crop),
    with less work. An RGB or L image goes through `ivy.resample` (C: only the crop's pixels, vectorised; to CLIP's
    224 x 224 on the 2-core CPU machine, 2026-12-06, a 640 x 480 photo ~0.45 ms against Pillow's 2.9; a crop larger
    than the image is the whole resize there, padded here) where it is `usable`; the rest as below.

    Without the C, Pillow's passes apart. Why equal (Pillow's libImaging/Resample.c, ImagingResampleInner): it resizes in two passes through an 8-bit
    image between them, one along rows (each output row from its input row alone) and one along columns (each
    output column from its input column alone), in an order it picks from the sizes (`_vertical_first`), a pass
    whose length does not change skipped; each pass's coefficients depend only on its input and output lengths.
    So the first pass runs only on the lines the crop's pixels reach through the second (`_reach`) and keeps only
    the crop's part of its output, the second runs only on the crop's lines, each pass still over its full lengths
    (the same coefficients, the same sums). NEAREST (an affine transform in Pillow, not these passes), no crop, a
    crop larger than the image (zero padding), a mode other than RGB (`to_rgb`'s) and a Pillow on which `_exact`
    found otherwise take the plain way."""
    w, h = img.size
    nw, nh = size
    ch, cw = crop or (nh, nw)
    top, left = (nh - ch) // 2, (nw - cw) // 2
    if (nw, nh) != (w, h) and img.mode in _resample.MODES and resample in RESAMPLE and _resample.usable(_vertical_first):
        vfirst = _vertical_first(w, h, nw, nh)
        if top >= 0 and left >= 0:
            return _resample.resize_crop(img, size, resample, (top, left, ch, cw), vfirst)
        return center_crop(_resample.resize_crop(img, size, resample, (0, 0, nh, nw), vfirst), ch, cw)
    plain = (img.mode != "RGB" or resample not in _SUPPORT or top < 0 or left < 0 or (ch, cw) == (nh, nw)
             or (nw, nh) == (w, h))  # (Pillow resizes RGBA / LA premultiplied: a pass apart would round twice)
    if plain or not _exact():
        a = np.asarray(img if (nw, nh) == (w, h) else img.resize(size, Image.Resampling(resample)))
        return center_crop(a, ch, cw) if crop is not None else a
    return _resize_crop(img, size, resample, (ch, cw))


def _resize_crop(img: Image.Image, size: tuple[int, int], resample: int, crop: tuple[int, int]) -> np.ndarray:
    """resize_crop's own way (a crop within the resized image, a filter of _SUPPORT's)."""
    w, h = img.size
    nw, nh = size
    ch, cw = crop
    top, left = (nh - ch) // 2, (nw - cw) // 2
    f = Image.Resampling(resample)
    # Below, the first pass runs along rows ("lines": rows, h of them) and the second along columns; where Pillow
    # goes columns first, the same steps run on the axes swapped: `box` and `xy` turn them back into PIL's (x, y).
    flip = _vertical_first(w, h, nw, nh)
    if flip:
        w, h, nw, nh, ch, cw, top, left = h, w, nh, nw, cw, ch, left, top

    def box(x0: int, y0: int, x1: int, y1: int) -> tuple[int, int, int, int]:
        return (y0, x0, y1, x1) if flip else (x0, y0, x1, y1)

    def xy(x: int, y: int) -> tuple[int, int]:
        return (y, x) if flip else (x, y)

    lo, hi = _reach(h, nh, top, ch, resample)  # the input lines the crop's output lines reach

    # the first pass alone (the lines' count unchanged) on lines [lo, hi), keeping the crop's part of each line
    part = img.crop(box(0, lo, w, hi)) if (lo, hi) != (0, h) else img
    if nw != w:
        part = part.resize(xy(nw, hi - lo), f)
    if cw != nw:
        part = part.crop(box(left, 0, left + cw, hi - lo))
    if nh == h:  # no second pass: those lines are the crop's
        return np.asarray(part)
    if (lo, hi) != (0, h):  # the lines no kept output reads stay zero
        tmp = Image.new(img.mode, xy(cw, h))
        tmp.paste(part, xy(0, lo))
        part = tmp
    got = np.asarray(part.resize(xy(cw, nh), f))  # the second pass alone, on the crop's lines
    return got[:, top: top + ch] if flip else got[top: top + ch]


_EXACT: list[bool] = []
_EXACT_LOCK = threading.Lock()


def _exact() -> bool:
    """Whether resize_crop's own way gives this Pillow's pixels, checked once on small images (both pass orders):
    on a Pillow that resizes otherwise than `_resize_crop` reads it, images take the plain way."""
    if not _EXACT:
        with _EXACT_LOCK:
            if not _EXACT:
                img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 64, 3), np.uint8))
                ok = True
                for src, size, crop in (((64, 48), (30, 22), (20, 20)), ((48, 64), (22, 30), (20, 20)),
                                        ((40, 90), (36, 30), (30, 30)), ((64, 90), (20, 60), (50, 16))):
                    im = img.crop((0, 0, *src))
                    want = center_crop(np.asarray(im.resize(size, Image.Resampling.BICUBIC)), *crop)
                    ok = ok and np.array_equal(_resize_crop(im, size, 3, crop), want)
                if not ok:
                    log.warning("Pillow %s resizes otherwise than ivy.images.resize_crop expects: images take "
                                "Pillow's whole resize (slower, the same pixels)", PIL.__version__)
                _EXACT.append(ok)
    return _EXACT[0]


def center_crop(a: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """transformers' image_transforms.center_crop on [H, W, C]: the centre (offsets rounded down), zero
    padding first (offsets rounded up) where the image is smaller than the crop."""
    h, w = a.shape[:2]
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0:
        return a[top: top + ch, left: left + cw]
    nh, nw = max(ch, h), max(cw, w)
    padded = np.zeros((nh, nw, *a.shape[2:]), a.dtype)
    pt, pl = -(-(nh - h) // 2), -(-(nw - w) // 2)
    padded[pt: pt + h, pl: pl + w] = a
    top, left = top + pt, left + pl
    return padded[max(0, top): min(nh, top + ch), max(0, left): min(nw, left + cw)]


def _find(path: Path) -> tuple[Path, dict] | None:
    """(the file, the image processor's settings): preprocessor_config.json (transformers' layout), else
    processor_config.json's `image_processor` (what transformers 5 and sentence-transformers 6 save, as
    rose.images reads it), in `path` or a sentence-transformers module's folder."""
    try:  # sentence-transformers' CLIP layout: the processor in a module's folder
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        modules = []
    folders = [path] + [path / str(m.get("path", "")) for m in modules if isinstance(m, dict)] \
        if isinstance(modules, list) else [path]
    for folder in folders:
        for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            if (folder / name).is_file():
                cfg = json.loads((folder / name).read_text())
                cfg = cfg.get(key) if key and isinstance(cfg, dict) else cfg
                if isinstance(cfg, dict):
                    return folder / name, cfg
    return None


def _patch_tokens(path: Path, side: int) -> int:
    """The vision tower's tokens per image, (side / patch_size)^2 (+1 for CLIP's class token), from config.json
    (patch 16 where it names none): only the balancer's budget reads it."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    vision = cfg.get("vision_config") or {}
    patch = int(vision.get("patch_size") or 16)
    return (side // patch) ** 2 + (cfg.get("model_type") == "clip")


_PREPROCESSORS: dict[Path, Preprocessor | None | ValueError] = {}


def preprocessor(path: Path) -> Preprocessor | None:
    """`Preprocessor.read(path)`, read once per directory; an unreadable one is logged once and raises
    its ValueError at every use."""
    p = _PREPROCESSORS.get(path)
    if path not in _PREPROCESSORS:
        try:
            p = Preprocessor.read(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            p = e if isinstance(e, ValueError) else ValueError(f"{path}: preprocessor_config.json: {e}")
            log.error("%s", p)
        _PREPROCESSORS[path] = p
    if isinstance(p, ValueError):
        raise p
    return p


def warm(paths) -> threading.Thread | None:
    """At start-up, for models whose directories preprocess images: the resampler built (a C compile, ~1.3 s
    on a 2-core machine) and checked against Pillow on a thread of its own, so the first image request does not
    pay it (one that comes sooner waits for it in `_resample.usable`). None where no model takes images."""
    def takes_images(path: Path) -> bool:
        try:
            return preprocessor(path) is not None
        except ValueError:
            return False  # logged; its requests get the error

    if not any(takes_images(Path(p)) for p in paths):
        return None
    t = threading.Thread(target=_resample.usable, args=(_vertical_first,), name="ivy-resample-build", daemon=True)
    t.start()
    return t


def to_rgb(img: Image.Image) -> Image.Image:
    """transformers' image_transforms.convert_to_rgb: transparency (an alpha band, or a palette's or
    grey image's transparent colour) composited over white, everything else converted as PIL converts
    (CMYK, L, P, 16-bit grey clipped)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


@dataclass(frozen=True)
class Limits:
    """What one image may be: its bytes (413 beyond), its pixels as its header states them before any is
    decoded (400 beyond: a decompression bomb)."""

    max_bytes: int
    max_pixels: int


@dataclass(frozen=True)
class Meta:
    """What Cohere's reply says of each image: its size as decoded, format, bits per pixel."""

    width: int
    height: int
    format: str
    bit_depth: int


_BITS = {"1": 1, "L": 8, "P": 8, "RGB": 24, "RGBA": 32, "CMYK": 32, "YCbCr": 24, "LA": 16, "PA": 16, "I;16": 16,
         "I": 32, "F": 32}


def b64_bytes(text: str, label: str, limits: Limits) -> bytes:
    """A data URI's or bare base64's bytes; more than limits.max_bytes (counted before decoding) is a 413."""
    data = text
    if text.startswith("data:"):
        head, sep, data = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(400, f"{label}: a data URI must be base64 (data:image/png;base64,...)", "input")
    data = data.strip()
    if len(data) // 4 * 3 > limits.max_bytes + 2:
        raise _too_big(label, len(data) // 4 * 3, limits)
    try:  # msgspec's str -> bytes conversion is strict base64 (padding required, no other characters) in C at
        # ~2.3 GB/s; base64.b64decode(validate=True) took 5x as long (0.30 against 0.06 ms for a 136 KB JPEG)
        return msgspec.convert(data, bytes)
    except msgspec.ValidationError:
        raise APIError(400, f"{label}: not an image: neither a data URI, base64 nor an http(s) URL", "input") from None


def _too_big(label: str, n: int, limits: Limits) -> APIError:
    return APIError(413, f"{label}: the image has {n} bytes, more than this server's limit of {limits.max_bytes} "
                    "(--max-image-mb)", "input", "image_too_large")


def decode(data: bytes, label: str, limits: Limits) -> Image.Image:
    """Untrusted bytes -> a loaded image, EXIF orientation applied (ImageOps.exif_transpose, as transformers'
    load_image). Whatever Pillow raises on them is the input's fault: a 400 naming `label`."""
    if len(data) > limits.max_bytes:
        raise _too_big(label, len(data), limits)
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        w, h = img.size
        if w * h > limits.max_pixels:  # from the header: nothing decoded yet
            raise APIError(400, f"{label}: the image is {w} x {h} pixels, more than this server's limit of "
                           f"{limits.max_pixels} (--max-image-pixels)", "input", "image_too_large")
        img.load()
        return ImageOps.exif_transpose(img, in_place=True) or img
    except APIError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own guard (2x Image.MAX_IMAGE_PIXELS)
        raise APIError(400, f"{label}: the image has too many pixels: {e}", "input", "image_too_large") from None
    except MemoryError:
        raise APIError(413, f"{label}: the image does not fit in memory", "input", "image_too_large") from None
    except Exception as e:  # noqa: BLE001 (Pillow raises OSError, SyntaxError, ValueError, struct.error, ...)
        what = "not a PNG, JPEG, WebP or GIF image" if isinstance(e, Image.UnidentifiedImageError) else str(e) or type(e).__name__
        raise APIError(400, f"{label}: not a decodable image: {what}", "input", "invalid_image") from None


def pixels_of(data: bytes, label: str, limits: Limits, prep: Preprocessor) -> tuple[np.ndarray, Meta]:
    """One image's bytes -> its uint8 [side, side, 3] pixels and what it was (in a worker thread)."""
    img = decode(data, label, limits)
    meta = Meta(img.width, img.height, (img.format or "").lower(), _BITS.get(img.mode, 8 * len(img.getbands())))
    try:
        a = prep(to_rgb(img))
    except MemoryError:
        raise APIError(413, f"{label}: the image does not fit in memory", "input", "image_too_large") from None
    except Exception as e:  # noqa: BLE001 (a mode PIL cannot convert to RGB)
        raise APIError(400, f"{label}: not a decodable image: {e}", "input", "invalid_image") from None
    return a, meta


async def load_all(sources: list[str], labels: list[str], limits: Limits, prep: Preprocessor, fetch
                   ) -> tuple[np.ndarray, list[Meta]]:
    """Every source's pixels as one uint8 [n, side, side, 3] array, and each image's Meta. `fetch(source,
    label)` is awaited for an http(s) URL (its bytes, `ivy.imagefetch`); base64 decoding, Pillow and the
    preprocessing run in the pool, at most WORKERS of this request's images at a time. The first error
    cancels the rest of the request's images."""
    n = len(sources)
    out = np.empty((n, prep.side, prep.side, 3), np.uint8)
    metas: list[Meta | None] = [None] * n
    loop = asyncio.get_running_loop()
    todo = iter(range(n))

    def work(i: int, data: bytes | None) -> None:
        if data is None:
            data = b64_bytes(sources[i], labels[i], limits)
        a, metas[i] = pixels_of(data, labels[i], limits, prep)
        if a.shape != out.shape[1:]:
            raise APIError(503, f"the model's preprocessing made {a.shape} pixels, not {out.shape[1:]}")
        out[i] = a

    async def lane() -> None:
        for i in todo:
            s = sources[i]
            data = await fetch(s, labels[i]) if s.startswith(("http://", "https://")) else None
            # The pool's worker settles an asyncio future itself: what run_in_executor would add (a future
            # chained to the pool's, their callbacks and state copy, ~10 us of the loop's CPU an image) left out
            done = loop.create_future()
            job = _POOL.submit(_run, loop, done, work, i, data)
            try:
                await done
            except asyncio.CancelledError:
                job.cancel()  # not started yet: never runs (a running one finishes; its result is dropped)
                raise

    await (lane() if n == 1 else all_or_none([lane() for _ in range(min(WORKERS, n))]))
    return out, metas


def _run(loop: asyncio.AbstractEventLoop, done: asyncio.Future, fn, *args) -> None:
    """In a pool thread: fn(*args), its exception (if any) handed to `done` on the loop."""
    try:
        fn(*args)
        error = None
    except BaseException as e:  # noqa: BLE001 (handed to the awaiting request, as run_in_executor would)
        error = e
    try:
        loop.call_soon_threadsafe(_settle, done, error)
    except RuntimeError:  # the loop closed meanwhile (shutdown): nobody awaits it
        pass


def _settle(done: asyncio.Future, error: BaseException | None) -> None:
    if not done.done():  # (cancelled meanwhile: the request is gone)
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


async def all_or_none(coros: list) -> list:
    """Each coroutine's result, run at once; the first failure cancels the others and is raised. One coroutine
    is awaited in the caller's task (no task, no wait: a request of images alone, or of texts alone)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]
