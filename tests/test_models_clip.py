"""CLIP and SigLIP (issue 51) against transformers and sentence-transformers on the same tiny random weights:
text features through `Engine.step` and image features through `Engine.step_images` equal to
`get_text_features` / `get_image_features` after L2 normalisation; the uint8 pixels at the model's size,
normalised on the device, equal to the image processor's float output; sentence-transformers' CLIP layouts
(the checkpoint in the root as sentence-transformers 6 saves it, and the older `0_CLIPModel/` folder) against
its own `encode`; strict loading; the image graphs' state machine on CPU (CUDA calls faked); the presets'
shapes against transformers' models built from their config.json."""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTextConfig, CLIPTokenizerFast,
                          CLIPVisionConfig, SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipTextConfig,
                          SiglipVisionConfig)

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.graphs import GraphConfig, GraphStats
from rose.images import ImageGraphs, ImageProcessing
from rose.models import clip, model_class, siglip
from tests.checkpoints import save_checkpoint
from tests.test_graphs import FakeOps, MaskedAttention
from trellis.modeldir import ModelSpec

SIZE = 32  # the tiny towers' image side (patches of 8: 16 patches)
# a text tower of width 32 (4 heads of 8) and a vision tower of width 48 (4 heads of 12): each tower its own head shape
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=40)
VISION = dict(hidden_size=48, intermediate_size=50, num_hidden_layers=2, num_attention_heads=4, image_size=SIZE,
              patch_size=8)
EOS = 1  # the tiny tokenizer's <|endoftext|>
# token ids: ends with EOS, EOS in the middle (the first counts), no EOS (CLIP: the first token), one token
SEQS = [[0, 5, 7, 9, EOS], [0, 3, EOS, 4, EOS], [0, 4, 4, 4, 4, 60, 6], [0, 12, 98, 30, 2, 17, 40, 8, EOS], [EOS]]


def siglip_tokenizer(d, positions: int, **kw) -> None:
    """A tiny Gemma-style BPE tokenizer saved in `d` as the fixed-resolution SigLIP 2 checkpoints publish theirs
    (transformers' convert_siglip2_to_hf.py: a Gemma tokenizer, no BOS, EOS appended, padding_side "right",
    model_input_names ["input_ids"]: the processor returns no attention mask), model_max_length the text
    positions; `kw` overrides (padding_side)."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5,
             **{c: 6 + i for i, c in enumerate("abcdefghij")}, "\u2581a": 16, "\u2581b": 17}
    GemmaTokenizer(vocab=vocab, merges=[("\u2581", "a"), ("\u2581", "b")], add_bos_token=False, add_eos_token=True,
                   model_input_names=["input_ids"], model_max_length=positions,
                   **{"padding_side": "right", **kw}).save_pretrained(d)


def vocab_files(d):
    """A tiny CLIP BPE tokenizer's vocab.json / merges.txt (start / end of text, ten letters and their word ends)."""
    letters = "abcdefghij"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": EOS, **{c + "</w>": 2 + i for i, c in enumerate(letters)},
             **{c: 12 + i for i, c in enumerate(letters)}}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> (model directory, transformers reference model): CLIP with eos_token_id 1 (transformers' rule since
    PR #24773), CLIP with eos_token_id 2 (the older configs: each text's highest id), SigLIP; the CLIP in
    sentence-transformers' layouts, its root (as sentence-transformers 6 saves it) and `0_CLIPModel/`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel as STCLIPModel

    root = tmp_path_factory.mktemp("towers")
    torch.manual_seed(0)
    out = {}
    ref = CLIPModel(CLIPConfig(text_config={**TEXT, "eos_token_id": EOS, "bos_token_id": 0, "pad_token_id": EOS},
                               vision_config=VISION, projection_dim=16)).eval()
    d = root / "clip"
    ref.save_pretrained(d)
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(d)
    CLIPTokenizerFast(*vocab_files(root)).save_pretrained(d)
    out["clip"] = d, ref
    legacy = root / "clip_eos2"
    shutil.copytree(d, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = 2
    (legacy / "config.json").write_text(json.dumps(cfg))
    out["clip_eos2"] = legacy, CLIPModel.from_pretrained(legacy).eval()
    # SigLIP's text head projects to the vision tower's width (projection_size), so both share one space
    ref = SiglipModel(SiglipConfig(text_config={**TEXT, "projection_size": VISION["hidden_size"]},
                                   vision_config=VISION)).eval()
    d = root / "siglip"
    ref.save_pretrained(d)
    SiglipImageProcessor(size={"height": SIZE, "width": SIZE}).save_pretrained(d)
    siglip_tokenizer(d, TEXT["max_position_embeddings"])
    out["siglip"] = d, ref
    st = SentenceTransformer(modules=[STCLIPModel(str(root / "clip"))], device="cpu")
    st.save(str(root / "st_clip"))
    out["st_clip"] = root / "st_clip", st
    # the older layout: the checkpoint in 0_CLIPModel/, modules.json naming it (sentence-transformers/clip-ViT-B-32)
    old = root / "st_clip_0"
    (old / "0_CLIPModel").mkdir(parents=True)
    for f in (root / "st_clip").iterdir():
        if f.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            shutil.copy(f, old / "0_CLIPModel" / f.name)
    shutil.copy(root / "st_clip" / "config_sentence_transformers.json", old)
    (old / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "0_CLIPModel",
                                                   "type": "sentence_transformers.models.CLIPModel"}]))
    out["st_clip_0"] = old, SentenceTransformer(str(old), device="cpu")
    return out


