"""Images through Tulip (issue 51): a real Tulip process serving a tiny random CLIP (saved by transformers) takes
image requests (EmbedRequest `pixels` + `images`) from grpcio's own client and from trellis.client, answers
vectors equal to transformers' `get_image_features` (and text ones to `get_text_features`, in the same space),
keeps text and image steps apart while both kinds are queued, and refuses malformed image requests with
INVALID_ARGUMENT while it keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizerFast

from tests.conftest import Proc, free_port, http_status
from tests.imagecases import data_uri, encode
from tests.test_models_clip import EOS, SIZE, TEXT, VISION, images, processed, vocab_files
from trellis.client import TulipClient
from trellis.options import Options, OptionError
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.messages import parse_images


@pytest.fixture(scope="module")
def clip_tulip(tmp_path_factory):
    """(target, transformers' model, its image processor): one Tulip serving a tiny CLIP on the CPU."""
    root = tmp_path_factory.mktemp("clip_tulip")
    torch.manual_seed(1)
    ref = CLIPModel(CLIPConfig(text_config={**TEXT, "eos_token_id": EOS, "bos_token_id": 0, "pad_token_id": EOS},
                               vision_config=VISION, projection_dim=16)).eval()
    d = root / "clip"
    ref.save_pretrained(d)
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    processor.save_pretrained(d)
    CLIPTokenizerFast(*vocab_files(root)).save_pretrained(d)
    port = free_port()
    # a small step budget: a request of 5 images (17 tokens each) spans several steps
    proc = Proc(["-m", "tulip", "--model", str(d), "--port", str(port), "--device", "cpu", "--max-batch-tokens", "40",
                 "--max-queued-tokens", "4000"], root)
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    yield f"127.0.0.1:{port}", ref, processor, d
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


def test_ivy_to_tulip_images_and_texts_in_one_space(clip_tulip, tmp_path):
    """The whole path: a real Ivy before the real Tulip; Jina's items mixed (a PNG and a JPEG as data URIs, a
    text): each image's vector is transformers' `get_image_features` of what its processor makes of the same
    file, the text's `get_text_features` of the ids Ivy's tokenizer makes, rows in input order."""
    target, ref, processor, d = clip_tulip
    pictures = images(3)[:2]
    files = [encode(pictures[0], "PNG"), encode(pictures[1], "JPEG", quality=90)]
    port = free_port()
    ivy = Proc(["-m", "ivy", "--model", str(d), "--tulip", target, "--port", str(port)], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ivy.wait_for(lambda: http_status(url + "/ready") == 200, timeout=60)
        body = {"input": [{"image": data_uri(files[0], "png")}, {"text": "abc"}, {"image": data_uri(files[1], "jpeg")}]}
        r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200, r.text
        got = np.array([row["embedding"] for row in r.json()["data"]])
        ids = httpx.post(url + "/v1/tokenize", json={"input": "abc"}, timeout=30).json()
    finally:
        ivy.stop()
    from PIL import Image
    import io

    decoded = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    values = processor(images=decoded, return_tensors="pt")["pixel_values"]
    tokens = ids["data"][0]["tokens"] if "data" in ids else ids["tokens"]
    with torch.no_grad():
        want_img = F.normalize(ref.get_image_features(pixel_values=values).pooler_output, dim=-1).numpy()
        want_txt = F.normalize(ref.get_text_features(input_ids=torch.tensor([tokens])).pooler_output, dim=-1).numpy()
    np.testing.assert_allclose(got[[0, 2]], want_img, atol=1e-4)
    np.testing.assert_allclose(got[1], want_txt[0], atol=1e-4)
