"""Images through Tulip (issue 51): a real Tulip process serving a tiny random CLIP (saved by transformers) takes
image requests (EmbedRequest `pixels` + `images`) from grpcio's own client and from trellis.client, answers
vectors equal to transformers' `get_image_features` (and text ones to `get_text_features`, in the same space),
keeps text and image steps apart while both kinds are queued, and refuses malformed image requests with
INVALID_ARGUMENT while it keeps serving. One real Ivy before three Tulips (started together): the CLIP; a tiny
SigLIP whose texts Ivy pads as its processor pads them (padding="max_length"), equal to transformers'
`get_text_features` of the processor's ids; the CLIP in sentence-transformers' older `0_CLIPModel/` layout
(tokenizer, processor config and prompts found where that layout keeps them); the SigLIP's weights with a SigLIP 1
tokenizer (spiece.model alone) before the same Tulip."""

from __future__ import annotations

import asyncio
import io
import json
import shutil

import grpc
import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (AutoProcessor, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizerFast,
                          SiglipConfig, SiglipImageProcessor, SiglipModel)

from tests.conftest import Proc, free_port, http_status
from tests.imagecases import data_uri, encode
from tests.test_models_clip import EOS, SIZE, TEXT, VISION, images, processed, siglip_tokenizer, vocab_files
from trellis.client import TulipClient
from trellis.options import Options, OptionError
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.messages import parse_images


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> (target, transformers' model, directory): three Tulips on the CPU, started together: a tiny CLIP
    ("clip", transformers' layout), a tiny SigLIP with the tokenizer fixed-resolution SigLIP 2 publishes
    ("siglip"), and the CLIP in sentence-transformers' older layout ("st_clip_0": the checkpoint in 0_CLIPModel/
    with the processor_config.json transformers 5 saves, modules.json naming it: the same weights as "clip")."""
    root = tmp_path_factory.mktemp("clip_tulip")
    torch.manual_seed(1)
    ref = CLIPModel(CLIPConfig(text_config={**TEXT, "eos_token_id": EOS, "bos_token_id": 0, "pad_token_id": EOS},
                               vision_config=VISION, projection_dim=16)).eval()
    d = root / "clip"
    ref.save_pretrained(d)
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    processor.save_pretrained(d)
    CLIPTokenizerFast(*vocab_files(root)).save_pretrained(d)
    sig = SiglipModel(SiglipConfig(text_config={**TEXT, "projection_size": VISION["hidden_size"]},
                                   vision_config=VISION)).eval()
    ds = root / "siglip"
    sig.save_pretrained(ds)
    SiglipImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(ds)
    siglip_tokenizer(ds, TEXT["max_position_embeddings"])
    old = root / "st_clip_0"
    shutil.copytree(d, old / "0_CLIPModel", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    CLIPProcessor(image_processor=processor, tokenizer=CLIPTokenizerFast.from_pretrained(d)).save_pretrained(
        old / "0_CLIPModel")
    (old / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "0_CLIPModel",
                                                   "type": "sentence_transformers.models.CLIPModel"}]))
    (old / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "a "}}))
    out, procs = {}, []
    for name, path, model in (("clip", d, ref), ("siglip", ds, sig), ("st_clip_0", old, ref)):
        port = free_port()
        # a small step budget: a request of 5 images (17 tokens each) spans several steps
        procs.append(Proc(["-m", "tulip", "--model", str(path), "--port", str(port), "--device", "cpu",
                           "--max-batch-tokens", "40" if name == "clip" else "512", "--max-queued-tokens", "4000"],
                          root))
        out[name] = f"127.0.0.1:{port}", model, path
    try:
        for p in procs:
            p.wait_for(lambda: "TULIP_READY" in p.output())
        yield out, processor
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def clip_tulip(served):
    """(target, transformers' model, its image processor, directory): the tiny CLIP's Tulip."""
    (target, ref, d), processor = served[0]["clip"], served[1]
    return target, ref, processor, d


@pytest.fixture(scope="module")
def siglip1(served, tmp_path_factory):
    """The tiny SigLIP's weights with a SigLIP 1 tokenizer (spiece.model and SiglipTokenizer's config, no
    tokenizer.json: google/siglip-*'s files), served by the SigLIP's Tulip: (directory, SiglipProcessor)."""
    import random

    from transformers import SiglipProcessor, SiglipTokenizer

    from tests.test_spiece import train_spiece

    d = tmp_path_factory.mktemp("siglip1") / "m"
    shutil.copytree(served[0]["siglip"][2], d, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    rng = random.Random(5)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6))) for _ in range(300)]
    train_spiece(d / "spiece.model", [" ".join(rng.sample(words, 8)) for _ in range(500)], 60)
    tok = SiglipTokenizer(str(d / "spiece.model"), model_max_length=TEXT["max_position_embeddings"])
    processor = SiglipProcessor(image_processor=SiglipImageProcessor(size={"height": SIZE, "width": SIZE}),
                                tokenizer=tok)
    processor.save_pretrained(d)
    assert not (d / "tokenizer.json").exists()
    return d, processor


@pytest.fixture(scope="module")
def ivy(served, siglip1, tmp_path_factory):
    """One real Ivy serving the three models (--model-config), each before its own Tulip, and "siglip1" (the
    SigLIP's weights with a SigLIP 1 tokenizer) before the SigLIP's Tulip; its URL."""
    tmp = tmp_path_factory.mktemp("ivy")
    config = tmp / "models.json"
    config.write_text(json.dumps([{"name": name, "model": str(path), "tulip": target}
                                  for name, (target, _, path) in served[0].items()]
                                 + [{"name": "siglip1", "model": str(siglip1[0]), "tulip": served[0]["siglip"][0]}]))
    port = free_port()
    proc = Proc(["-m", "ivy", "--model-config", str(config), "--port", str(port)], tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/ready") == 200, timeout=60)
        yield url
    finally:
        proc.stop()


def test_images_and_texts_equal_transformers(clip_tulip):
    target, ref, processor, _ = clip_tulip
    values, pixels = processed(processor, images())
    texts = [[0, 5, 7, 9, EOS], [0, 3, EOS, 4, EOS], [0, 12, 30, 2, EOS]]

    async def main():
        async with TulipClient(target) as c:
            info = await c.info()
            # images and texts queued together: steps of one kind each, in turns, every request answered
            got = await asyncio.gather(c.embed_images(pixels.numpy()), c.embed(texts), c.embed_images(pixels[1:3].numpy()),
                                       c.embed(texts[:1]), c.embed_images(pixels.numpy(), dimensions=8))
            return info, got

    info, (img, txt, two, one, cut) = asyncio.run(main())
    assert info.image_size == SIZE and info.embedding_dim == 16
    with torch.no_grad():
        want_img = F.normalize(ref.get_image_features(pixel_values=values).pooler_output, dim=-1).numpy()
        want_txt = F.normalize(ref.get_text_features(input_ids=torch.tensor(texts[:1])).pooler_output, dim=-1).numpy()
    np.testing.assert_allclose(img, want_img, atol=1e-4)
    np.testing.assert_allclose(two, want_img[1:3], atol=1e-4)
    np.testing.assert_allclose(one, want_txt, atol=1e-4)
    np.testing.assert_allclose(txt[0], want_txt[0], atol=1e-4)
    # Matryoshka on images as on text: the first 8 values, normalised again
    np.testing.assert_allclose(cut, want_img[:, :8] / np.linalg.norm(want_img[:, :8], axis=1, keepdims=True), atol=1e-4)


def test_bad_image_requests_are_invalid_argument_and_the_server_keeps_serving(clip_tulip):
    """Through grpcio's own client, the proto as any language's client would send it."""
    target, _, _, _ = clip_tulip
    good = np.zeros((1, SIZE, SIZE, 3), np.uint8).tobytes()
    bad = {
        "pixels of another size": tulip_pb2.EmbedRequest(pixels=good[:-3], images=1),
        "pixels without a count": tulip_pb2.EmbedRequest(pixels=good),
        "both ids and pixels": tulip_pb2.EmbedRequest(pixels=good, images=1, token_ids=b"\0\0\0\0", lengths=[1]),
        "a sparse output": tulip_pb2.EmbedRequest(pixels=good, images=1, outputs=[tulip_pb2.OUTPUT_SPARSE]),
        "dimensions past the width": tulip_pb2.EmbedRequest(pixels=good, images=1, dimensions=17),
    }
    with grpc.insecure_channel(target) as ch:
        stub = tulip_pb2_grpc.TulipStub(ch)
        for name, req in bad.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        reply = stub.Embed(tulip_pb2.EmbedRequest(pixels=good * 2, images=2,
                                                  priority=tulip_pb2.PRIORITY_BATCH), timeout=30)
        assert list(reply.shape) == [2, 16] and reply.prompt_tokens == 2 * 17  # each image: 16 patches + class token


def test_a_text_only_model_refuses_images():
    info = tulip_pb2.InfoReply(model="all-MiniLM-L6-v2", embedding_dim=384, image_size=0)
    with pytest.raises(ValueError, match="embeds text only"):
        parse_images(tulip_pb2.EmbedRequest(pixels=b"\0" * 12, images=1), info, 17)
    with pytest.raises(OptionError):
        info.image_size = 2
        parse_images(tulip_pb2.EmbedRequest(pixels=b"\0" * 12, images=1,
                                            encoding=tulip_pb2.ENCODING_INT8), info, 17)
    assert Options.from_proto(tulip_pb2.EmbedRequest(pixels=b"\0" * 12, images=1)).is_default()


def test_ivy_to_tulip_images_and_texts_in_one_space(clip_tulip, ivy):
    """The whole path: a real Ivy before the real Tulip; Jina's items mixed (a PNG and a JPEG as data URIs, a
    text): each image's vector is transformers' `get_image_features` of what its processor makes of the same
    file, the text's `get_text_features` of the ids Ivy's tokenizer makes, rows in input order."""
    _, ref, processor, _ = clip_tulip
    pictures = images(3)[:2]
    files = [encode(pictures[0], "PNG"), encode(pictures[1], "JPEG", quality=90)]
    body = {"input": [{"image": data_uri(files[0], "png")}, {"text": "abc"}, {"image": data_uri(files[1], "jpeg")}]}
    r = httpx.post(ivy + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 200, r.text
    got = np.array([row["embedding"] for row in r.json()["data"]])
    tokens = httpx.post(ivy + "/v1/tokenize", json={"input": "abc"}, timeout=30).json()["data"][0]["tokens"]
    values = processor(images=decoded(files), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want_img = F.normalize(ref.get_image_features(pixel_values=values).pooler_output, dim=-1).numpy()
        want_txt = F.normalize(ref.get_text_features(input_ids=torch.tensor([tokens])).pooler_output, dim=-1).numpy()
    np.testing.assert_allclose(got[[0, 2]], want_img, atol=1e-4)
    np.testing.assert_allclose(got[1], want_txt[0], atol=1e-4)


def decoded(files: list[bytes]) -> list:
    from PIL import Image

    return [Image.open(io.BytesIO(f)).convert("RGB") for f in files]


def test_siglip_texts_through_ivy_equal_the_processors_max_length_padding(served, ivy):
    """SigLIP's texts, from Ivy's tokenizer through Tulip, are `get_text_features(**processor(text=...,
    padding="max_length"))` on the same weights (cosine >= 0.9999), not the unpadded texts' (the last position
    is another token); /v1/tokenize shows the padded ids; an image through the same model is in the same space."""
    _, ref, d = served[0]["siglip"]
    texts = ["abc", "a bad cab jig", "j", "bad " * 9]
    picture = encode(images(4)[0], "PNG")
    body = {"model": "siglip", "input": [{"text": t} for t in texts] + [{"image": data_uri(picture, "png")}]}
    r = httpx.post(ivy + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 200, r.text
    got = torch.tensor([row["embedding"] for row in r.json()["data"]])
    assert r.json()["usage"]["prompt_tokens"] == len(texts) * 40 + 16  # texts padded to 40; 16 patches
    tokens = httpx.post(ivy + "/v1/tokenize", json={"model": "siglip", "input": texts}, timeout=30).json()["data"]
    processor = AutoProcessor.from_pretrained(d)
    inputs = processor(text=texts, padding="max_length", return_tensors="pt")
    assert [t["tokens"] for t in tokens] == inputs["input_ids"].tolist() and list(inputs) == ["input_ids"]
    with torch.no_grad():
        want = ref.get_text_features(**inputs).pooler_output
        bare = torch.cat([ref.get_text_features(**processor(text=[t], return_tensors="pt")).pooler_output
                          for t in texts])
        pixels = processor(images=decoded([picture]), return_tensors="pt")["pixel_values"]
        want_img = ref.get_image_features(pixel_values=pixels).pooler_output
    assert F.cosine_similarity(got[:4], want).min() >= 0.9999
    assert F.cosine_similarity(got[:4], bare).min() < 0.99
    assert F.cosine_similarity(got[4:], want_img).item() >= 0.9999


def test_siglip1_tokenizer_from_spiece_model_through_ivy(served, siglip1, ivy):
    """A SigLIP 1 directory (spiece.model, SiglipTokenizer, no tokenizer.json: trellis.spiece) through Ivy: the
    ids /v1/tokenize shows are SiglipProcessor's with padding="max_length" (canonicalised: case, punctuation,
    spaces, a literal </s>), and the vectors `get_text_features` of them (cosine >= 0.9999)."""
    _, ref, _ = served[0]["siglip"]
    _, processor = siglip1
    texts = ["A photo of a BAD cab!", "  jig,  fig;   hide... ", "?!", "Ab</s> CaFe", "déjà vu — ﬁg ½"]
    r = httpx.post(ivy + "/v1/embeddings", json={"model": "siglip1", "input": texts}, timeout=30)
    assert r.status_code == 200, r.text
    got = torch.tensor([row["embedding"] for row in r.json()["data"]])
    tokens = httpx.post(ivy + "/v1/tokenize", json={"model": "siglip1", "input": texts}, timeout=30).json()["data"]
    inputs = processor(text=texts, padding="max_length", return_tensors="pt")
    assert [t["tokens"] for t in tokens] == inputs["input_ids"].tolist()
    assert len({tuple(t["tokens"]) for t in tokens}) == len(texts)
    with torch.no_grad():
        want = ref.get_text_features(input_ids=inputs["input_ids"]).pooler_output
    assert F.cosine_similarity(got, want).min() >= 0.9999


def test_sentence_transformers_older_clip_layout_through_ivy(served, ivy):
    """sentence-transformers' older CLIP layout (sentence-transformers/clip-ViT-B-32's: the checkpoint, its
    tokenizer.json and processor config in 0_CLIPModel/): Ivy tokenizes with that folder's tokenizer, applies the
    root's prompts and preprocesses images with that folder's processor; vectors equal transformers' features of
    the same weights (sentence-transformers' encode of this layout is the same: tests/test_models_clip.py)."""
    _, ref, old = served[0]["st_clip_0"]
    picture = encode(images(5)[0], "PNG")
    body = {"model": "st_clip_0", "input": [{"text": "abc"}, {"image": data_uri(picture, "png")}]}
    r = httpx.post(ivy + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 200, r.text
    q = httpx.post(ivy + "/v1/embeddings", json={"model": "st_clip_0", "input": "bad", "input_type": "query"},
                   timeout=30)
    assert q.status_code == 200, q.text
    got = torch.tensor([row["embedding"] for row in r.json()["data"] + q.json()["data"]])
    tok = CLIPTokenizerFast.from_pretrained(old / "0_CLIPModel")
    processor = CLIPProcessor.from_pretrained(old / "0_CLIPModel")
    with torch.no_grad():
        want_txt = torch.cat([ref.get_text_features(**tok([t], return_tensors="pt")).pooler_output
                              for t in ("abc", "a bad")])
        pixels = processor(images=decoded([picture]), return_tensors="pt")["pixel_values"]
        want_img = ref.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(got, F.normalize(torch.cat([want_txt[:1], want_img, want_txt[1:]]), dim=-1),
                               atol=1e-4, rtol=0)


def test_image_steps_fit_the_largest_image_graph():
    """A step of more images than the largest image graph would run eagerly on CUDA (16,384 // 197 = 83 images
    against CLIP ViT-B/16's 64-image graph): the image queue's budget is that graph's, the text queue keeps its own."""
    import types

    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop

    engine = types.SimpleNamespace(device=torch.device("cuda"), spec=types.SimpleNamespace(special_token_ids=()),
                                   sparse_rows=False, image_size=224, image_tokens=197, image_batch=64)
    loop = EngineLoop(engine, TulipConfig(max_batch_tokens=16384))
    assert (loop.images.max_batch_tokens, loop.scheduler.max_batch_tokens) == (64 * 197, 16384)
    engine.image_batch = 0  # no image graphs (CPU): the budget
    assert EngineLoop(engine, TulipConfig(max_batch_tokens=16384)).images.max_batch_tokens == 16384
