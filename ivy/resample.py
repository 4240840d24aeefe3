"""Ivy's resampler (`ivy/resample.c`, built as ivy.native builds its C: with the system's C compiler on first use,
kept by source hash in the cache directory, or beside the source by `python -m ivy.resample` in the gateway image):
Pillow's resize of an RGB or L image followed by a crop, only the crop's pixels computed, Pillow's bytes exactly
(the C file says why by hand, and why exact). `ivy.images.resize_crop` takes it where `usable()` (it built, and on
this Pillow it gave Pillow's pixels on `check`'s images), else Pillow's own resize.

The C reads the decoded image where Pillow keeps it (the Arrow C data interface Pillow exports, 4 bytes a pixel
for RGB: no copy); an image Pillow keeps in more than one block (larger than Pillow's 16 MB blocks) is copied out
first (`tobytes`). ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import PIL
from PIL import Image

from ivy import native

log = logging.getLogger("ivy.resample")
SOURCE = Path(__file__).with_name("resample.c")
# -O3: the loops vectorised; -ffp-contract=off: the weights' double arithmetic rounded as Pillow's (no fused
# multiply-add: an FMA rounds once where Pillow's build rounds twice)
FLAGS = ("-O3", "-ffp-contract=off")
MODES = {"RGB": (4, 3), "L": (1, 1)}  # mode: (bytes a pixel as Pillow keeps it, channels out)


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [("length", ctypes.c_int64), ("null_count", ctypes.c_int64), ("offset", ctypes.c_int64),
                        ("n_buffers", ctypes.c_int64), ("n_children", ctypes.c_int64),
                        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
                        ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
                        ("dictionary", ctypes.c_void_p), ("release", ctypes.c_void_p), ("private_data", ctypes.c_void_p)]
_capsule = ctypes.pythonapi.PyCapsule_GetPointer
_capsule.restype, _capsule.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled resampler (CDLL: the GIL released while it runs). ImportError when it cannot be built."""
    return load(native.compiled(SOURCE, FLAGS))


def load(path: Path) -> ctypes.CDLL:
    """A build of ivy/resample.c at `path` with its function's signature (`library`; the sanitizer fuzz,
    benchmarks/fuzz_resample.py, loads its own build)."""
    lib = ctypes.CDLL(str(path))
    f = lib.ivy_resize_crop
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int, ctypes.c_void_p]
    return lib


def _buffer(img: Image.Image, px: int) -> tuple[int, object]:
    """(the address of `img`'s pixels, rows packed, `px` bytes a pixel; what keeps them alive): Pillow's own memory
    through its Arrow export where it is one block, else a copy."""
    try:
        _, array = img.__arrow_c_array__()
        a = _ArrowArray.from_address(_capsule(array, b"arrow_array"))
        if px == 4:  # a fixed-size list of 4 uint8 per pixel: the bytes are its child's
            if a.n_children != 1 or a.offset:
                raise ValueError("unexpected layout")
            a = a.children[0].contents
        if a.offset or a.n_buffers != 2 or a.length != img.width * img.height * px or not a.buffers[1]:
            raise ValueError("unexpected layout")
        return a.buffers[1], array  # the capsule releases the export (and Pillow's image) when it goes
    except (ValueError, AttributeError):  # rows in several blocks (Pillow says so): a copy
        data = img.tobytes("raw", "RGBX") if px == 4 else img.tobytes()
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, data


def resize_crop(img: Image.Image, size: tuple[int, int], resample: int, box: tuple[int, int, int, int],
                vfirst: bool, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """`img` (RGB or L) resized to `size` (width, height) with PIL's filter number `resample`, Pillow's columns
    pass first where `vfirst`; of that, rows [top, top + ch) and columns [left, left + cw) (`box`: top, left, ch,
    cw, within the resized image), as a new uint8 array [ch, cw, 3] ([ch, cw] for L); by `lib` if given."""
    px, outc = MODES[img.mode]
    top, left, ch, cw = box
    out = np.empty((ch, cw, outc) if outc > 1 else (ch, cw), np.uint8)
    addr, keep = _buffer(img, px)
    w, h = img.size
    rc = (lib or library()).ivy_resize_crop(addr, w, h, w * px, px, outc, size[0], size[1], resample, int(vfirst), top, left,
                                   ch, cw, out.ctypes.data)
    del keep
    if rc == -2:
        raise MemoryError("ivy/resample.c ran out of memory")
    if rc:
        raise ValueError(f"ivy/resample.c refused {img.mode} {img.size} -> {size} filter {resample} crop {box}")
    return out


def check(vfirst: Callable[[int, int, int, int], bool]) -> bool:
    """Whether the C gives this Pillow's bytes (Image.resize, then the crop) on a few random images: RGB and L, both
    pass orders, up- and downscaling, a pass skipped, every filter Ivy's processors name, crops off centre."""
    rng = np.random.default_rng(51)
    rgb = Image.fromarray(rng.integers(0, 256, (61, 47, 3), np.uint8))
    grey = Image.fromarray(rng.integers(0, 256, (61, 47), np.uint8))
    for img in (rgb, grey):
        # rows first (Pillow 13): down, up, both, tiny; columns first: (40, 13), (45, 7); one pass: (47, 19), (20, 61)
        for size in ((20, 13), (13, 29), (90, 61), (29, 140), (3, 2), (40, 13), (45, 7), (47, 19), (20, 61)):
            for resample in range(6):
                w, h = size
                box = (h // 3, w // 4, h - h // 3, w - w // 4)
                want = np.asarray(img.resize(size, Image.Resampling(resample)))[box[0]: box[0] + box[2],
                                                                                 box[1]: box[1] + box[3]]
                got = resize_crop(img, size, resample, box, vfirst(*img.size, *size))
                if not np.array_equal(got, want):
                    log.warning("ivy/resample.c resizes %s %s to %s (filter %d) otherwise than Pillow %s: images take "
                                "Pillow's resize (slower, the same pixels)", img.mode, img.size, size, resample,
                                PIL.__version__)
                    return False
    return True


_USABLE: list[bool] = []
_LOCK = threading.Lock()


def usable(vfirst: Callable[[int, int, int, int], bool]) -> bool:
    """Whether to resize with the C: built (or buildable) here and `check`ed against this Pillow, once."""
    if not _USABLE:
        with _LOCK:
            if not _USABLE:
                try:
                    library()
                    ok = check(vfirst)
                except ImportError as e:
                    log.warning("%s: images take Pillow's resize (slower, the same pixels)", e)
                    ok = False
                _USABLE.append(ok)
    return _USABLE[0]


if __name__ == "__main__":  # python -m ivy.resample: build the resampler beside its source (the gateway image)
    print(native.build(SOURCE.with_name(native.built_name(SOURCE, FLAGS)), FLAGS, SOURCE))
