"""Ivy's native encoders against `tokenizers`, differentially: the piece scores read to the bit as
`tokenizers` reads them (its serde_json does not round decimals correctly; a score 1 ulp away breaks
Viterbi's exact ties the other way), ties broken by its rule, and ids equal to its ids on fuzzed
unicode (benchmarks.fuzz_native's texts: repeated characters, combining marks, ZWJ sequences, mixed
scripts, whitespace runs, digits, any code point) for the Unigram stand-in of bge-m3 and BERT's
WordPiece (all-MiniLM-L6-v2). Ids only: the native encoders make no offsets (where Ivy answers offsets,
TEI's /tokenize, they are `tokenizers`' own).

A larger run: IVY_FUZZ_TEXTS=N (fuzzed texts per tokenizer; default 3000) also runs the whole
repeated-character class (every single-character piece of the stand-in, 1 to 28 times: 167,580 strings)."""

import json
import os
import random
import struct

import pytest
from tokenizers import Tokenizer

from benchmarks.fuzz_native import fuzz_texts
from ivy.native import read_json, serde_float, serde_int, serde_number, tokenizers_rounds_correctly, unigram_json
from ivy.tokenizer import TextTokenizer
from presets import standin

try:
    from ivy.native import library

    library()
except ImportError as e:  # no C compiler here
    pytest.skip(f"ivy/native.c cannot be built: {e}", allow_module_level=True)

FUZZ = int(os.environ.get("IVY_FUZZ_TEXTS", "0"))


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.fixture(scope="module")
def standin_ref(standin_dir):
    """tokenizers on the stand-in, and its vocabulary as it holds it ((piece, score) pairs)."""
    tok = reference(standin_dir)
    return tok, json.loads(tok.to_str())["model"]["vocab"]


