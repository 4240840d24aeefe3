"""Ivy's tokenizer: the fast path (ivy.native, Ivy's own C encoders) is token-exact against `tokenizers`
on the same tokenizer.json: Unigram for the XLM-R-like stand-in of the bge-m3 preset, WordPiece for
all-MiniLM-L6-v2 (the texts they cannot decide go to `tokenizers` itself)."""

import asyncio
import json
import random
import string

import numpy as np
import pytest
from tokenizers import Tokenizer

from ivy.tokenizer import TextTokenizer
from ivy.tokenizer_texts import EDGE_CASES, SENTENCES
from presets import standin
from tests.sentences import SENTENCES as MORE_SENTENCES

try:
    from ivy.native import library

    library()
except ImportError as e:  # no C compiler here
    pytest.skip(f"ivy/native.c cannot be built: {e}", allow_module_level=True)


def varied_texts() -> list[str]:
    """Edge cases, real sentences, and generated text in every language of the stand-in's corpus."""
    gen = [standin.sample_text(k, seed, (lang,)) for seed, (lang, k) in
           enumerate((lang, k) for lang in standin.LANGS for k in (1, 6))]
    gen += [standin.sample_text(30, 100 + s, tuple(standin.LANGS)) for s in range(4)]
    return EDGE_CASES + SENTENCES + MORE_SENTENCES + gen


@pytest.fixture(scope="module")
def minilm_dir():
    from trellis.modelref import resolve_model_path

    return resolve_model_path("default")


def reference(path, max_len=None) -> Tokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    if max_len:
        tok.enable_truncation(max_len)
    return tok


