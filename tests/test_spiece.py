"""SigLIP 1's tokenizer from spiece.model alone (trellis.spiece, issue 51) against transformers' slow
`SiglipTokenizer` on the same SentencePiece model (trained here with `sentencepiece`, its default nmt_nfkc
charsmap): the same ids, default settings, padding off, on thousands of varied texts (mixed case, punctuation,
Unicode that NFKC rewrites, combining marks, whitespace runs of every kind, literal special tokens, empty, very
long); what Ivy's TextTokenizer and ModelSpec read of such a directory; what is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trellis import spiece
from trellis.modeldir import ModelSpec

SYLLABLES = "ka ri to me su na lo pe qu zi ba de fo gu hi ja ke lu mo ni pa re sa ti vu wa xe yo ze".split()
# words the model learns beside the syllables: cased, accented, Greek (final sigma), CJK, NFKC-rewritten forms
EXTRA = ("Hello World café naïve Ünïcode 東京 日本語 straße ΟΔΟΣ σοφία οδος İstanbul résumé <tag> e-mail U.S.A. "
         "don't 3.14 100% #1 @home ½ ﬁne Ⅻ ＡＢＣ").split()


def train_spiece(path: Path, lines: list[str], vocab_size: int) -> None:
    """A SentencePiece Unigram model with T5's (and SigLIP's) special ids: <pad> 0, </s> 1, <unk> 2, no <s>."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path.with_suffix("")),
                                   vocab_size=vocab_size, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, character_coverage=0.995, minloglevel=2, num_threads=1)


def corpus(rng: random.Random, n: int) -> list[str]:
    def word():
        if rng.random() < 0.15:
            return rng.choice(EXTRA)
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
    return [" ".join(word() for _ in range(rng.randint(3, 12))) for _ in range(n)]


BITS = ["Hello", "WORLD", "café", "naïve", "東京", "straße", "ΟΔΟΣ", "Σ", "ΑΣ.", "İstanbul", "ﬁne", "½", "Ⅻ", "ＡＢＣ",
        "¨", "a\u0301", "\u0338", "ϕﾟ", "Ａ\u0301", "e-mail", "U.S.A.", "don't", "3.14", "#1", "<tag>", "</s>", "<unk>",
        "</S>", "<UNK>", "<pad>", "＜／ｓ＞", "\u2581", "\u2581\u2581x", "\U0001F600", "\u200b", "\ufeff", "ǅ", "\ua7cb",
        "K", "ﬃ", "™", "…"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u1680", "\u2000", "\u2028",
          "\u3000", "\u180e", "\u200b", ""]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["«", "»", "—", "¿", "・"]


def texts(rng: random.Random, n: int) -> list[str]:
    """`n` varied texts: syllable words, the bits above, random code points (Latin, Greek, kana, fullwidth), cased
    and titled, punctuation glued on, every kind of whitespace between; a few fixed edge cases first."""
    def word():
        r = rng.random()
        if r < 0.5:
            w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        elif r < 0.8:
            w = rng.choice(BITS)
        else:
            w = "".join(chr(rng.choice([rng.randint(32, 0x2FF), rng.randint(0x370, 0x3FF), rng.randint(0x3000, 0x30FF),
                                        rng.randint(0xFF00, 0xFFEF)])) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            w = w.upper() if rng.random() < 0.5 else w.title()
        return w + (rng.choice(PUNCT) if rng.random() < 0.2 else "")

    def text():
        t = "".join(word() + rng.choice(SPACES + [" "] * 10) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 40])))
        return (rng.choice(SPACES) if rng.random() < 0.2 else "") + t

    fixed = ["", " ", "\u2581", "</s>", "a</s>", "a </s> ", "x</s></s>", " </s>hello", "</s>\u0338x", "x\u200b</s>\u200b",
             "东 </s>", "ΟΔΟΣ ΟΔΟΣ.", "</S>", "＜／ｓ＞", "a ＜ｐａｄ＞ b", "ϕﾟ", "kari " * 3000]
    return fixed + [text() for _ in range(n)]


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory) -> Path:
    """A SigLIP 1 tokenizer directory as transformers saves one: spiece.model and tokenizer_config.json."""
    from transformers import SiglipTokenizer

    d = tmp_path_factory.mktemp("siglip1")
    train_spiece(d / "spiece.model", corpus(random.Random(0), 4000), 500)
    SiglipTokenizer(str(d / "spiece.model")).save_pretrained(d)
    assert not (d / "tokenizer.json").exists()
    return d


