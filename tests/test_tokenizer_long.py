"""Long texts a segment at a time (ivy/tokenizer_long.py, issue 47 fault 9): the cut rule derived from
each tokenizer's normalizer and pre-tokenizer gives the whole text's ids and offsets, against
`tokenizers` on the whole text, for the XLM-R Unigram stand-in of bge-m3 / bge-reranker-v2-m3 (through
Ivy's native encoder too), BERT's WordPiece (the default MiniLM), Metaspace's prepend schemes, GPT-2's
and Qwen's byte-level BPE; tokenizers it cannot vouch for get no rule."""

import random

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ivy.tokenizer import TextTokenizer
from ivy.tokenizer_long import SPACE_LED, CutRule, cut_rule, scan, segments
from ivy.tokenizer_texts import EDGE_CASES, SENTENCES
from presets import standin

QWEN = sorted(SPACE_LED, key=len)[1]  # Qwen2 / Qwen3's pattern ({1,3}-less \p{N})
# what is hard at a cut: runs of blanks, newlines, tabs, characters XLM-R's charsmap maps to a space or
# to nothing (U+FFFD, zero-width space, controls), NBSP / ideographic spaces, a mark on a space, a
# Prepend character, an added token, CJK / Thai without spaces
GLUE = [" ", " ", " ", "  ", "   ", " \n ", "\n", "\n\n", "\t", " \t ", "\r\n", " \u3000 ", "\u00a0 ", "\ufffd ",
        " \ufffd ", "\u200b ", " \u200b\u200b ", "\x00 ", "\x7f ", " \u0301", "\u0600 ", "x\u0600 ", "a\u0301 ",
        "\u037a ", " <mask> ", "<s> ", " .", "' ", "'s ", "1 2 ", "\u2028 ", "\ufeff "]
WORDS = [w for s in SENTENCES + EDGE_CASES for w in s.split(" ") if w] + [
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059" * 3, "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35" * 5, "x" * 120]


def long_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        while sum(map(len, parts)) < 6000:
            parts.append(rng.choice(WORDS))
            parts.append(rng.choice(GLUE) if rng.random() < 0.5 else " ")
        out.append("".join(parts))
    out.append(" ".join(SENTENCES * 20))
    out.append("   " + "  \n ".join(EDGE_CASES) + "  ")
    return out


def load(path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # MiniLM's tokenizer.json pads to 128
    return tok


def content_of(tok: Tokenizer):
    return lambda t: np.asarray(tok.encode(t, add_special_tokens=False).ids, dtype=np.int32)


def assert_exact(tok: Tokenizer, texts: list[str], sizes=(7, 100, 1500)) -> None:
    """Every text cut by the tokenizer's rule at several segment sizes: the segments' ids are the whole
    text's, and so are their offsets, shifted by where each segment starts."""
    rule = cut_rule(tok)
    assert isinstance(rule, CutRule), rule
    content = content_of(tok)
    for text in texts:
        whole = tok.encode(text, add_special_tokens=False)
        for size in sizes:
            cuts = list(segments(text, rule, size))
            assert len(cuts) > 1 and cuts[-1][1] == len(text)
            assert scan(text, content, 1 << 62, rule, size).ids.tolist() == whole.ids, (size, text[:80])
            offsets = [(a + s, b + s) for s, e in cuts for a, b in tok.encode(text[s:e], add_special_tokens=False).offsets]
            assert offsets == whole.offsets, (size, text[:80])


def trained(model: str, norm, pre, texts: list[str]) -> Tokenizer:
    """A small tokenizer trained on `texts` (seconds at most): Unigram or byte-level BPE."""
    if model == "unigram":
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>", "<mask>"],
                                          unk_token="<unk>", show_progress=False)
    else:
        tok = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.decoder = decoders.ByteLevel()
    tok.normalizer, tok.pre_tokenizer = norm, pre
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def bge_m3(standin_dir):
    return standin_dir  # tests/conftest.py's: the bge-m3 preset in the shared cache


@pytest.fixture(scope="module")
def bge_tt(bge_m3):
    return TextTokenizer(bge_m3, 24, 1 << 30)  # one for the module: ~1 s of CPU to build


@pytest.fixture(scope="module")
def corpus():
    rng = random.Random(3)
    return SENTENCES + [standin.sample_text(8, s, ("en", "de", "ru", "zh")) for s in range(40)] + [
        rng.choice(EDGE_CASES) for _ in range(40)]


def test_xlm_r_unigram_presets_segment_exactly(bge_m3, bge_tt):
    """bge-m3's stand-in (bge-reranker-v2-m3 has the same tokenizer.json): Precompiled charsmap,
    Replace(" {2,}"), Metaspace always. The rule before: any space after a non-space, wrong where the
    charsmap maps the character before it to a space (U+FFFD, zero-width spaces); so Ivy tokenized its
    long texts whole. Now exact, with `tokenizers` and with Ivy's native encoder."""
    from presets import materialize

    assert (materialize("bge-reranker-v2-m3") / "tokenizer.json").read_bytes() == (bge_m3 / "tokenizer.json").read_bytes()
    tok = load(bge_m3)
    texts = long_texts(4, 1)
    assert_exact(tok, texts)
    tt = bge_tt
    assert tt.backend == "native" and tt.segmentable and tt.cuts.attach
    for text in texts:
        assert scan(text, tt.content, 1 << 62, tt.cuts, 300).ids.tolist() == tok.encode(text, add_special_tokens=False).ids


def test_bert_wordpiece_segments_exactly(model_path):
    tok = load(model_path)
    assert_exact(tok, long_texts(2, 2))
    assert not cut_rule(tok).attach  # BERT drops whitespace: any space after a non-space is a boundary


@pytest.mark.parametrize("prepend", ["always", "first", "never"])
def test_metaspace_prepend_schemes_segment_exactly(corpus, prepend):
    charsmap = standin.nmt_nfkc_charsmap()
    norm = normalizers.Sequence([normalizers.Precompiled(charsmap), normalizers.Replace(Regex(" {2,}"), " ")])
    tok = trained("unigram", norm, pre_tokenizers.Metaspace(prepend_scheme=prepend, split=True), corpus)
    assert_exact(tok, long_texts(2, 3))
    # without split the model sees the whole text as one word (Viterbi's sums carry across a cut): no rule
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend, split=False)
    assert isinstance(cut_rule(tok), str)