def reference(path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def parsed_by_tokenizers(tok: Tokenizer) -> list[float]:
    """The scores `tokenizers` holds: serialized back by serde_json (shortest round-trip digits), which
    Python's correctly rounded parse turns into the very same doubles."""
    return [s for _, s in json.loads(tok.to_str())["model"]["vocab"]]


def test_every_standin_score_is_read_as_tokenizers_reads_it(standin_dir, standin_ref):
    """All 250,002 scores bit for bit (Python's json: ~26 % of them 1 ulp away)."""
    theirs = [s for _, s in standin_ref[1]]
    ours = [s for _, s in read_json(standin_dir / "tokenizer.json")["model"]["vocab"]]
    assert len(ours) == len(theirs) == 250002
    assert [i for i, (a, b) in enumerate(zip(ours, theirs)) if bits(a) != bits(b)] == []
    assert tokenizers_rounds_correctly() is False  # this tokenizers: serde_json's fast parse (asked at load)
    python = json.loads((standin_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert sum(bits(s) != bits(b) for (_, s), b in zip(python, theirs)) > 50_000  # what the fix is for


def literal(rng: random.Random) -> str:
    """A JSON number of any shape serde_json accepts: long significands (past u64), leading zeros,
    exponents (subnormal, near the range's ends, long), integers (past i64 / u64, -0)."""
    sign = rng.choice(["", "-"])
    kind = rng.randrange(6)
    digits = lambda k: "".join(rng.choice("0123456789") for _ in range(k))
    whole = rng.choice(["0", str(rng.randint(1, 9)) + digits(rng.randint(0, 24))])
    frac = "." + digits(rng.randint(1, 30))
    if kind == 0:  # scores as tokenizer.json files hold them
        return f"{sign}{rng.randint(0, 20)}.{digits(rng.randint(1, 17))}"
    if kind == 1:
        return sign + whole + frac
    if kind == 2:
        return f"{sign}{whole}{frac if rng.random() < 0.7 else ''}{rng.choice('eE')}{rng.choice(['', '+', '-'])}" \
               f"{rng.randint(0, 330)}"
    if kind == 3:  # tiny: subnormals, the division loop of f64_from_parts
        return f"{sign}{whole}{frac}e-{rng.randint(300, 700)}"
    if kind == 4:  # integers, some past i64 / u64 (read as f64 there)
        return sign + rng.choice(["0", str(rng.randint(1, 9)) + digits(rng.randint(0, 25))])
    return f"{sign}0.{'0' * rng.randint(0, 30)}{digits(rng.randint(1, 25))}"


def refused(lit: str) -> bool:
    try:
        serde_number(lit)
    except ValueError:
        return True
    return False


def test_serde_number_is_serde_json_on_random_literals():
    """6,000 random number literals through tokenizers' own loader (as Unigram scores) and through
    ours: the same doubles, bit for bit; each number serde_json refuses (out of range), refused by both."""
    rng = random.Random(3)
    lits = [literal(rng) for _ in range(6000)] + [
        "-0", "0", "-0.0", "18446744073709551615", "18446744073709551616", "-9223372036854775808",
        "-9223372036854775809", "18446744073709551616.5", "1844674407370955161.6e1", "1e-2147483648",
        "0e99999999999", "-1e-99999999999", "4.9e-324", "1.7976931348623157e308", "17976931348623157e292",
        "1e309", "-1.5e400", "1e2147483648", "123456789e99999", "0.1e310", "179769313486231580000e288"]
    bad = [x for x in lits if refused(x)]
    good = [x for x in lits if x not in bad]
    assert len(bad) > 40 and len(good) > 5000
    text = unigram_json(good)
    theirs = parsed_by_tokenizers(Tokenizer.from_str(text))[1:]
    ours = [s for _, s in json.loads(text, parse_float=serde_float, parse_int=serde_int)["model"]["vocab"]][1:]
    wrong = [(lit, a, b) for lit, a, b in zip(good, ours, theirs) if bits(float(a)) != bits(b)]
    assert wrong == [], wrong[:5]
    assert sum(bits(float(x)) != bits(b) for x, b in zip(good, theirs)) > 500  # the literals tell the parses apart
    for lit in bad:
        with pytest.raises(Exception, match="number out of range"):
            Tokenizer.from_str(unigram_json([lit]))


def test_ties_break_as_tokenizers_breaks_them(tmp_path):
    """Exact ties (scores that are sums of each other, exact in binary): the first candidate met wins
    (the earliest start, then the shortest piece from it), natively as in tokenizers."""
    from ivy.tokenizer import FastEncoder

    wb = "\u2581"
    vocab = [(wb, -1.0), ("a", -1.0), ("aa", -2.0), ("aaa", -3.0), (wb + "a", -2.0), ("b", -1.5), ("ab", -2.5),
             ("bab", -4.0), ("ba", -2.5)]
    standin.write_tokenizer_json(tmp_path / "tokenizer.json", vocab, standin.nmt_nfkc_charsmap())
    ref = reference(tmp_path)
    fast = FastEncoder(tmp_path / "tokenizer.json", ref)
    texts = ["".join(random.Random(s).choice("ab") for _ in range(random.Random(s).randint(1, 12))) for s in range(300)]
    for t in texts + ["aaaa", "abab", "babab"]:
        assert fast.ids(t).tolist() == ref.encode(t).ids, t
    assert ref.encode("aaaa").tokens[1:-1] == [wb + "a", "aaa"]  # all ties: the earliest start's shortest piece




def differ(tt: TextTokenizer, ref: Tokenizer, texts: list[str]) -> list[str]:
    got = tt._encode(texts, False)
    return [t for t, ids, e in zip(texts, got, ref.encode_batch(texts)) if ids.tolist() != e.ids]


def test_unigram_ids_equal_tokenizers_on_fuzzed_text(standin_dir, standin_ref):
    """Repeated characters (every digit 1..28 times, where 1 ulp broke ties: "77777"; and a sample of
    the class), then fuzzed unicode; most texts decided by the C itself, not handed back."""
    ref, vocab = standin_ref
    tt = TextTokenizer(standin_dir, 1 << 20, 1 << 30)
    assert tt.backend == "native"
    assert tt._encode(["77777"], False)[0].tolist() == ref.encode("77777").ids == [0, 11543, 11542, 108, 2]
    alphabet = [p for p, _ in vocab if len(p) == 1]
    everything = [c * n for c in alphabet for n in range(1, 29)]
    rng = random.Random(7)
    rep = everything if FUZZ else [d * n for d in "0123456789" for n in range(1, 29)] + rng.sample(everything, 8000)
    assert differ(tt, ref, rep) == []
    words = [p.lstrip("\u2581") for p, _ in vocab[1000:3000]]
    texts = fuzz_texts(FUZZ or 3000, 11, alphabet, words)
    tt.fast.native.fallbacks = 0
    assert differ(tt, ref, texts) == []
    assert tt.fast.native.fallbacks < len(texts) // 2, tt.fast.native.fallbacks


def test_wordpiece_ids_equal_tokenizers_on_fuzzed_text():
    """The same classes through BERT's WordPiece (all-MiniLM-L6-v2): ids as tokenizers gives them."""
    from trellis.modelref import resolve_model_path

    path = resolve_model_path("default")
    ref = reference(path)
    tt = TextTokenizer(path, 1 << 20, 1 << 30)
    assert tt.backend == "native"
    vocab = json.loads(ref.to_str())["model"]["vocab"]
    alphabet = [p for p in vocab if len(p) == 1]
    words = [p for p in list(vocab)[2000:4000] if not p.startswith("##")]
    texts = fuzz_texts(FUZZ or 3000, 12, alphabet, words)
    tt.fast.native.fallbacks = 0
    assert differ(tt, ref, texts) == []
    assert tt.fast.native.fallbacks < len(texts) * 3 // 4, tt.fast.native.fallbacks