@pytest.fixture(scope="module")
def engines(dirs):
    return {name: Engine(EngineConfig(model=str(d), device="cpu")) for name, (d, _) in dirs.items()}


def images(seed=0):
    """Random PIL images of several sizes, aspect ratios and modes, as a caller would send them."""
    rng = np.random.default_rng(seed)
    out = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 50), (64, 32), (33, 33))]
    out.append(Image.fromarray(rng.integers(0, 256, (45, 45), dtype=np.uint8), mode="L").convert("RGB"))
    out.append(Image.fromarray(rng.integers(0, 256, (70, 90, 4), dtype=np.uint8), mode="RGBA").convert("RGB"))
    return out


def processed(processor, pictures):
    """(the processor's float pixel_values [N, 3, S, S], the same resized and cropped pixels as uint8 [N, S, S, 3])."""
    values = processor(images=pictures, return_tensors="pt")["pixel_values"]
    raw = processor(images=pictures, return_tensors="pt", do_rescale=False, do_normalize=False)["pixel_values"]
    assert torch.equal(raw.float(), raw.float().round())  # whole values 0..255: what uint8 carries
    return values, raw.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


@pytest.mark.parametrize("name", ["clip", "clip_eos2", "siglip"])
def test_text_features_equal_transformers(dirs, engines, name):
    _, ref = dirs[name]
    out = engines[name].step(Batch.from_sequences(SEQS)).synchronize()
    with torch.no_grad():
        want = torch.cat([ref.get_text_features(input_ids=torch.tensor([s])).pooler_output for s in SEQS])
    assert out.shape == (len(SEQS), engines[name].embedding_dim)
    torch.testing.assert_close(out, F.normalize(want, dim=-1), atol=1e-4, rtol=0)


def test_clip_pools_the_end_of_text_token_as_transformers_does(engines):
    """The two rules pick different rows here (sequence 1 has EOS twice, 2 none): the two engines differ."""
    batch = Batch.from_sequences(SEQS)
    a, b = (engines[n].step(batch).synchronize() for n in ("clip", "clip_eos2"))
    assert (a - b).abs().amax(dim=1).gt(1e-3).sum() >= 3
    ids = torch.tensor([t for s in SEQS for t in s])
    rows = clip.eos_rows(ids, batch.cu_seqlens, batch.seq_ids, EOS).tolist()
    assert rows == [4, 7, 10, 25, 26]  # [0 5 7 9 E] [0 3 E 4 E] [0 4 4 4 4 60 6] (none: its first) [0 .. E] [E]
    assert clip.eos_rows(ids, batch.cu_seqlens, batch.seq_ids, 2).tolist() == [3, 8, 15, 19, 26]  # highest ids