def test_byte_level_bpe_segments_exactly(corpus):
    """GPT-2's layout (ByteLevel with its regex) and Qwen2 / Qwen3's (NFC, Split by its pattern, then
    ByteLevel without a regex): the space belongs to the word after it."""
    gpt2 = trained("bpe", None, pre_tokenizers.ByteLevel(add_prefix_space=False), corpus)
    assert_exact(gpt2, long_texts(2, 4))
    qwen = trained("bpe", normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        corpus)
    assert_exact(qwen, long_texts(2, 5))
    # refused: a pattern it does not know, a byte-level model over the whole text, a stripping normalizer
    for pre, norm in ((pre_tokenizers.Split(Regex(r"\S+ "), "isolated"), None),
                      (pre_tokenizers.ByteLevel(use_regex=False), None),
                      (pre_tokenizers.ByteLevel(), normalizers.Strip())):
        qwen.pre_tokenizer, qwen.normalizer = pre, norm
        assert isinstance(cut_rule(qwen), str)


def test_cuts_in_hostile_texts_stay_linear():
    """8 MiB of characters the charsmap maps to a space, each before a space: every candidate cut is
    refused, each distinct one learned once (the regex then skips them), so cutting costs a regex
    scan, not a Python step per candidate."""
    import time

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace("\ufffd", " ")
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    rule = cut_rule(tok)
    text = "\ufffd " * (4 << 20)
    t0 = time.process_time()
    assert len(list(segments(text, rule))) == len(text) // 65536
    assert time.process_time() - t0 < 2


@pytest.mark.parametrize("which", ["bge-m3", "default"])
def test_truncation_without_a_second_tokenizer_is_tokenizers_own(which, bge_tt, model_path):
    """TextTokenizer cuts single texts and pairs to the maximum itself (fixed templates, LongestFirst),
    instead of parsing tokenizer.json a second time for a truncating Tokenizer at start-up: the same
    ids as `tokenizers` with truncation, over the maximum and under it."""
    path = bge_tt._path if which == "bge-m3" else model_path
    rng = random.Random(7)
    texts = [rng.choice(WORDS) * rng.randint(1, 12) for _ in range(60)] + SENTENCES + EDGE_CASES
    pairs = [(rng.choice(texts), rng.choice(texts)) for _ in range(80)]  # tokenizers' LongestFirst: ~10 ms a pair
    tt = bge_tt if which == "bge-m3" else TextTokenizer(path, 24, 1 << 30)
    assert tt._truncating is None  # not built at start-up
    ref = load(path)
    ref.enable_truncation(24)
    assert [a.tolist() for a in tt._encode_exact(texts, True)] == [e.ids for e in ref.encode_batch(texts)]
    seqs, starts = tt._pairs_exact(pairs, True)
    encs = ref.encode_batch(pairs)
    assert [a.tolist() for a in seqs] == [e.ids for e in encs]
    assert starts == [e.type_ids.index(1) if 1 in e.type_ids else 0 for e in encs]
    assert any(len(e.ids) < 24 for e in encs) and any(len(e.ids) == 24 for e in encs)
