"""An XLM-RoBERTa-like stand-in tokenizer, built offline in about a second, no download.

A 250,000-piece SentencePiece Unigram vocabulary harvested from a generated multilingual corpus:
seeded lexicons of syllable-built words in a dozen scripts (Latin with and without diacritics,
Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai, Hangul, kana, CJK ideographs) with Zipf
frequencies; every substring of every word (with SentencePiece's "▁" word mark) is counted with
its word's frequency, the most frequent substrings (and every character) become pieces, scored
with their log relative frequency. That is the shape of SentencePiece's own seed vocabulary, and
close enough to XLM-R's for tokenization cost: ~4 characters per token on Latin-script text, long
pieces for frequent words, short ones for rare words, single characters and <unk> at the edges.

It is written as XLM-R's converted `tokenizer.json` is (Precompiled NFKC charsmap + collapsed
spaces, Metaspace, Unigram, `<s> $A </s>`; <s>=0 <pad>=1 </s>=2 <unk>=3 ... <mask>=250001) and as
the matching SentencePiece model `sentencepiece.bpe.model` (piece i of the model is token i+1 of
tokenizer.json, <unk> 0 is 3, as in fairseq / XLM-R). The normalizer is SentencePiece's own
`nmt_nfkc` charsmap (`nmt_nfkc.charsmap.gz` beside this file: the trainer's bytes).
"""

from __future__ import annotations

import functools
import gzip
import math
import random
import shutil
import string
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

PIECES = 250_000  # SentencePiece model size: <unk> <s> </s> + 249,997 pieces (tokenizer.json: 250,002)
SEED = 14
WB = "\u2581"  # SentencePiece's word boundary mark
SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
CHARSMAP = Path(__file__).with_name("nmt_nfkc.charsmap.gz")


def _chars(a: int, b: int) -> list[str]:
    return [chr(c) for c in range(a, b + 1)]