# texts of the tiny Gemma-style tokenizer: short ones, one of 37 tokens (the positions: 40)
SIGLIP_TEXTS = ["abc", "a bad cab jig", "j", "bad " * 9]


@pytest.mark.parametrize("case", ["published", "class default", "tokenizer.json"])
def test_siglip_texts_are_padded_as_its_processor_pads(dirs, engines, tmp_path, case):
    """Ivy's tokenizer pads a SigLIP text as `processor(text=..., padding="max_length")` does, from the model's own
    files: "published" (tokenizer_config.json's padding_side right, as SigLIP 2's converter saves it), "class
    default" (no padding_side saved: GemmaTokenizer's class default, left), "tokenizer.json" (a generic tokenizer
    class naming no pad token or side: the padding tokenizer.json saved, its pad token and direction). The
    processor returns no attention mask (model_input_names), and the engine's vectors of those ids are
    get_text_features' of them; unpadded, they are not (the last position is another token)."""
    from transformers import AutoProcessor

    from ivy.tokenizer import TextTokenizer

    src, ref = dirs["siglip"]
    d = tmp_path / "siglip"
    shutil.copytree(src, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if case == "class default":
        del cfg["padding_side"]
    elif case == "tokenizer.json":
        del cfg["padding_side"], cfg["pad_token"]
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok = json.loads((d / "tokenizer.json").read_text())
        tok["padding"] = {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None, "pad_id": 3,
                          "pad_type_id": 0, "pad_token": "<unk>"}
        (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.read(d)
    assert (spec.pad_to, spec.max_seq_len, spec.pad_left) == (40, 40, case != "published")
    ids = asyncio.run(TextTokenizer.for_model(spec, 1 << 20).encode(SIGLIP_TEXTS, False))
    inputs = AutoProcessor.from_pretrained(d)(text=SIGLIP_TEXTS, padding="max_length")
    assert list(inputs) == ["input_ids"]  # no attention mask: get_text_features reads the pads
    assert [s.tolist() for s in ids] == inputs["input_ids"]
    assert {s[0 if spec.pad_left else -1] for s in inputs["input_ids"][:3]} == {3 if case == "tokenizer.json" else 0}
    out = engines["siglip"].step(Batch.from_sequences([s.tolist() for s in ids])).synchronize()
    with torch.no_grad():
        want = F.normalize(ref.get_text_features(input_ids=torch.tensor(inputs["input_ids"])).pooler_output, dim=-1)
        bare = torch.cat([ref.get_text_features(input_ids=torch.tensor([t])).pooler_output
                          for t in AutoProcessor.from_pretrained(d)(text=SIGLIP_TEXTS)["input_ids"]])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)
    assert F.cosine_similarity(F.normalize(bare, dim=-1), want).min() < 0.99


def test_only_siglip_pads(dirs):
    """CLIP pools its end-of-text token (pads would not change it): not padded; the 0_CLIPModel/ layout's prompts
    are its root's config_sentence_transformers.json's."""
    for name in ("clip", "st_clip", "st_clip_0"):
        assert ModelSpec.read(dirs[name][0]).pad_to == 0
    d = dirs["st_clip_0"][0]
    root = json.loads((d / "config_sentence_transformers.json").read_text())
    assert ModelSpec.read(d).prompts == root["prompts"]


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_image_features_equal_transformers(dirs, engines, name):
    d, ref = dirs[name]
    processor = (CLIPImageProcessor if name == "clip" else SiglipImageProcessor).from_pretrained(d)
    values, pixels = processed(processor, images())
    engine = engines[name]
    assert engine.image_size == SIZE and engine.image_tokens == 16 + (name == "clip")
    # uint8 at the model's size, rescaled and normalised on the device, is the processor's float output
    x = pixels.permute(0, 3, 1, 2).float()
    tower = engine.images
    torch.testing.assert_close((x * tower.processing.rescale - tower._mean) / tower._std, values, atol=1e-6, rtol=0)
    out = engine.step_images(pixels).synchronize()
    with torch.no_grad():
        want = F.normalize(ref.get_image_features(pixel_values=values).pooler_output, dim=-1)
    assert out.dtype == torch.float32 and out.shape == (len(values), engine.embedding_dim)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)
    one = engine.step_images(pixels[2:3]).synchronize()  # a batch's images do not see each other
    torch.testing.assert_close(one[0], out[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["st_clip", "st_clip_0"])
def test_sentence_transformers_clip_layouts(dirs, engines, name):
    """Both layouts read (the root's processor_config.json, or 0_CLIPModel/'s), against sentence-transformers'
    own encode of texts (tokenized by the model's tokenizer) and of images."""
    d, st = dirs[name]
    engine = engines[name]
    spec = ModelSpec.read(d)
    assert spec.path == (d / "0_CLIPModel" if name == "st_clip_0" else d) and spec.model_type == "clip"
    assert engine.images.processing.source.endswith("processor_config.json")
    texts = ["abc", "a bad cab", "jig"]
    tok = CLIPTokenizerFast.from_pretrained(spec.path)
    out = engine.step(Batch.from_sequences(tok(texts)["input_ids"])).synchronize()
    torch.testing.assert_close(out, F.normalize(torch.as_tensor(st.encode(texts)), dim=-1), atol=1e-4, rtol=0)
    pictures = images(1)
    _, pixels = processed(CLIPImageProcessor.from_pretrained(spec.path), pictures)
    out = engine.step_images(pixels).synchronize()
    want = F.normalize(torch.as_tensor(st.encode(pictures)), dim=-1)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)


