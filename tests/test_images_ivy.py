"""Image inputs in Ivy (issue 51, the gateway's part): decoding and preprocessing equal to transformers'
image processors (its PIL backend: CLIPImageProcessorPil, SiglipImageProcessorPil) byte for byte; a fuzz of
mutated PNG / JPEG / GIF / WebP bytes that only ever gives a 400 / 413 or pixels; and a real Ivy process
(`python -m ivy`, two models from a --model-config) with /v1/embeddings' Jina items, Cohere's /v2/embed
through the official cohere client, the limits, URLs and errors.

Tulip does not forward pixels to the engine yet (issue 51's Tulip part comes later), so Ivy's Tulips here
are `Recorder`s (tests/imagecases.py): real gRPC servers (grpc.aio, the Tulip stubs, the health service) that record each
EmbedRequest Ivy sends and answer fixed vectors saying what they got (the fake stands only for the engine
part that does not exist yet). What is checked up to that call is real: the EmbedRequest's pixels bytes and
image count against transformers' processor output, the texts' token ids, the rows back in input order.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import random
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageOps

from conftest import Proc, free_port, http_status
from imagecases import (CAT, DIM, ImageHost, Recorders, data_uri, encode, fuzz_seeds, mutations, noise,
                        png_header_only, varied_images)
from ivy.errors import APIError
from ivy.images import Limits, Preprocessor, pixels_of

CLIP_SIDE, SIGLIP_SIDE = 32, 24
CLIP_PROC = {"crop_size": {"height": CLIP_SIDE, "width": CLIP_SIDE}, "do_center_crop": True, "do_convert_rgb": True,
             "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_processor_type": "CLIPImageProcessor", "image_std": [0.26862954, 0.26130258, 0.27577711],
             "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": CLIP_SIDE}}
SIGLIP_PROC = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
               "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5], "resample": 3,
               "rescale_factor": 0.00392156862745098, "size": {"height": SIGLIP_SIDE, "width": SIGLIP_SIDE}}


# --- the reference: transformers' processors (PIL backend) ------------------------------------------

_PROCESSORS: dict = {}


def load_processors(model_dirs) -> dict:
    """transformers' processors of the two model directories (imported once: seconds, overlapped with Ivy's start)."""
    if not _PROCESSORS:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        _PROCESSORS.update(clip=CLIPImageProcessorPil.from_pretrained(str(model_dirs["clip"])),
                           siglip=SiglipImageProcessorPil.from_pretrained(str(model_dirs["siglip"])))
    return _PROCESSORS


@pytest.fixture(scope="module")
def processors(model_dirs):
    return load_processors(model_dirs)


def reference(proc, data: bytes) -> np.ndarray:
    """transformers' pixels for an image file, up to the uint8 ones (no rescale, no normalise): the file opened
    and EXIF-transposed as transformers.image_utils.load_image does, then the processor."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    out = proc(images=img, do_rescale=False, do_normalize=False)["pixel_values"][0]
    assert out.dtype == np.uint8  # for uint8 input its resize goes through PIL and back: no float step
    return out.transpose(1, 2, 0)


LIMITS = Limits(10 << 20, 40_000_000)


# --- a model directory Ivy reads, and the recording Tulips -------------------------------------------