def test_ids_equal_siglip_tokenizer(siglip_dir):
    """Thousands of varied texts: trellis.spiece's ids are SiglipTokenizer's (default settings, padding off), each
    text alone and in one batch."""
    from transformers import SiglipTokenizer

    ref = SiglipTokenizer.from_pretrained(siglip_dir)
    ours = spiece.load(siglip_dir)
    assert isinstance(ours, spiece.Canonical)
    cases = texts(random.Random(1), 3000)
    want = [ref(t)["input_ids"] for t in cases]
    got = [e.ids for e in ours.encode_batch_fast(cases)]
    bad = [(t, w, g) for t, w, g in zip(cases, want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(cases)} differ, e.g. {bad[0]}"
    assert [ours.encode(t).ids for t in cases[:200]] == want[:200]
    # the ids SigLIP's processor pads: eos last, unknown characters as <unk>, "</S>" not the special token
    assert ours.encode("ΟΔΟΣ").ids[-1] == 1 and ours.encode("</S>").ids != ours.encode("</s>").ids
    # without the special tokens: the content (a literal eos kept, as SiglipTokenizer's tokenize keeps it)
    assert ours.encode("a</s>", add_special_tokens=False).ids == ours.encode("a</s>").ids
    assert ours.encode("a b", add_special_tokens=False).ids == ours.encode("a b").ids[:-1]
    pair = ours.encode("a", "b")
    assert pair.ids == ref("a", "b")["input_ids"] and pair.sequence_ids.count(1) == len(ref("b")["input_ids"]) - 1
    assert ours.decode(ours.encode("Hello, World!").ids) == "hello world"


def test_charsmap_is_sentencepieces_normaliser(siglip_dir):
    """The charsmap read from the proto normalises as SentencePiece does (its `normalize`), where `tokenizers`'
    Precompiled (a whole grapheme looked up) does not: "ϕﾟ"."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(siglip_dir / "spiece.model"))
    ours = spiece.Charsmap(spiece.read_model(siglip_dir / "spiece.model"))
    for t in texts(random.Random(2), 300):
        assert ours.normalize(t) == sp.normalize(t), t


def test_ivy_reads_the_directory(siglip_dir, tmp_path):
    """ModelSpec (pad token, special ids) and Ivy's TextTokenizer (texts padded to the text positions with the pad
    token, tokenizers' backend; native refused) from spiece.model; other spiece.model directories keep the error."""
    import asyncio

    from ivy.tokenizer import TextTokenizer
    from transformers import SiglipTokenizer

    d = tmp_path / "m"
    d.mkdir()
    for f in siglip_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps({"model_type": "siglip", "text_config": {
        "vocab_size": 500, "max_position_embeddings": 16}}))
    spec = ModelSpec.read(d)
    assert (spec.max_seq_len, spec.pad_to, spec.pad_id, spec.pad_left, spec.special_token_ids) == (16, 16, 1, False,
                                                                                                    (1, 2))
    tok = TextTokenizer.for_model(spec, 1 << 20)
    got = asyncio.run(tok.encode(["Hello, World!", "kari " * 40], truncate=True))
    ref = SiglipTokenizer.from_pretrained(d)
    assert got[0].tolist() == ref("Hello, World!", padding="max_length", max_length=16)["input_ids"]
    assert got[1].tolist() == ref("kari " * 40, truncation=True, max_length=16)["input_ids"]
    with pytest.raises(ValueError, match="native cannot serve"):
        TextTokenizer.for_model(spec, 1 << 20, backend="native")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "T5Tokenizer"}))
    with pytest.raises(ValueError, match="no tokenizer.json .*SiglipTokenizer only"):
        TextTokenizer.for_model(ModelSpec.read(d), 1 << 20)


def test_models_it_cannot_reproduce_are_refused(tmp_path):
    """A BPE SentencePiece model, a special token outside the vocabulary, a file that is no proto: a ValueError
    naming why (Ivy does not start), not wrong ids."""
    import sentencepiece as spm

    d = tmp_path / "bpe"
    d.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus(random.Random(3), 500)), model_prefix=str(d / "spiece"),
                                   vocab_size=120, model_type="bpe", minloglevel=2, num_threads=1)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "SiglipTokenizer"}))
    with pytest.raises(ValueError, match="not Unigram"):
        spiece.load(d)
    train_spiece(d / "spiece.model", corpus(random.Random(3), 500), 120)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "SiglipTokenizer", "pad_token": "<PAD>"}))
    with pytest.raises(ValueError, match="'<PAD>' is not a piece"):
        spiece.load(d)
    (d / "spiece.model").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        spiece.load(d)
