"""Ivy's resampler in C (ivy/resample.c, issue 51) against Pillow, differentially: its pixels must be Pillow's
resize followed by the crop, byte for byte, on random geometries (benchmarks/fuzz_resample.py's cases: sizes from 1
pixel to 700 and extreme aspect ratios, up- and downscaling, both of Pillow's pass orders, one pass or none, every
filter, RGB and L, random and saturated content, crops anywhere) and on the edges named below; an image Pillow
keeps in several blocks is copied out and still equal; without a C compiler Ivy says why and resizes with Pillow.

A larger run: IVY_FUZZ_IMAGES=N (cases; default 4000); the sanitizer run: python -m benchmarks.fuzz_resample
--sanitize."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
from PIL import Image

import ivy.images as images
import ivy.resample as resample
from benchmarks.fuzz_resample import pillow, run

try:
    resample.library()
except ImportError as e:  # no C compiler here
    pytest.skip(f"ivy/resample.c cannot be built: {e}", allow_module_level=True)

FUZZ = int(os.environ.get("IVY_FUZZ_IMAGES", "4000"))


def c(img: Image.Image, size, f: int, box) -> np.ndarray:
    return resample.resize_crop(img, size, f, box, images._vertical_first(*img.size, *size))


def test_c_equals_pillow_on_random_geometries():
    differ, seen = run(FUZZ, 51)
    assert differ == 0
    assert min(seen.values()) > FUZZ // 40, seen  # each pass order, one pass, none, both modes: all taken


@pytest.mark.parametrize("f", range(6))
def test_c_equals_pillow_at_the_edges(f):
    """1-pixel images and targets (windows wider than the row: zero-padded), extreme aspect ratios, a downscale
    whose taps run to thousands, the benchmark's photo to CLIP's 298 x 224 and crop (rows first) and turned
    (480 x 640: also rows first), and a grey photo."""
    rng = np.random.default_rng(f)
    noise = Image.fromarray(rng.integers(0, 256, (700, 500, 3), np.uint8))
    one = Image.fromarray(np.array([[[0, 255, 7]]], np.uint8))
    geometries = [(one, (224, 224), (0, 0, 224, 224)), (one, (1, 1), (0, 0, 1, 1)), (one, (3, 300), (100, 1, 50, 1)),
                  (noise, (1, 1), (0, 0, 1, 1)), (noise, (500, 1), (0, 0, 1, 500)), (noise, (1, 700), (0, 0, 700, 1)),
                  (noise.resize((3000, 2)), (7, 2), (0, 0, 2, 7)), (noise.resize((3000, 2)), (7, 1), (0, 3, 1, 4)),
                  (noise.resize((2, 3000)), (2, 5), (0, 0, 5, 2)), (noise.resize((5, 3000)), (3, 9), (2, 1, 7, 2)),
                  (noise.resize((3, 2)), (700, 500), (100, 200, 300, 250))]
    from benchmarks.images_served import photo_jpeg

    photo = Image.open(io.BytesIO(photo_jpeg()[0]))
    photo.load()
    turned = photo.transpose(Image.Transpose.ROTATE_90)
    geometries += [(photo, (298, 224), (0, 37, 224, 224)), (turned, (224, 298), (37, 0, 224, 224)),
                   (photo.convert("L"), (298, 224), (0, 37, 224, 224)), (photo, (224, 224), (0, 0, 224, 224))]
    for img, size, box in geometries:
        got, want = c(img, size, f, box), pillow(img, size, f, box)
        assert got.shape == want.shape and np.array_equal(got, want), (img.mode, img.size, size, f, box)


def test_an_image_in_several_blocks_is_copied_out():
    """Pillow keeps a large image in several blocks (16 MB each by default; 4 KB here): no Arrow export of one
    buffer, so the C reads a copy (tobytes), the same pixels."""
    old = Image.core.get_block_size()
    Image.core.set_block_size(4096)
    try:
        img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (90, 70, 3), np.uint8))
        with pytest.raises(ValueError):
            img.__arrow_c_array__()
        for size, box in (((31, 40), (5, 3, 30, 25)), ((70, 20), (0, 0, 20, 70))):
            assert np.array_equal(c(img, size, 3, box), pillow(img, size, 3, box))
        grey = img.convert("L")
        assert np.array_equal(c(grey, (31, 40), 1, (5, 3, 30, 25)), pillow(grey, (31, 40), 1, (5, 3, 30, 25)))
    finally:
        Image.core.set_block_size(old)


def test_threads_resize_at_once():
    """The C holds no state between calls and runs without the GIL: images resized on 4 threads at once are each
    Pillow's."""
    rng = np.random.default_rng(4)
    imgs = [Image.fromarray(rng.integers(0, 256, (120 + i, 90, 3), np.uint8)) for i in range(4)]
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(20):
            if not np.array_equal(c(imgs[i], (64, 80), 3, (8, 0, 64, 64)), pillow(imgs[i], (64, 80), 3, (8, 0, 64, 64))):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_without_a_compiler_ivy_says_why_and_resizes_with_pillow(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(resample, "FLAGS", resample.FLAGS + ("-DIVY_NOT_BUILT",))  # a build no one has made
    monkeypatch.setattr(resample, "_USABLE", [])
    resample.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="ivy.resample"):
            assert resample.usable(images._vertical_first) is False
        assert "no-such-cc" in caplog.text and "Pillow's resize" in caplog.text
        img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (48, 64, 3), np.uint8))
        want = images.center_crop(np.asarray(img.resize((42, 32), Image.Resampling.BICUBIC)), 32, 32)
        assert np.array_equal(images.resize_crop(img, (42, 32), 3, (32, 32)), want)
    finally:
        resample.library.cache_clear()


def test_ivy_builds_the_resampler_at_start_for_image_models(monkeypatch, tmp_path):
    """Ivy's lifespan calls images.warm with its models' directories: where one preprocesses images the C is built
    and checked on a thread then (not by the first image request); for text models nothing starts."""
    import json

    monkeypatch.setattr(resample, "_USABLE", [])
    text, clip = tmp_path / "text", tmp_path / "clip"
    text.mkdir(), clip.mkdir()
    (clip / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32}, "crop_size": 32, "resample": 3}))
    assert images.warm([text]) is None and resample._USABLE == []
    t = images.warm([text, clip])
    assert t is not None and t.name == "ivy-resample-build"
    t.join(60)
    assert resample._USABLE == [True]
