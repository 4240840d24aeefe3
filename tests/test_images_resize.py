"""ivy.images' resize (issue 51): `resize_crop` computes only what the centre crop keeps and must give Pillow's
whole resize + transformers' centre crop byte for byte (tests/test_images_ivy.py compares whole requests with
transformers' processors; these are the geometries that take each of its branches: both of Pillow's pass orders,
up- and downscaling, crops of odd sizes, every filter), through ivy.resample's C and through Pillow's passes apart
(tests/test_images_resample.py fuzzes the C alone), and its base64 decoding stays strict."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from PIL import Image

import ivy.images as images
import ivy.resample as native_resample
from ivy.errors import APIError
from ivy.images import Limits, b64_bytes, center_crop, resize_crop


def pillow(img: Image.Image, size, resample: int, crop) -> np.ndarray:
    a = np.asarray(img.resize(size, Image.Resampling(resample)))
    return center_crop(a, *crop) if crop is not None else a


def shortest(w: int, h: int, side: int) -> tuple[int, int]:
    """transformers' shortest-edge size (width, height)."""
    return (side, int(side * h / w)) if w <= h else (int(side * w / h), side)


@pytest.mark.parametrize("way", ["c", "pillow"])
def test_resize_crop_equals_pillows_whole_resize(way, monkeypatch):
    """Both of resize_crop's ways: ivy.resample's C (where it is usable: RGB) and Pillow's passes apart."""
    if way == "pillow":
        monkeypatch.setattr(native_resample, "_USABLE", [False])
    else:
        assert native_resample.usable(images._vertical_first), "ivy/resample.c is not usable here"
    assert images._exact()  # this Pillow takes resize_crop's own way (else the cases below test the fallback)
    rng = np.random.default_rng(51)
    cases = 0
    for w, h in ((640, 480), (480, 640), (100, 300), (300, 100), (7, 300), (31, 64), (1, 1), (225, 224), (57, 41)):
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        big = w * h > 100_000
        for resample in (3,) if big else (0, 1, 2, 3, 4, 5):
            for side in (224,) if big else (32, 24):
                size = shortest(w, h, side)
                # centre crops: square, odd sizes, taller / wider than the resized image (zero padding), none
                for crop in ((side, side), (side - 5, side - 8), (side + 4, side), (side, size[0] + 2), None):
                    want = pillow(img, size, resample, crop)
                    got = resize_crop(img, size, resample, crop)
                    assert got.shape == want.shape and np.array_equal(got, want), ((w, h), resample, size, crop)
                    cases += 1
                # a square resize (SigLIP's) and a non-proportional one, with and without a crop
                for size, crop in (((side, side), None), ((side + 9, side - 4), (side - 6, side - 7))):
                    assert np.array_equal(resize_crop(img, size, resample, crop), pillow(img, size, resample, crop))
                    cases += 1
    assert cases > 200
    # Pillow resizes RGBA / LA premultiplied, once: passes apart would round twice (up to 13/255 off); they go whole
    for mode in ("RGBA", "LA"):
        img = Image.fromarray(rng.integers(0, 256, (48, 64, 4), dtype=np.uint8), "RGBA").convert(mode)
        assert np.array_equal(resize_crop(img, (42, 32), 3, (32, 32)), pillow(img, (42, 32), 3, (32, 32))), mode


def test_a_pillow_that_resizes_otherwise_takes_the_plain_way(monkeypatch, caplog):
    """`_exact` and ivy.resample's `check` test resize_crop's reading of Pillow's pass order once; a wrong reading
    (here: rows first always, as Pillow before 13) is found by both, each says so, and every resize then is
    Pillow's own, the same pixels."""
    monkeypatch.setattr(images, "_EXACT", [])
    monkeypatch.setattr(native_resample, "_USABLE", [])
    monkeypatch.setattr(images, "_vertical_first", lambda *_: images._PILLOW < (13, 0))
    with caplog.at_level("WARNING"):
        assert native_resample.usable(images._vertical_first) is False
        assert images._exact() is False
    assert "ivy/resample.c resizes" in caplog.text and "resizes otherwise than ivy.images.resize_crop" in caplog.text
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (300, 100, 3), dtype=np.uint8))
    assert np.array_equal(resize_crop(img, (32, 96), 3, (32, 32)), pillow(img, (32, 96), 3, (32, 32)))


def test_base64_stays_strict():
    limits = Limits(1 << 20, 1 << 20)
    raw = bytes(range(256)) * 3
    text = base64.b64encode(raw).decode()
    assert b64_bytes(text, "x", limits) == raw
    assert b64_bytes(f"data:image/png;base64,{text}", "x", limits) == raw
    assert b64_bytes(f" {text}\n", "x", limits) == raw  # around it: stripped, as before
    for bad in (text[:-2], text[:10] + "\n" + text[10:], text[:10] + " " + text[10:], text.replace("A", "-", 1),
                text + "=", "%%%%"):
        with pytest.raises(APIError, match="x: not an image") as e:
            b64_bytes(bad, "x", limits)
        assert e.value.status == 400
    with pytest.raises(APIError, match="more than this server's limit") as e:
        b64_bytes(base64.b64encode(bytes((1 << 20) + 3)).decode(), "x", limits)
    assert e.value.status == 413