def test_standin_is_xlm_r_shaped(standin_dir):
    spec = json.loads((standin_dir / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "Unigram" and spec["model"]["unk_id"] == 3
    assert len(spec["model"]["vocab"]) == 250002
    assert [t for t, _ in spec["model"]["vocab"][:4]] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert spec["model"]["vocab"][-1][0] == "<mask>"
    assert [n["type"] for n in spec["normalizer"]["normalizers"]] == ["Precompiled", "Replace"]
    assert spec["pre_tokenizer"]["type"] == "Metaspace"
    tok = reference(standin_dir)
    enc = tok.encode("Hello wörld, ﬁne")
    assert enc.ids[0] == 0 and enc.ids[-1] == 2 and enc.tokens[1].startswith("\u2581")
    assert "fi" in "".join(enc.tokens)  # the NFKC charsmap took the ligature apart
    text = standin.sample_text(40, 1, ("en",))
    assert 3.0 < len(text) / len(tok.encode(text).ids) < 5.5  # XLM-R-like characters per token


def test_standin_sentencepiece_model(standin_dir):
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    sp = spm.SentencePieceProcessor(model_file=str(standin_dir / "sentencepiece.bpe.model"))
    tok = reference(standin_dir)
    assert sp.get_piece_size() == 250000 and (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    for i in (3, 4, 1000, 123456, 249999):  # fairseq's offset: model piece i is token i + 1
        assert tok.id_to_token(i + 1) == sp.id_to_piece(i)
    for text in ("Hello world", "Die Katze sitzt auf der Matte.", "東京は日本の首都です。"):
        assert [0, *(i + 1 if i else 3 for i in sp.encode(text)), 2] == tok.encode(text).ids
    # the shipped charsmap is SentencePiece's own nmt_nfkc rule
    import io

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a b c ab abc bc ca"] * 20), model_writer=buf,
                                   vocab_size=8, model_type="unigram", normalization_rule_name="nmt_nfkc",
                                   minloglevel=2)
    m = pb.ModelProto()
    m.ParseFromString(buf.getvalue())
    assert m.normalizer_spec.precompiled_charsmap == standin.nmt_nfkc_charsmap()


def test_fast_path_is_token_exact_on_the_standin(standin_dir):
    texts = varied_texts() + [standin.sample_text(200, 7, tuple(standin.LANGS))]  # and one over 4,000 tokens
    tt = TextTokenizer(standin_dir, 8192, 1 << 30)
    assert tt.backend == "native"
    ref = reference(standin_dir)
    got = tt._encode(texts, False)
    for text, ids in zip(texts, got):
        assert ids.dtype == np.int32 and ids.tolist() == ref.encode(text).ids, repr(text[:80])
    # truncation: content cut so that the specials still fit, as tokenizers' truncation does
    short = TextTokenizer(standin_dir, 24, 1 << 30)
    ref24 = reference(standin_dir, 24)
    for text, ids in zip(texts, short._encode(texts, True)):
        assert ids.tolist() == ref24.encode(text).ids, repr(text[:80])


def test_reranker_preset_pairs_as_xlm_r(standin_dir):
    """bge-reranker-v2-m3's directory (the stand-in beside bge-m3's): a transformers classifier with the
    tokenizer's 8192 limit and no sentence-transformers files; a pair is XLM-R's `<s> q </s></s> d </s>`,
    every token type 0, as SentencePiece's pieces in fairseq's numbering and transformers' AutoTokenizer
    (what sentence-transformers' CrossEncoder uses) give it, and as Ivy sends it."""
    from transformers import AutoTokenizer

    from rose.models import model_class
    from trellis.modeldir import ModelSpec
    from presets import RANDOM_WEIGHTS, materialize

    spm = pytest.importorskip("sentencepiece")
    path = materialize("bge-reranker-v2-m3")
    assert (path / RANDOM_WEIGHTS).is_file()
    assert not any((path / f).exists() for f in ("modules.json", "1_Pooling", "sentence_bert_config.json"))
    spec = ModelSpec.read(path)
    assert (spec.model_type, spec.max_seq_len, spec.hidden_size) == ("xlm-roberta", 8192, 1024)
    assert model_class(spec).num_labels(spec.config) == 1
    sp = spm.SentencePieceProcessor(model_file=str(path / "sentencepiece.bpe.model"))
    hf = AutoTokenizer.from_pretrained(str(path))
    assert hf.model_max_length == 8192
    tt = TextTokenizer(path, 8192, 1 << 30)
    query = "Wie hoch ist der Eiffelturm?"
    docs = ["The Eiffel tower is 330 metres tall.", "東京は日本の首都です。", standin.sample_text(5, 3, ("fr", "ru"))]
    seqs, starts = asyncio.run(tt.encode_pairs(query, docs, False))
    assert starts == [0, 0, 0] and tt.pair_boundary

    def pieces(text):
        return [i + 1 if i else 3 for i in sp.encode(text)]

    for d, ids in zip(docs, seqs):
        assert ids.tolist() == [0, *pieces(query), 2, 2, *pieces(d), 2]
        enc = hf(query, d, return_token_type_ids=True)
        assert enc["input_ids"] == ids.tolist() and set(enc["token_type_ids"]) == {0}


def test_minilm_wordpiece_is_exact_natively_and_by_tokenizers_elsewhere(minilm_dir, tmp_path):
    """WordPiece: the native encoder takes ASCII text (random printable and control characters, every
    punctuation mark, words split into pieces or unknown, over-long words) and the BMP characters its
    table covers, `tokenizers` the rest."""
    tt = TextTokenizer(minilm_dir, 256, 1 << 30)
    assert tt.backend == "native" and tt.fast.native.kind == "WordPiece"
    ref = reference(minilm_dir)
    rng = random.Random(3)
    alphabet = string.printable + "\x00\x01\x0b\x0c\x1f\x7f" + "aaaeeeiiootn" * 4
    ascii_texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(1500)]
    ascii_texts += ["x" * 99 + " " + "y" * 101, "unaffable Unaffable UNAFFABLE supercalifragilistic",
                    "don't stop-believing!!! (really?) e-mail: a.b@c.d $100 #1 ~/path_to/file",
                    "[CLS] starts [SEP] here [MASK] [UNK] [PAD]", "x[CLS]y [ cls ]"]
    texts = ascii_texts + varied_texts()
    tt.fast.native.fallbacks = 0  # not the load's own check
    for _ in range(2):  # the second time from the remembered words
        for text, ids in zip(texts, tt._encode(texts, False)):
            assert ids.tolist() == ref.encode(text).ids, repr(text)
        # handed to tokenizers: the texts holding an added token, and some (not all) non-ASCII ones
        assert sum("[CLS]" in t for t in texts) <= tt.fast.native.fallbacks < sum(not t.isascii() for t in texts)
        tt.fast.native.fallbacks = 0
    short = TextTokenizer(minilm_dir, 16, 1 << 30)
    ref16 = reference(minilm_dir, 16)
    for text, ids in zip(texts, short._encode(texts, True)):
        assert ids.tolist() == ref16.encode(text).ids, repr(text)
    from tokenizers import models, pre_tokenizers

    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.save(str(tmp_path / "tokenizer.json"))
    assert TextTokenizer(tmp_path, 64, 1 << 30).backend == "tokenizers"
    with pytest.raises(ValueError, match="native cannot serve .*BPE model"):
        TextTokenizer(tmp_path, 64, 1 << 30, backend="native")


def test_backend_can_be_chosen(standin_dir):
    assert TextTokenizer(standin_dir, 512, 1 << 30, backend="tokenizers").backend == "tokenizers"
    assert TextTokenizer(standin_dir, 512, 1 << 30, backend="native").backend == "native"
    with pytest.raises(ValueError, match="backend must be"):
        TextTokenizer(standin_dir, 512, 1 << 30, backend="fast")


def test_large_batch_lets_the_loop_run(standin_dir):
    """Over offload_chars the fast encoder works in slices and the event loop runs between them."""
    tt = TextTokenizer(standin_dir, 8192, 1000)
    texts = [standin.sample_text(20, s, ("en", "de")) for s in range(40)]
    ticks = []

    async def main():
        async def ticker():
            while True:
                ticks.append(1)
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks.clear()
        seqs = await tt.encode(texts, False)
        task.cancel()
        return seqs

    seqs = asyncio.run(main())
    assert len(ticks) >= 3
    assert [s.tolist() for s in seqs] == [s.tolist() for s in tt._encode(texts, False)]


def test_one_long_text_goes_to_a_thread_not_the_event_loop(standin_dir, monkeypatch):
    """The fast encoder holds the GIL and can only yield between texts, so one text over YIELD_CHARS would stall
    every other request on the worker: such a batch is encoded in a thread (a text over SEGMENT_CHARS
    a segment at a time, ivy.tokenizer_long: the XLM-R stand-in's cuts are exact)."""
    import asyncio

    from ivy import tokenizer as tkz

    tt = TextTokenizer(standin_dir, 8192, 1000)
    assert tt.backend == "native"
    text = "the long document keeps going " * 2000  # 60,000 characters
    monkeypatch.setattr(tt, "_encode_yielding", lambda *a: (_ for _ in ()).throw(AssertionError("on the loop")))
    threads = []
    real = asyncio.to_thread

    async def spy(fn, *a):
        threads.append(fn.__name__)
        return await real(fn, *a)

    monkeypatch.setattr(tkz.asyncio, "to_thread", spy)
    got = asyncio.run(tt.encode([text, "short"], truncate=True))
    assert threads == ["_long"]
    assert [len(g) for g in got] == [8192, len(tt.truncating.encode("short").ids)]
    assert got[0].tolist() == tt.truncating.encode(text).ids


# --- ivy.native's Unigram, Ivy's own encoder ---------------------------------------------------------

TRICKY = [
    string.ascii_letters, string.digits + string.punctuation, " ", "  ", "\t\n\r\n\r", "\u2581",
    "éèêëàâäôöüçñßÅ", "\u0300\u0301\u0302\u0308\u0323\u0338\u034f", "ﬁﬂ①½™…\u00a0\u3000ＡｂＣ１\u2126\u212b",
    "ｶﾞﾊﾟｱﾞ\u3099\u309a", "\u1100\u1161\u11a8\uac00\ub098", "नमस्ते\u0958\u093c\u094d", "สวัสดีำ\u0e33",
    "مرحبا\u064e\u0650\u0600\ufdfa", "😀👍🏽\u200d❤\ufe0f🇩🇪🇫", "\u200b\u200c\u200d\u2060\ufeff\u00ad\u200f",
    "東京日本語中文", "\x00\x01\x1f\x7f\x85\u2028\u2029", "<>/s", "\U00020000\U000e0041\U0010fffd",
]


def tricky_texts(n: int, seed: int) -> list[str]:
    """Random strings over the characters normalization, pre-tokenization and Viterbi treat
    specially (combining marks beside rewritten characters, graphemes of every size, controls,
    the word mark itself), mixed with the stand-in's own words."""
    rng = random.Random(seed)
    words = [w for ws in standin.lexicons().values() for w in ws[:300]]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.3:
                parts.append(rng.choice(words) + rng.choice(" ,."))
            else:
                pool = rng.choice(TRICKY)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 4))))
        out.append("".join(parts))
    return out