def test_strict_loading(dirs, tmp_path):
    """A checkpoint missing one tensor (the projection) or carrying an unknown one is refused at load."""
    src = dirs["clip"][0]
    for case in ("missing", "unknown"):
        d = tmp_path / case
        shutil.copytree(src, d)
        tensors = load_file(d / "model.safetensors")
        if case == "missing":
            del tensors["visual_projection.weight"]
        else:
            tensors["vision_model.extra.weight"] = torch.zeros(2)
        save_file(tensors, d / "model.safetensors")
        with pytest.raises(ValueError, match="missing tensors for: \\['visual_projection.weight'\\]"
                           if case == "missing" else "unexpected tensors: \\['vision_model.extra.weight'\\]"):
            Engine(EngineConfig(model=str(d), device="cpu"))


def test_bad_pixels_and_text_only_models(engines, tmp_path):
    engine = engines["clip"]
    for bad in (torch.zeros(2, SIZE, SIZE, 3), torch.zeros(2, SIZE + 1, SIZE, 3, dtype=torch.uint8),
                torch.zeros(2, 3, SIZE, SIZE, dtype=torch.uint8), torch.zeros(0, SIZE, SIZE, 3, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=f"pixels must be uint8 \\[N >= 1, {SIZE}, {SIZE}, 3\\]"):
            engine.step_images(bad)
    text_only = Engine(EngineConfig(model=str(save_checkpoint("bert", tmp_path / "bert")[0]), device="cpu"))
    assert text_only.image_size == 0 and text_only.image_tokens == 0
    with pytest.raises(ValueError, match="bert has no image tower"):
        text_only.step_images(torch.zeros(1, SIZE, SIZE, 3, dtype=torch.uint8))


def test_image_processing_settings(tmp_path):
    """preprocessor_config.json's flags and a final size that is not the tower's."""
    d = tmp_path
    (d / "preprocessor_config.json").write_text(json.dumps({"do_normalize": False, "do_rescale": False,
                                                            "size": {"height": 32, "width": 32}}))
    p = ImageProcessing.read(d, 32, clip.OPENAI_CLIP)
    assert (p.rescale, p.mean, p.std) == (1.0, (0.0,) * 3, (1.0,) * 3)
    (d / "preprocessor_config.json").write_text(json.dumps({"crop_size": 224, "size": 256, "image_mean": 0.5}))
    with pytest.raises(ValueError, match="makes 224 x 224 pixels; the vision tower takes 32 x 32"):
        ImageProcessing.read(d, 32, clip.OPENAI_CLIP)
    (d / "preprocessor_config.json").unlink()
    p = ImageProcessing.read(d, 32, siglip.SIGLIP_IMAGES)  # none: the processor's defaults
    assert (p.mean, p.std, p.source) == ((0.5,) * 3, (0.5,) * 3, "")


def test_tower_defaults_are_transformers(dirs):
    import transformers

    from trellis.modeldir import LEFT_PADDING_CLASSES, PADDED_TEXT

    for ours, theirs in ((clip.TEXT_DEFAULTS, CLIPTextConfig()), (clip.VISION_DEFAULTS, CLIPVisionConfig()),
                         (siglip.TEXT_DEFAULTS, SiglipTextConfig()), (siglip.VISION_DEFAULTS, SiglipVisionConfig())):
        assert ours == {k: getattr(theirs, k) for k in ours}, type(theirs).__name__
    assert PADDED_TEXT == {"siglip": SiglipTextConfig().max_position_embeddings}
    classes = [getattr(transformers, n, None) for n in sorted(LEFT_PADDING_CLASSES)]
    assert all(c is None or c.padding_side == "left" for c in classes) and transformers.GemmaTokenizer in classes


def test_image_graphs_state_machine_on_cpu(engines):
    """Buckets of image counts (3 images: the bucket of 4), cold -> eager -> captured -> replayed, equal to the
    eager step; more images than the largest bucket fall back; stats counted in the runner's GraphStats."""
    engine = engines["siglip"]
    tower = engine.images
    pixels = torch.randint(0, 256, (9, SIZE, SIZE, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    eager = tower.step(pixels).synchronize().clone()
    plans = []

    class Runner:
        ops, stats, cfg = FakeOps(), GraphStats(), GraphConfig(ring=2)

    saved = tower.attention
    tower.attention = MaskedAttention()  # capturable on CPU
    tower.attention.prepare = lambda key, cu, n: plans.append((key, cu.tolist(), n))
    tower.graphs = ImageGraphs(tower, Runner, max_images=8)
    try:
        for i in range(3):
            out = tower.step(pixels[:3]).synchronize()
            torch.testing.assert_close(out, eager[:3], atol=1e-5, rtol=0)
        s = Runner.stats
        assert (s.keys, s.eager, s.captures, s.replays) == (1, 1, 1, 2)
        key = plans[0][0]
        assert (key.seqs, key.tokens, key.max_len, key.extras) == (4, 64, 16, frozenset({"image"}))
        assert plans[0][1:] == ([0, 16, 32, 48, 64], 64)
        torch.testing.assert_close(tower.step(pixels[:8]).synchronize(), eager[:8], atol=1e-5, rtol=0)
        assert tower.graphs.step(pixels) is None and s.oversize == 1  # 9 > 8: the eager step takes it
        torch.testing.assert_close(engine.step_images(pixels).synchronize(), eager, atol=1e-5, rtol=0)
    finally:
        tower.attention, tower.graphs = saved, None


@pytest.mark.parametrize("preset,hf,tokens,dim", [("clip-vit-base-patch16", CLIPModel, 197, 512),
                                                  ("siglip-base-patch16-224", SiglipModel, 196, 768)])
def test_presets_have_the_real_shapes(preset, hf, tokens, dim):
    """The preset directory read as the engine reads it, its parameters (built on the meta device) the same count
    as transformers' model built from the same config.json, its preprocessor_config.json read by transformers."""
    from presets import materialize

    d = materialize(preset)
    spec = ModelSpec.read(d)
    family = model_class(spec)
    served = family.serving(spec)
    assert (family.image_size(served.config), family.image_tokens(served.config)) == (224, tokens)
    assert family.output_dim(served.config) == dim and served.normalize
    assert served.max_seq_len == (77 if preset.startswith("clip") else 64)
    with torch.device("meta"):
        ours = sum(p.numel() for p in family(served.config).parameters())
        theirs = sum(p.numel() for n, p in hf(hf.config_class.from_pretrained(d)).named_parameters()
                     if not n.startswith("logit_"))
    assert ours == theirs
    processor = (CLIPImageProcessor if preset.startswith("clip") else SiglipImageProcessor).from_pretrained(d)
    p = ImageProcessing.read(d, 224, family.image_processor)
    assert list(p.mean) == list(processor.image_mean) and list(p.std) == list(processor.image_std)