def save_tokenizer(path: Path) -> None:
    """A WordPiece tokenizer over lower-case letters and a few words, wrapping [CLS] ... [SEP], written with
    `tokenizers` alone (transformers' import would cost this file seconds before Ivy could start)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789"))
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "photo", "of", "cat", "dog"]
                                        + [c for c in chars if c != "a"] + ["##" + c for c in chars])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "pad_token": "[PAD]"}))


def write_model(path: Path, kind: str) -> Path:
    """What Ivy reads of a model: config.json (transformers' CLIP / SigLIP / BERT layout), the tokenizer, and for
    the two-tower models the preprocessor_config.json their processors save."""
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(path)
    text = {"vocab_size": 500, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 37, "max_position_embeddings": 64}
    if kind == "text":
        config = {"model_type": "bert", "architectures": ["BertModel"], **text}
    else:
        vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
                  "image_size": CLIP_SIDE if kind == "clip" else SIGLIP_SIDE, "patch_size": 8}
        config = {"model_type": kind, "architectures": ["CLIPModel" if kind == "clip" else "SiglipModel"],
                  "projection_dim": DIM, "text_config": text, "vision_config": vision}
        (path / "preprocessor_config.json").write_text(json.dumps(CLIP_PROC if kind == "clip" else SIGLIP_PROC))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image-models")
    return {k: write_model(tmp / k, k) for k in ("clip", "siglip", "text")} | {"tmp": tmp}


@pytest.fixture(scope="module")
def stack(model_dirs, tmp_path_factory):
    """One Ivy process serving clip (the default), siglip and text, each on its Recorder; an image host."""
    tmp = tmp_path_factory.mktemp("ivy-images")
    recs = Recorders({"clip": CLIP_SIDE, "siglip": SIGLIP_SIDE, "text": 0})
    ImageHost.files = {"/cat.png": CAT, "/big.png": b"\x89PNG" + bytes(1 << 20)}
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    hport = host.server_address[1]
    cfg = tmp / "models.json"
    cfg.write_text(json.dumps([{"name": k, "model": str(model_dirs[k]), "tulip": [recs.targets[k]]}
                               for k in ("clip", "siglip", "text")]))
    port = free_port()
    ivy = Proc(["-m", "ivy", "--model-config", str(cfg), "--port", str(port), "--max-images", "4",
                "--max-image-mb", "1", "--max-image-pixels", "1000000", "--image-url-timeout-s", "2"], tmp,
               # the loopback image host by its address (allowed though loopback); localhost by name (refused:
               # it resolves to a loopback address)
               env={"IVY_ALLOW_IMAGE_URLS": f"127.0.0.1:{hport},localhost"})
    url = f"http://127.0.0.1:{port}"
    try:
        load_processors(model_dirs)  # while Ivy starts
        ivy.wait_for(lambda: http_status(url + "/ready") == 200, timeout=60)
        yield url, recs.recorders, hport, ivy
    finally:
        ivy.stop()
        host.shutdown()
        recs.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


# --- through a real Ivy ----------------------------------------------------------------------------

def test_jina_items_mixed_texts_and_images_in_input_order(stack, processors):
    """/v1/embeddings (the openai client) with texts, data URIs, bare base64 and an allowed URL mixed: two
    Tulip requests (the texts' token ids; the images' pixels, `images` of them, each equal to transformers'
    processor's), the rows back in input order."""
    import openai

    url, recs, hport, _ = stack
    rec = recs["clip"]
    jpeg = encode(noise(90, 60, seed=4), "JPEG")
    gif = encode(noise(20, 50, seed=5).quantize(8), "GIF")
    inputs = [{"text": "a photo of a cat"}, {"image": data_uri(CAT)}, "two dogs",
              {"image": base64.b64encode(jpeg).decode()}, {"image": f"http://127.0.0.1:{hport}/cat.png"},
              {"image": data_uri(gif, "gif")}]
    files = [CAT, jpeg, CAT, gif]
    before = len(rec.requests)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    out = client.embeddings.create(model="clip", input=inputs, encoding_format="float")
    rows = np.array([d.embedding for d in out.data])
    sent = rec.requests[before:]
    assert len(sent) == 2
    text_req, image_req = sorted(sent, key=lambda r: r.images)
    assert text_req.images == 0 and not text_req.pixels and len(text_req.lengths) == 2
    assert image_req.images == 4 and not image_req.token_ids and not image_req.lengths
    assert len(image_req.pixels) == 4 * CLIP_SIDE * CLIP_SIDE * 3
    px = np.frombuffer(image_req.pixels, np.uint8).reshape(4, CLIP_SIDE, CLIP_SIDE, 3)
    for got, data in zip(px, files):
        assert np.array_equal(got, reference(processors["clip"], data))
    assert list(rows[:, 0]) == [1, 2, 1, 2, 2, 2]  # text, image, text, image, image, image
    assert list(rows[[0, 2], 3]) == [0, 1] and list(rows[[1, 3, 4, 5], 3]) == [0, 1, 2, 3]
    assert np.allclose(rows[[1, 3, 4, 5], 1], [p.astype(np.float32).mean() for p in px])
    tokens = len(text_req.token_ids) // 4 + 4 * ((CLIP_SIDE // 8) ** 2 + 1)
    assert out.usage.prompt_tokens == tokens


def test_cohere_v2_embed_with_the_cohere_client(stack):
    """/v2/embed through cohere.ClientV2: texts with search_query; images with every binary type and
    output_dimension; inputs of one part each; int8 refused where the model has no int8 quantizer."""
    import cohere

    url, recs, _, _ = stack
    co = cohere.ClientV2(api_key="x", base_url=url)
    r = co.embed(model="siglip", texts=["hello", "a longer text here"], input_type="search_query",
                 embedding_types=["float"])
    assert r.texts == ["hello", "a longer text here"] and len(r.embeddings.float_) == 2
    assert [row[0] for row in r.embeddings.float_] == [1.0, 1.0]
    assert r.meta.billed_units.input_tokens > 0
    png, jpg = encode(noise(30, 20, "RGBA", seed=1), "PNG"), encode(noise(31, 21, seed=2), "JPEG")
    r = co.embed(model="siglip", images=[data_uri(png), data_uri(jpg, "jpeg")], input_type="image",
                 embedding_types=["float", "binary", "ubinary"], output_dimension=3)
    req = recs["siglip"].requests[-1]
    assert req.images == 2 and len(req.pixels) == 2 * SIGLIP_SIDE * SIGLIP_SIDE * 3
    f = np.array(r.embeddings.float_)
    assert f.shape == (2, 3) and np.allclose(np.linalg.norm(f, axis=1), 1, atol=1e-6)  # cut, re-normalised
    assert r.embeddings.ubinary == [[224], [224]]  # the first three values' signs (all >= 0), packed
    assert r.embeddings.binary == [[224 - 128], [224 - 128]]
    assert [(m.width, m.height, m.format, m.bit_depth) for m in r.images] == [(30, 20, "png", 32),
                                                                            (31, 21, "jpeg", 24)]
    assert r.meta.billed_units.images == 2
    r = co.embed(model="clip", inputs=[{"content": [{"type": "text", "text": "hi"}]},
                                       {"content": [{"type": "image_url", "image_url": {"url": data_uri(png)}}]}],
                 input_type="search_document", embedding_types=["float"])
    assert [row[0] for row in r.embeddings.float_] == [1.0, 2.0]
    with pytest.raises(cohere.errors.BadRequestError, match="int8"):
        co.embed(model="clip", texts=["x"], input_type="classification", embedding_types=["int8"])
    two = {"model": "clip", "inputs": [{"content": [{"type": "text", "text": "a"},
                                                    {"type": "image_url", "image_url": {"url": data_uri(png)}}]}]}
    e = post(url, "/v2/embed", two)
    assert e.status_code == 400 and "one text or one image per input" in e.json()["error"]["message"]


def test_score_a_text_against_images_and_texts(stack):
    """/v1/score with Jina's items in text_2: each item's cosine to text_1, as the same items' /v1/embeddings
    rows give it; a text-only model refuses the images."""
    url, _, _, _ = stack
    items = [{"image": data_uri(CAT)}, {"text": "a dog"}, {"image": data_uri(encode(noise(20, 30, seed=8), "JPEG"))}]
    r = post(url, "/v1/score", {"model": "clip", "text_1": "a photo of a cat", "text_2": items})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    q = np.array(post(url, "/v1/embeddings", {"model": "clip", "input": "a photo of a cat"}).json()["data"][0]["embedding"])
    rows = np.array([d["embedding"] for d in post(url, "/v1/embeddings", {"model": "clip", "input": items}).json()["data"]])
    want = rows @ q / np.linalg.norm(rows, axis=1) / np.linalg.norm(q)
    assert np.allclose(got, want, atol=1e-6)
    r = post(url, "/v1/score", {"model": "text", "text_1": "a", "text_2": items})
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]


def test_image_errors_are_4xx_naming_the_input_and_ivy_stays_up(stack):
    url, recs, hport, ivy = stack
    good = {"image": data_uri(CAT)}
    truncated = CAT[: len(CAT) // 2]
    bomb = encode(Image.new("L", (1200, 1200)), "PNG")  # 1.44 MP of zeros in a few KB
    cases = [
        ([good, {"image": data_uri(b"not an image at all")}], 400, "input[1]: not a decodable image"),
        ([good, good, {"image": data_uri(truncated)}], 400, "input[2]: not a decodable image"),
        ([{"image": data_uri(encode(noise(8, 8), "BMP"))}], 400, "input[0]: not a decodable image: not a PNG, JPEG"),
        ([{"image": data_uri(bomb)}], 400, "input[0]: the image is 1200 x 1200 pixels, more than this server's "
                                          "limit of 1000000"),
        ([{"image": data_uri(png_header_only(5000, 5000))}], 400, "input[0]: the image is 5000 x 5000"),
        ([{"image": data_uri(png_header_only(100_000, 100_000))}], 400,  # Pillow's own guard, before ours
         "input[0]: the image has too many pixels: Image size (10000000000 pixels) exceeds limit"),
        ([{"text": "x"}, {"image": base64.b64encode(bytes(1 << 20) + b"x").decode()}], 413,
         "input[1]: the image has 1048577 bytes"),
        ([good] * 5, 400, "the request has 5 images; at most 4"),
        ([{"image": "%%% not base64"}], 400, "input[0]: not an image"),
        ([{"image": "data:image/png,rawbytes"}], 400, "input[0]: a data URI must be base64"),
        ([{"text": "a", "image": data_uri(CAT)}], 400, "input[0]: an item holds one of 'text' or 'image'"),
        ([{"text": "a"}, {"text": ""}], 400, "input[1] is an empty string"),
        ([{"image": "http://example.com/cat.png"}], 400, "image URLs are fetched only from the hosts"),
        ([{"image": f"http://127.0.0.1:{hport + 1}/cat.png"}], 400, "image URLs are fetched only from the hosts"),
        ([{"image": f"http://localhost:{hport}/cat.png"}], 400, "localhost resolves to 127.0.0.1"),
        ([{"image": f"http://127.0.0.1:{hport}/moved"}], 400, "answered 'HTTP/1.0 302"),
        ([{"image": f"http://127.0.0.1:{hport}/nothing.png"}], 400, "answered 'HTTP/1.0 404"),
        ([{"image": f"http://127.0.0.1:{hport}/big.png"}], 413, "the image has more than 1048576 bytes"),
    ]
    for inputs, status, says in cases:
        r = post(url, "/v1/embeddings", {"input": inputs})
        assert r.status_code == status and says in r.json()["error"]["message"], (says, r.status_code, r.text)
    r = post(url, "/v1/embeddings", {"model": "text", "input": [{"text": "fine"}, good]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "model 'text' does not take images (it has no image tower)"
    assert post(url, "/v1/embeddings", {"model": "text", "input": [{"text": "fine"}, "too"]}).status_code == 200
    r = post(url, "/v2/embed", {"model": "clip", "images": [data_uri(b"GIF89a broken")]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("images[0]: not a decodable image")
    # fuzzed files through HTTP: never a 5xx
    for data in mutations(fuzz_seeds(), 30, random.Random(7)):
        assert post(url, "/v1/embeddings", {"input": [{"image": data_uri(data)}]}).status_code in (200, 400, 413)
    assert post(url, "/v1/embeddings", {"input": [good]}).status_code == 200
    assert ivy.p.poll() is None and "Traceback" not in ivy.output()


# --- in process: the preprocessing against transformers, the fuzz (after the Ivy tests: the transformers
# import overlaps Ivy's start there) -----------------------------------------------------------------

def test_preprocessing_equals_transformers_processors(model_dirs, processors):
    """Every varied image, through CLIP's (shortest edge, bicubic, centre crop) and SigLIP's (square resize,
    no crop) configs, as each model directory's preprocessor_config.json says: our uint8 pixels equal
    transformers' byte for byte. Then other filters and a crop larger than the resize (zero-padded)."""
    preps = {k: Preprocessor.read(model_dirs[k]) for k in ("clip", "siglip")}
    assert (preps["clip"].side, preps["siglip"].side) == (CLIP_SIDE, SIGLIP_SIDE)
    assert preps["clip"].tokens == (CLIP_SIDE // 8) ** 2 + 1 and preps["siglip"].tokens == (SIGLIP_SIDE // 8) ** 2
    images = varied_images()
    for kind, prep in preps.items():
        for what, data in images:
            ours, _ = pixels_of(data, "input[0]", LIMITS, prep)
            ref = reference(processors[kind], data)
            assert ours.shape == ref.shape == (prep.side, prep.side, 3), (kind, what)
            assert np.array_equal(ours, ref), (kind, what, int(np.abs(ours.astype(int) - ref).max()))
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    for resample in (0, 1, 2, 4, 5):
        for size, crop in ((20, 16), (12, 16)):  # the second: the crop is larger than the resized image
            cfg = {**CLIP_PROC, "resample": resample, "size": {"shortest_edge": size},
                   "crop_size": {"height": crop, "width": crop}}
            d = model_dirs["tmp"] / f"clip-{resample}-{size}"
            d.mkdir(exist_ok=True)
            (d / "preprocessor_config.json").write_text(json.dumps(cfg))
            prep, proc = Preprocessor.read(d), CLIPImageProcessorPil.from_pretrained(str(d))
            for what, data in images[::3]:
                ours, _ = pixels_of(data, "input[0]", LIMITS, prep)
                assert np.array_equal(ours, reference(proc, data)), (resample, size, what)


def test_unsupported_processor_configs_are_refused(tmp_path):
    for bad, says in (({"image_processor_type": "Siglip2ImageProcessor"}, "Siglip2ImageProcessor"),
                      ({**CLIP_PROC, "do_center_crop": False}, "not a fixed square"),
                      ({**SIGLIP_PROC, "size": {"height": 24, "width": 32}}, "not a fixed square"),
                      ({**CLIP_PROC, "resample": 9}, "resample 9")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=says):
            Preprocessor.read(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    assert Preprocessor.read(tmp_path) is None  # a text model


def test_fuzz_mutated_files_give_a_clean_error_or_pixels(model_dirs):
    """400 mutated PNG / JPEG / GIF / WebP files into the decoder and the preprocessing: each gives pixels of
    the right shape or an APIError 400 / 413 naming the input; nothing else escapes. Within 5 s."""
    prep = Preprocessor.read(model_dirs["clip"])
    rng = random.Random(51)
    limits = Limits(1 << 20, 1_000_000)
    t0, outcomes = time.monotonic(), {"pixels": 0, 400: 0, 413: 0}
    for data in mutations(fuzz_seeds(), 400, rng):
        try:
            a, _ = pixels_of(data, "input[7]", limits, prep)
        except APIError as e:
            assert e.status in (400, 413) and e.message.startswith("input[7]: "), e.message
            outcomes[e.status] += 1
        else:
            assert a.shape == (CLIP_SIDE, CLIP_SIDE, 3) and a.dtype == np.uint8
            outcomes["pixels"] += 1
    assert time.monotonic() - t0 < 5.0
    assert outcomes["pixels"] > 20 and outcomes[400] > 100, outcomes  # both kinds were reached


def test_the_decode_pool_hand_off_settles_its_future_and_drops_work_not_started():
    """ivy.images' pool hand-off (`_run` / `_settle`, in place of run_in_executor): the awaiting request gets the
    worker's exception; a job still queued when its request is cancelled never runs; a future cancelled
    meanwhile is left alone."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from ivy import images

    async def main():
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1)
        gate, ran = threading.Event(), []
        busy = loop.create_future()
        pool.submit(images._run, loop, busy, gate.wait)
        queued = loop.create_future()
        job = pool.submit(images._run, loop, queued, ran.append, 1)
        assert job.cancel()  # queued behind the busy worker: cancelled, it never runs
        gone = loop.create_future()
        pool.submit(images._run, loop, gone, ran.append, 2)
        gone.cancel()  # its request went away while it waited: the worker's settle must not raise
        gate.set()
        await busy
        bad = loop.create_future()
        pool.submit(images._run, loop, bad, int, "not a number")
        with pytest.raises(ValueError):
            await bad
        pool.shutdown(wait=True)
        await asyncio.sleep(0)
        return ran

    assert asyncio.run(main()) == [2]  # the cancelled job never ran; the one whose request left still ran