def test_native_unigram_is_token_exact_on_random_tricky_text(standin_dir):
    """Whatever the text, Ivy's encoder and tokenizers agree (the encoder decides, or hands the text
    to tokenizers); and on ordinary text in every script of the stand-in it decides itself."""
    tt = TextTokenizer(standin_dir, 1 << 20, 1 << 30)
    ref = reference(standin_dir)
    texts = tricky_texts(3000, 5)
    for _ in range(2):  # the second time from the remembered words
        for text, ids in zip(texts, tt._encode(texts, False)):
            assert ids.tolist() == ref.encode(text).ids, repr(text)
    assert 0 < tt.fast.native.fallbacks < len(texts)  # some texts are handed back, most are not
    tt.fast.native.fallbacks = 0
    ordinary = [standin.sample_text(8, s, (lang,)) for s, lang in enumerate(standin.LANGS)]
    ordinary += [standin.sample_text(20, 50 + s, tuple(standin.LANGS)) for s in range(20)]
    for text, ids in zip(ordinary, tt._encode(ordinary, False)):
        assert ids.tolist() == ref.encode(text).ids
    assert tt.fast.native.fallbacks == 0


def test_native_unigram_truncates_expands_and_forgets_as_it_should(standin_dir):
    """A budget cuts the content as tokenizers' truncation does; a rewrite far longer than its text
    (U+FDFA: 18 characters) gets the room it needs; a tiny word cache forgets (resets) and stays exact."""
    from ivy.tokenizer import FastEncoder
    from ivy.native import NativeEncoder

    ref = reference(standin_dir)
    fast = FastEncoder(standin_dir / "tokenizer.json", ref)
    fast.native = NativeEncoder(standin_dir / "tokenizer.json", (fast.prefix, fast.suffix), cache_bits=4)
    texts = [standin.sample_text(3, s, ("en", "ru", "zh")) for s in range(60)] + ["\ufdfa " * 40, "\ufdfa" * 40]
    for t, ids in zip(texts, fast.ids_many(texts)):
        assert ids.tolist() == ref.encode(t).ids, repr(t[:40])
    stats = fast.native.stats()
    assert stats["resets"] > 0 and stats["hits"] > 0 and stats["fallbacks"] == 0, stats
    for budget in (0, 1, 7):
        cut = reference(standin_dir, budget + 2)
        for t, ids in zip(texts, fast.ids_many(texts, budget)):
            assert ids.tolist() == cut.encode(t).ids