_LATIN_C = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp st str th tr".split()
# (onsets, nuclei, codas, weight, words, max syllables, joined without spaces)
LANGS = {
    "en": (_LATIN_C + ["wh", "qu", "y"], "a e i o u ea ee ai ou oo ie y".split(),
           ["", "", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck", "rt", "nt", "ll", "ss", "d", "m", "ght"],
           0.34, 30000, 4, False),
    "de": (_LATIN_C + ["sch", "z", "pf", "kn"], "a e i o u ä ö ü ei au ie eu".split(),
           ["", "", "n", "r", "s", "t", "ch", "sch", "ng", "ß", "tz", "ck", "en", "er"], 0.08, 14000, 4, False),
    "fr": (_LATIN_C + ["gn", "qu"], "a e i o u é è ê à ou ai eau oi".split(),
           ["", "", "", "s", "nt", "r", "x", "t", "l", "c"], 0.07, 12000, 4, False),
    "es": (_LATIN_C + ["ll", "ñ"], "a e i o u á é í ó ú ue ie".split(),
           ["", "", "", "s", "n", "r", "l", "z", "d"], 0.07, 12000, 4, False),
    "pl": (_LATIN_C + ["sz", "cz", "rz", "ż", "ś", "ć", "ł", "dź"], "a e i o u y ą ę ó".split(),
           ["", "", "ł", "k", "ń", "ść", "m", "ż"], 0.03, 8000, 4, False),
    "vi": ("b c d đ g h k l m n p r s t v x ch gh kh ng nh ph th tr".split(),
           list("aàáảãạăằắẳẵặâầấẩẫậeèéẻẽẹêềếểễệiìíỉĩịoòóỏõọôồốổỗộơờớởỡợuùúủũụưừứửữựyỳýỷỹỵ"),
           ["", "", "n", "ng", "nh", "c", "ch", "t", "m", "p", "i", "u", "o"], 0.03, 8000, 1, False),
    "ru": ("б в г д ж з к л м н п р с т ф х ц ч ш щ пр ст тр св".split(), "а е и о у ы э ю я ё".split(),
           ["", "", "й", "н", "т", "ст", "ь", "л", "м", "р", "в"], 0.09, 16000, 4, False),
    "el": ("β γ δ ζ θ κ λ μ ν ξ π ρ σ τ φ χ ψ".split(), "α ε η ι ο υ ω ά έ ή ί ό ύ ώ ου αι ει".split(),
           ["", "", "ς", "ν", "ρ", "σ"], 0.03, 7000, 4, False),
    "ar": ("ب ت ث ج ح خ د ذ ر ز س ش ص ض ط ظ ع غ ف ق ك ل م ن ه و ي".split(), ["", "ا", "و", "ي", "ة"],
           ["", "", "ن", "م", "ت", "ال"], 0.05, 10000, 3, False),
    "he": ("ב ג ד ה ז ח ט כ ל מ נ ס ע פ צ ק ר ש ת".split(), ["", "ו", "י", "א"], ["", "ם", "ן", "ת", "ה"],
           0.02, 5000, 3, False),
    "hi": ("क ख ग घ च छ ज झ ट ठ ड ढ त थ द ध न प फ ब भ म य र ल व श ष स ह क्ष त्र".split(),
           ["", "ा", "ि", "ी", "ु", "ू", "े", "ै", "ो", "ौ"], ["", "", "ं", "्", "र", "न"], 0.04, 9000, 3, False),
    "th": (_chars(0x0E01, 0x0E2E), ["", "า", "ิ", "ี", "ุ", "ู", "ั", "ำ", "เ", "แ"], ["", "", "่", "้", "ง", "น"],
           0.02, 5000, 3, True),
    "ko": (_chars(0xAC00, 0xAC00 + 2349), [""], [""], 0.04, 9000, 3, False),
    "ja": (_chars(0x3041, 0x3093) + _chars(0x30A1, 0x30F3), [""], [""], 0.04, 9000, 4, True),
    "zh": ([chr(0x4E00 + (i * 7919) % 20902) for i in range(3000)], [""], [""], 0.05, 12000, 2, True),
}
PUNCT = list(".,:;!?()[]{}\"'-–—/%&*+=<>@#$€£¥§°«»¿¡…·、。，！？「」『』（）") + ["'s", "n't", "...", "://", "www", ".com"]
EMOJI = list("😀😂🤣😊😍🙏👍🔥❤✨🎉🍕🍣🚀⭐✅❌💡📈")


def _lexicon(rng: random.Random, lang: str) -> list[str]:
    onsets, nuclei, codas, _, n, max_syl, _ = LANGS[lang]
    words: dict[str, None] = {}
    while len(words) < n:  # drawn in bulk: a few draws per word would take seconds
        m = 2 * n
        ks = rng.choices(range(1, max_syl + 1), weights=range(max_syl, 0, -1), k=m)
        o, v, c = (rng.choices(x, k=sum(ks)) for x in (onsets, nuclei, codas))
        syl = [a + b + z for a, b, z in zip(o, v, c)]
        at = 0
        for k in ks:
            words.setdefault("".join(syl[at:at + k]))
            at += k
    # frequent words are short: rank by length, with noise
    return sorted((w for w in words if w), key=lambda w: len(w) + 6 * rng.random())[:n]


@functools.lru_cache(maxsize=1)
def lexicons() -> dict[str, list[str]]:
    """Each language's words, most frequent first (one build per process: do not modify)."""
    rng = random.Random(SEED)
    return {lang: _lexicon(rng, lang) for lang in LANGS}


LONGEST, SHORT, LONG_RANKS = 16, 6, 4096  # substring lengths counted for a language's frequent / other words


def _zipf(rank: int) -> float:
    return 1.0 / (rank + 8) ** 1.05


def vocabulary(size: int = PIECES) -> list[tuple[str, float]]:
    """(piece, log-probability) for the `size` - 3 normal pieces, most frequent first."""
    counts: dict[str, float] = {}
    get = counts.get
    chars: set[str] = set(PUNCT) | set(EMOJI) | set(string.ascii_letters + string.digits)
    for lang, words in lexicons().items():
        weight, joined = LANGS[lang][3], LANGS[lang][6]
        scale = weight / sum(_zipf(r) for r in range(len(words)))
        chars.update(*words)
        lo = 0
        while lo < len(words):  # rank bands [2^k, 2^k+1): one weight per band, counted at C speed
            hi = min(max(2 * lo, 1), len(words))
            band = [WB + w for w in words[lo:hi]]
            f = sum(_zipf(r) for r in range(lo, hi)) / (hi - lo) * scale
            longest = LONGEST if lo < LONG_RANKS else SHORT  # a rare word's long substrings would be cut
            subs: Counter = Counter()
            for n in range(2, longest + 1):  # one length at a time: list comprehensions, fastest in CPython
                subs.update([s[i:i + n] for s in band for i in range(len(s) - n + 1)])
            subs.update([s for s in band if len(s) > longest])
            if joined:  # no spaces between words: pieces also start inside a run of words
                subs.update(s[1:] for s in band)
            else:  # a capitalised form (sentence starts, names)
                caps = [WB + s[1].upper() + s[2:] for s in band if s[1] != s[1].upper()]
                chars.update(s[1] for s in caps)
                for c in caps:
                    subs[c] += 0.15
            for piece, k in subs.items():
                counts[piece] = get(piece, 0.0) + k * f
            lo = hi
    for i, p in enumerate(PUNCT + [str(d) for d in range(100)] + [str(y) for y in range(1900, 2050)]):
        for q in (p, WB + p):
            counts[q] = get(q, 0.0) + 0.002 / (i + 1) ** 0.5
    for c in sorted(chars):  # every character is a piece (as in SentencePiece's character coverage)
        counts[c] = get(c, 0.0) + 1e-7
        counts[WB + c] = get(WB + c, 0.0) + 1e-8
    counts[WB] = get(WB, 0.0) + 0.01
    must = chars | {WB}
    for c in must:
        counts[c] += 1.0  # kept whatever the cut (scored below from their corpus count)
    n_keep = size - 3
    values = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
    cut = np.partition(values, len(values) - n_keep)[len(values) - n_keep]
    keep = sorted(((p, f) for p, f in counts.items() if f >= cut), key=lambda kv: (-kv[1], kv[0]))[:n_keep]
    keep = [(p, f - 1.0 if p in must else f) for p, f in keep]
    total = sum(f for _, f in keep)
    # A seeded jitter of +-0.5 % keeps pieces of one rank band from tying exactly (EM-trained scores
    # rarely do); scores as float32 values: SentencePiece keeps float32, tokenizers float64.
    return [(p, float(np.float32(math.log(f / total) * (1 + (zlib.crc32(p.encode()) % 1001 - 500) * 1e-5))))
            for p, f in keep]


def nmt_nfkc_charsmap() -> bytes:
    """SentencePiece's `nmt_nfkc` precompiled charsmap (XLM-R's normalizer), from the copy beside
    this file (tests/test_tokenizer.py checks it against the sentencepiece trainer's)."""
    return gzip.decompress(CHARSMAP.read_bytes())


def write_tokenizer_json(path: Path, vocab: list[tuple[str, float]], charsmap: bytes) -> None:
    """XLM-R's converted tokenizer.json over `vocab` (tokens 4 .. 250000), <mask> last."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [(t, 0.0) for t in SPECIALS] + vocab + [("<mask>", 0.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=SPECIALS["<unk>"], byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Precompiled(charsmap),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WB, prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement=WB, prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS]
                           + [AddedToken("<mask>", special=True, lstrip=True, normalized=False)])
    tok.save(str(path))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values take ten bytes, as protobuf writes them
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value) -> bytes:
    """One protobuf field: bytes / str (length-delimited), float (32-bit), int / bool (varint)."""
    if isinstance(value, (bytes, str)):
        data = value.encode() if isinstance(value, str) else value
        return _varint(number << 3 | 2) + _varint(len(data)) + data
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    return _varint(number << 3) + _varint(int(value))


def spm_model_bytes(vocab: list[tuple[str, float]], charsmap: bytes) -> bytes:
    """The vocabulary as a serialised SentencePiece ModelProto (Unigram; <unk>=0 <s>=1 </s>=2, then
    `vocab`), written by hand so that no protobuf module is needed."""
    trainer = b"".join(_field(n, v) for n, v in ((3, 1), (4, PIECES), (22, True), (35, False),
                                                  (40, 0), (41, 1), (42, 2), (43, -1)))
    normalizer = b"".join(_field(n, v) for n, v in ((1, "nmt_nfkc"), (2, charsmap), (3, True), (4, True), (5, True)))
    kinds = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)] + [(p, sc, 1) for p, sc in vocab]
    scores = np.array([sc for _, sc, _ in kinds], dtype="<f4").tobytes()
    out = []
    for i, (p, _, k) in enumerate(kinds):
        b = p.encode()
        if len(b) < 100:  # lengths of one byte: the field bytes written directly (a second instead of 0.2)
            out.append(b"\n%c\n%c%s\x15%s\x18%c" % (len(b) + 9, len(b), b, scores[4 * i:4 * i + 4], k))
        else:
            out.append(_field(1, _field(1, b) + _field(2, float(kinds[i][1])) + _field(3, k)))
    return b"".join(out) + _field(2, trainer) + _field(3, normalizer)


FILES = ("tokenizer.json", "sentencepiece.bpe.model")
_built: list[Path] = []  # a directory this process has built the stand-in in


def build(directory: Path) -> None:
    """Write tokenizer.json and sentencepiece.bpe.model into `directory` (copied where this process
    has built them before)."""
    for done in _built:
        if all((done / f).is_file() for f in FILES) and done != directory:
            for f in FILES:
                shutil.copyfile(done / f, directory / f)
            return
    vocab = vocabulary()
    charsmap = nmt_nfkc_charsmap()
    write_tokenizer_json(directory / "tokenizer.json", vocab, charsmap)
    (directory / "sentencepiece.bpe.model").write_bytes(spm_model_bytes(vocab, charsmap))
    _built[:] = [directory]


def sample_text(sentences: int, seed: int = 0, langs: tuple[str, ...] = ("en",)) -> str:
    """Seeded text in the corpus's languages (Zipf-drawn words, sentences with punctuation), for
    benchmarks and tests."""
    rng = random.Random(seed)
    lex = lexicons()
    out: list[str] = []
    while len(out) < sentences:
        lang = rng.choice(langs)
        ws, joined = lex[lang], LANGS[lang][6]
        n = rng.randint(5, 18)
        top = math.log(len(ws))
        ranks = [int(math.exp(rng.random() * top)) - 1 for _ in range(n)]  # P(rank) ~ 1 / rank (Zipf)
        sent = [ws[r] for r in ranks]
        sent[0] = sent[0][:1].upper() + sent[0][1:]
        if rng.random() < 0.3:
            sent.insert(rng.randrange(len(sent)), str(rng.randint(1, 2049)))
        if rng.random() < 0.3:
            k = rng.randrange(1, len(sent))
            sent[k - 1] += ","
        out.append(("" if joined else " ").join(sent) + rng.choice([".", ".", ".", "?", "!"]))
    return " ".join(out)
