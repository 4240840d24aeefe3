"""Ivy's tokenizer: the fast path (tokie) is token-exact against `tokenizers` on the same tokenizer.json,
for the XLM-R-like stand-in of the bge-m3 preset; all-MiniLM-L6-v2 (WordPiece) is served by the
fallback, `tokenizers` itself, because tokie differs from it there (shown below)."""

import asyncio
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from ivy.tokenizer import FastEncoder, TextTokenizer
from ivy.tokenizer_texts import EDGE_CASES, SENTENCES
from trellis import standin
from tests.sentences import SENTENCES as MORE_SENTENCES

tokie = pytest.importorskip("tokie")


def varied_texts() -> list[str]:
    """Edge cases, real sentences, and generated text in every language of the stand-in's corpus."""
    gen = [standin.sample_text(k, seed, (lang,)) for seed, (lang, k) in
           enumerate((lang, k) for lang in standin.LANGS for k in (1, 6))]
    gen += [standin.sample_text(30, 100 + s, tuple(standin.LANGS)) for s in range(4)]
    return EDGE_CASES + SENTENCES + MORE_SENTENCES + gen


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    from trellis.presets import materialize

    old = os.environ.get("TRELLIS_CACHE")
    os.environ["TRELLIS_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield materialize("bge-m3")
    finally:
        if old is None:
            os.environ.pop("TRELLIS_CACHE")
        else:
            os.environ["TRELLIS_CACHE"] = old


@pytest.fixture(scope="module")
def minilm_dir():
    from trellis.modeldir import resolve_model_path

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
    assert tt.backend == "tokie"
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
    from trellis.presets import RANDOM_WEIGHTS, materialize

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


def test_minilm_is_served_by_the_fallback(minilm_dir):
    """WordPiece: the fast path does not apply, and would not be exact (tokie leaves out the [UNK]s of
    private-use and unassigned characters that tokenizers gives), so tokenizers serves it."""
    tt = TextTokenizer(minilm_dir, 256, 1 << 30)
    assert tt.backend == "tokenizers" and tt.fast is None
    ref = reference(minilm_dir)
    texts = varied_texts()
    for text, ids in zip(texts, tt._encode(texts, False)):
        assert ids.tolist() == ref.encode(text).ids
    fast = FastEncoder(minilm_dir / "tokenizer.json", ref)
    assert fast.mismatches(ref, EDGE_CASES)  # the reason: forcing it is refused
    with pytest.raises(ValueError, match="tokie cannot serve"):
        TextTokenizer(minilm_dir, 256, 1 << 30, backend="tokie")


def test_backend_can_be_chosen(standin_dir):
    assert TextTokenizer(standin_dir, 512, 1 << 30, backend="tokenizers").backend == "tokenizers"
    assert TextTokenizer(standin_dir, 512, 1 << 30, backend="tokie").backend == "tokie"
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


def test_fast_encoder_reloads_and_stays_exact(standin_dir, monkeypatch):
    """tokie's memory grows with every new word: Ivy replaces it with a fresh copy every RELOAD_CHARS."""
    import ivy.tokenizer as it

    tt = TextTokenizer(standin_dir, 8192, 1 << 30)
    first = tt.fast.tok
    monkeypatch.setattr(it, "RELOAD_CHARS", 500)
    texts = [standin.sample_text(3, s, ("en", "ru")) for s in range(10)]
    got = tt._encode(texts, False)
    assert tt.fast.tok is not first
    ref = reference(standin_dir)
    assert [g.tolist() for g in got] == [ref.encode(t).ids for t in texts]


def test_one_long_text_goes_to_a_thread_not_the_event_loop(standin_dir, monkeypatch):
    """tokie holds the GIL and can only yield between texts, so one text over YIELD_CHARS would stall
    every other request on the worker: such a batch is encoded by `tokenizers` (the same tokens) in
    a thread."""
    import asyncio

    from ivy import tokenizer as tkz

    tt = TextTokenizer(standin_dir, 8192, 1000)
    assert tt.backend == "tokie"
    text = "the long document keeps going " * 2000  # 60,000 characters
    monkeypatch.setattr(tt, "_encode_yielding", lambda *a: (_ for _ in ()).throw(AssertionError("on the loop")))
    threads = []
    real = asyncio.to_thread

    async def spy(fn, *a):
        threads.append(fn.__name__)
        return await real(fn, *a)

    monkeypatch.setattr(tkz.asyncio, "to_thread", spy)
    got = asyncio.run(tt.encode([text, "short"], truncate=True))
    assert threads == ["_encode_exact"]
    assert [len(g) for g in got] == [8192, len(tt.truncating.encode("short").ids)]
    assert got[0].tolist() == tt.truncating.encode(text).ids