def test_native_is_built_on_first_use_and_missed_without_a_compiler(standin_dir, monkeypatch, tmp_path, caplog):
    """Nothing built yet: the first use compiles it into the cache directory; with no working
    compiler Ivy says why and tokenizes with tokenizers."""
    import ivy.native as native

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "built_name", lambda: "native-test.so")
    native.library.cache_clear()
    try:
        assert TextTokenizer(standin_dir, 512, 1 << 30).backend == "native"
        assert (tmp_path / "ivy" / "native-test.so").is_file()
        native.library.cache_clear()
        monkeypatch.setattr(native, "built_name", lambda: "native-none.so")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        with caplog.at_level("INFO", logger="ivy.tokenizer"):
            assert TextTokenizer(standin_dir, 512, 1 << 30).backend == "tokenizers"
        assert "no-such-cc" in caplog.text
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("model", ["preset:bge-reranker-v2-m3", "default"])
def test_native_pairs_are_the_pair_template_and_longest_first_truncation(model):
    """A cross-encoder's (query, document) pairs from the native encoder: each text alone, cut as
    tokenizers' LongestFirst cuts a pair, put in the pair template (XLM-R's all-0 types; BERT's type 1
    from B on), equal to tokenizers' own pair encoding at several maximum lengths."""
    from trellis.modelref import resolve_model_path

    path = resolve_model_path(model)
    rng = random.Random(11)
    texts = varied_texts() + tricky_texts(100, 2) + [standin.sample_text(rng.randint(1, 20), s, ("en",)) for s in range(60)]
    pairs = [(rng.choice(texts), rng.choice(texts)) for _ in range(400)]
    # tokenizers' own LongestFirst cut of long pairs to 9 tokens costs it ~60 ms a pair: 100 pairs there
    for max_len, n in ((9, 100), (24, 400), (77, 400), (512, 400)):
        tt = TextTokenizer(path, max_len, 1 << 30)
        assert tt.backend == "native" and tt._pair_wrap is not None
        for truncate in (False, True):
            ref = reference(path, max_len if truncate else None)
            seqs, starts = tt._pairs(pairs[:n], truncate)
            for (q, d), ids, start in zip(pairs, seqs, starts):
                e = ref.encode(q, d)
                assert ids.tolist() == e.ids, (q[:30], d[:30], max_len, truncate)
                assert start == (e.type_ids.index(1) if 1 in e.type_ids else 0)


def test_native_wordpiece_covers_each_bmp_character_it_claims_exactly(minilm_dir):
    """Every non-ASCII BMP character the WordPiece table derives (dropped, a space, a word of its own,
    part of a word: ~56,000), inside and beside words, as tokenizers encodes it."""
    from ivy.native import wordpiece_table

    tt = TextTokenizer(minilm_dir, 1 << 20, 1 << 30)
    ref = reference(minilm_dir)
    cls = np.frombuffer(wordpiece_table(True, True, True)[0], np.uint8)
    covered = [chr(c) for c in range(0x80, 0x10000) if cls[c]]
    assert len(covered) > 50_000
    texts = [f"a{ch}b {ch}{ch}.{ch}É" for ch in covered]
    tt.fast.native.fallbacks = 0
    got = tt._encode(texts, False)
    assert tt.fast.native.fallbacks == 0
    for text, ids in zip(texts, got):
        assert ids.tolist() == ref.encode(text).ids, (repr(text), hex(ord(text[1])))
