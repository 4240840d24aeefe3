"""Ivy's native encoders (`ivy/native.c`, compiled here on first use with the system's C compiler and
kept by source hash under the cache directory, or beside the source by `python -m ivy.native`),
ids only, exactly as `tokenizers` computes them, each distinct short word's ids remembered:

- **Unigram**, XLM-RoBERTa's converted tokenizer.json (BGE-M3, its rerankers, most multilingual
  SentencePiece models): normalizer Precompiled then `Replace(" {2,}", " ")`, pre-tokenizer Metaspace
  ("▁", prepended always, split), model Unigram without byte fallback: the charsmap, Metaspace and
  Viterbi of `tokenizers` (ties to the first candidate met), over the piece scores as `tokenizers`
  reads them from the file (its JSON parser's own rounding, `serde_number`, not Python's).
- **WordPiece**, BERT's (all-MiniLM-L6-v2, the default model): BertNormalizer (cleaning text, CJK
  spacing, accents, lower-casing), BertPreTokenizer, WordPiece; ASCII in the C, the BMP's other
  characters through a table derived here (`wordpiece_table`) where that can be done exactly.

A text an encoder does not decide goes to `tokenizers` itself (the same ids, slower): one containing
an added token's text (`<s>`, `[CLS]`, ...: `tokenizers` cuts those out first); for Unigram one that
is not valid UTF-8 (lone surrogates) or where the charsmap rewrites a character that may share a
grapheme with its neighbour (`tokenizers` rewrites graphemes of up to 5 bytes whole there; which
characters may is over-approximated from Unicode categories, so this is rare on ordinary text:
decomposed accents, half-width kana with voicing marks); for WordPiece one with a character past
the BMP or one the table leaves out (characters Unicode 3.2 did not have, or whose category moved).
`FastEncoder.ids` counts them (`fallbacks`).

No C compiler (or a failed build): `library()` raises ImportError and Ivy tokenizes with `tokenizers`.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import unicodedata
from pathlib import Path

import numpy as np

from trellis import cache_root

log = logging.getLogger("ivy.native")
SOURCE = Path(__file__).with_name("native.c")
NCP = 0x110000
CACHE_BITS = 19  # 2^19 remembered words at most (32 MB; all forgotten at 70 %, ~367,000 distinct words)
# UAX #29's grapheme rules, over-approximated from Unicode categories (the Rust crate `tokenizers`
# uses may know a newer Unicode; unassigned code points count as anything): JOIN, characters that
# may extend a grapheme or (before a non-ASCII one) carry it on: marks, format characters, unassigned
# code points, and the ones UAX #29 names outside them (Thai / Lao sara am, half-width voicing marks,
# emoji modifiers, regional indicators, Hangul jamo); PREPEND, the Prepend characters, which join
# whatever follows them.
JOIN_CATEGORIES = {"Mn", "Mc", "Me", "Cf", "Cn"}
PREPEND = ((0x0600, 0x0605), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2), (0x0D4E, 0x0D4E),
           (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x111C2, 0x111C3), (0x1193F, 0x1193F), (0x11941, 0x11941),
           (0x11A3A, 0x11A3A), (0x11A84, 0x11A89), (0x11D46, 0x11D46), (0x11F02, 0x11F02), (0x1100, 0x115F),
           (0xA960, 0xA97F), (0x30000, NCP - 1))  # Hangul L jamo join the syllable after them
JOIN = ((0x0E33, 0x0E33), (0x0EB3, 0x0EB3), (0xFF9E, 0xFF9F), (0x1F3FB, 0x1F3FF), (0x1F1E6, 0x1F1FF),
        (0x1100, 0x11FF), (0xA960, 0xA97F), (0xD7B0, 0xD7FF), (0x200C, 0x200D)) + PREPEND
# format characters that are not UAX #29's Control: ZWNJ / ZWJ (Extend), the prepended concatenation
# marks (Prepend), the tags (Extend); CR and LF (their own rule, in the C)
NOT_CONTROL = ((0x0A, 0x0A), (0x0D, 0x0D), (0x200C, 0x200D), (0x0600, 0x0605), (0x06DD, 0x06DD), (0x070F, 0x070F),
               (0x0890, 0x0891), (0x08E2, 0x08E2), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0xE0020, 0xE007F))


def cache_dir() -> Path:
    return cache_root() / "ivy"


FLAGS = ("-O2",)


def built_name(source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> str:
    """The file name of `source`'s build with `flags`: its stem and a hash of the source (and of the flags where they
    are not FLAGS), so an edited source or other flags never load an old build."""
    digest = hashlib.sha256(source.read_bytes())
    if flags != FLAGS:
        digest.update("\0".join(flags).encode())
    return f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(path: Path, flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> Path:
    """Compile `source` (ivy/native.c, or another of Ivy's C sources: ivy/resample.c) into `path` with `flags`
    (atomically: processes building at once each get a whole file). ImportError without a C compiler or when the
    build fails."""
    name = f"ivy/{source.name}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ImportError(f"no C compiler (cc / gcc, or $CC) to build {name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        try:
            run = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(source), "-lm"],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ImportError(f"building {name} with {cc} failed: {e}") from e
        if run.returncode:
            raise ImportError(f"building {name} failed: {run.stderr.strip()[:500]}")
        os.replace(tmp, path)
        for old in path.parent.glob(f"{source.stem}-*.so"):  # builds of earlier sources
            if old != path:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def compiled(source: Path = SOURCE, flags: tuple[str, ...] = FLAGS, name: str | None = None) -> Path:
    """`source`'s build with `flags` (file `name`, else `built_name`'s): beside the source (`python -m ivy.native`,
    as the gateway image does), else in the cache directory, built there on first use. ImportError when it cannot
    be built."""
    name = name or built_name(source, flags)
    path = source.with_name(name)
    if not path.is_file():
        path = cache_dir() / name
        if not path.is_file():
            build(path, flags, source)
    return path


@functools.lru_cache(maxsize=1)
def library() -> ctypes.PyDLL:
    """The compiled encoders (`compiled`). PyDLL: calls hold the GIL, so one instance is never entered twice at
    once. ImportError when it cannot be built."""
    return load(compiled(SOURCE, FLAGS, built_name()))


def load(path: Path) -> ctypes.PyDLL:
    """A build of ivy/native.c at `path` with its functions' signatures (`library`; the sanitizer
    fuzz, benchmarks/fuzz_native.py, loads its own build)."""
    lib = ctypes.PyDLL(str(path))
    lib.ut_new.restype = ctypes.c_void_p
    lib.ut_new.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                           ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]
    lib.ut_free.restype = None
    lib.ut_free.argtypes = [ctypes.c_void_p]
    lib.ut_encode.restype = ctypes.c_long
    lib.ut_encode.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_void_p,
                              ctypes.c_long]  # the out pointer goes in as an int: no ctypes object per call
    lib.ut_new_wordpiece.restype = ctypes.c_void_p
    lib.ut_new_wordpiece.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    lib.ut_wordpiece_table.restype = ctypes.c_int
    lib.ut_wordpiece_table.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_size_t]
    lib.ut_wrap.restype = ctypes.c_int
    lib.ut_wrap.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.ut_stats.restype = None
    lib.ut_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


@functools.lru_cache(maxsize=1)
def join_bits() -> bytes:
    """Three bitmaps over the code points (~0.1 s): JOIN and PREPEND (above), then characters that
    are a grapheme of their own whatever their neighbours (Control: an under-approximation)."""
    cats = [unicodedata.category(chr(c)) for c in range(0x30000)]
    join, prepend, alone = (np.zeros(NCP, dtype=bool) for _ in range(3))
    join[:0x30000] = [c in JOIN_CATEGORIES for c in cats]
    prepend[:0x30000] = [c == "Cn" for c in cats]
    for bits, ranges in ((join, JOIN), (prepend, PREPEND)):
        for a, b in ranges:
            bits[a:b + 1] = True
    alone[:0x30000] = [c in ("Cc", "Cf", "Zl", "Zp") for c in cats]
    for a, b in NOT_CONTROL:
        alone[a:b + 1] = False
    join &= ~alone
    return b"".join(np.packbits(x, bitorder="little").tobytes() for x in (join, prepend, alone))


# BertNormalizer / BertPreTokenizer as `tokenizers` runs them: Rust's White_Space, the CJK ideographs
# it spaces, and Unicode categories from a crate of Unicode 9.0's day
WHITE_SPACE = {0x20, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000}
CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0xF900, 0xFAFF))  # the BMP's share of tokenizers' list


@functools.lru_cache(maxsize=4)
def wordpiece_table(lowercase: bool, strip_accents: bool, chinese: bool) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """Per BMP character (ASCII excluded: the C's own), what BertNormalizer then BertPreTokenizer make of
    it: class (0 the exact path, 1 dropped, 2 a space, 3 a word of its own, 4 part of a word) and the
    characters it becomes. Only characters Unicode 3.2 already had with today's category are derived
    (their decomposition and category cannot have moved since, and `tokenizers`' category tables are
    of Unicode 9.0); any other, or one whose result holds such a character, is class 0. ~0.3 s."""
    old = unicodedata.ucd_3_2_0
    cat, nfd, comb = unicodedata.category, unicodedata.normalize, unicodedata.combining

    def stable(ch: str) -> bool:
        c = cat(ch)
        return c != "Cn" and c != "Cs" and old.category(ch) == c and (c == "Mn" or comb(ch) == 0)

    cls = np.zeros(0x10000, dtype=np.uint8)
    off = np.zeros(0x10000, dtype=np.uint32)
    length = np.zeros(0x10000, dtype=np.uint32)
    out: list[int] = []
    for c in range(0x80, 0x10000):
        ch = chr(c)
        if not stable(ch):
            continue
        if c in WHITE_SPACE:
            cls[c] = 2
            continue
        if cat(ch)[0] == "C" or c == 0xFFFD:  # clean_text: controls, format, private use dropped
            cls[c] = 1
            continue
        text = nfd("NFD", ch) if strip_accents else ch
        if strip_accents:
            text = "".join(x for x in text if cat(x) != "Mn")
        if lowercase:
            text = "".join(x.lower() for x in text)
        if not all(stable(x) and ord(x) < 0x10000 for x in text):
            continue
        kinds = {"space" if ord(x) in WHITE_SPACE or x in "\t\n\r" else "punct" if cat(x)[0] == "P" or
                 (ord(x) < 0x80 and not x.isalnum()) else "control" if cat(x)[0] == "C" else "word" for x in text}
        if chinese and any(a <= c <= b for a, b in CJK):
            if kinds <= {"word"} and text:
                cls[c] = 3
        elif kinds <= {"word"}:
            cls[c] = 4
        elif kinds == {"punct"} and len(text) == 1:
            cls[c] = 3
        if cls[c] >= 3:
            off[c], length[c] = len(out), len(text)
            out.extend(map(ord, text))
    return cls.tobytes(), off, length, np.asarray(out or [0], dtype=np.uint32)


def unsupported(config: dict) -> str | None:
    """Why neither encoder can serve a tokenizer.json (parsed), or None."""
    model, norm, pre = config.get("model") or {}, config.get("normalizer") or {}, config.get("pre_tokenizer") or {}
    kind = model.get("type")
    if any(t.get("normalized") for t in config.get("added_tokens", [])):
        return "added tokens matched after normalization"
    if kind == "WordPiece":
        if not (norm.get("type") == "BertNormalizer" and norm.get("clean_text")):
            return "a WordPiece model without BertNormalizer(clean_text)"
        if pre.get("type") != "BertPreTokenizer":
            return "a WordPiece model without BertPreTokenizer"
        if not all(ord(c) < 0x80 for c in model.get("continuing_subword_prefix", "##")):
            return "a non-ASCII continuing-subword prefix"
        return None
    if kind != "Unigram":
        return f"a {kind} model, not Unigram or WordPiece"
    if model.get("byte_fallback") or model.get("unk_id") is None:
        return "a Unigram model with byte fallback or without <unk>"
    parts = norm.get("normalizers") if norm.get("type") == "Sequence" else None
    if not (parts and len(parts) == 2 and parts[0].get("type") == "Precompiled"
            and parts[1] == {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}):
        return "a normalizer other than Precompiled then Replace(' {2,}', ' ')"
    prepend = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
    if not (pre.get("type") == "Metaspace" and pre.get("replacement") == "\u2581" and prepend == "always"
            and pre.get("split", True)):
        return "a pre-tokenizer other than Metaspace('▁', prepend always, split)"
    return None


# tokenizer.json's numbers as `tokenizers` reads them. Its JSON parser, serde_json 1.x built without
# the `float_roundtrip` feature (tokenizers enables none), does not round decimals correctly: it
# accumulates the digits into a u64 (digits past its range dropped), converts that to f64 and
# multiplies or divides once by a power of ten (src/de.rs: parse_integer, parse_decimal,
# parse_exponent, f64_from_parts, POW10). Two roundings: ~26 % of XLM-R-style scores land 1 ulp
# away from the correctly rounded value Python's `json` gives, and Viterbi's exact ties then break
# the other way. Hand-written because no Python library parses JSON as serde_json does; IEEE double
# arithmetic in Python and in Rust is the same, so these are its values bit for bit (proved against
# `tokenizers` in tests/test_tokenizer_fuzz.py).
_POW10 = [float(f"1e{k}") for k in range(309)]  # Rust's literals 1e0 .. 1e308: correctly rounded, as here
_U64_MAX, _I32_MAX = (1 << 64) - 1, (1 << 31) - 1


def _f64_from_parts(positive: bool, significand: int, exponent: int) -> float:
    f = float(significand)  # u64 as f64: round to nearest, ties to even, as float(int)
    while True:
        if -_I32_MAX <= exponent and abs(exponent) <= 308:  # POW10.get(exponent.wrapping_abs())
            if exponent >= 0:
                f *= _POW10[exponent]
                if f == float("inf"):
                    raise ValueError("number out of range")
            else:
                f /= _POW10[-exponent]
            break
        if f == 0.0:
            break
        if exponent >= 0:
            raise ValueError("number out of range")
        f /= 1e308
        exponent += 308
    return f if positive else -f


def serde_number(s: str) -> int | float:
    """The number serde_json (without `float_roundtrip`) reads from the JSON number literal `s`: an int
    where it keeps an integer (u64 or i64), else its f64. ValueError where it refuses the number."""
    n, i, positive = len(s), 0, True
    if s[0] == "-":
        positive, i = False, 1
    sig = exp = 0
    long = False
    if s[i] == "0":
        i += 1
    else:
        while i < n and "0" <= s[i] <= "9":
            d = ord(s[i]) - 48
            if sig * 10 + d > _U64_MAX:  # parse_long_integer: the remaining digits only scale
                long = True
                while i < n and "0" <= s[i] <= "9":
                    i += 1
                    exp += 1
                break
            sig = sig * 10 + d
            i += 1
    if i == n and not long:  # parse_number: an integer
        if positive:
            return sig
        if sig == 0 or sig > 1 << 63:  # -0 and what i64 cannot hold: F64
            return -float(sig)
        return -sig
    if i < n and s[i] == ".":  # parse_decimal (also after a long integer: its digits go on accumulating)
        i += 1
        while i < n and "0" <= s[i] <= "9":
            d = ord(s[i]) - 48
            if sig * 10 + d > _U64_MAX:  # parse_decimal_overflow: further digits ignored
                while i < n and "0" <= s[i] <= "9":
                    i += 1
                break
            sig = sig * 10 + d
            exp -= 1
            i += 1
    if i < n and s[i] in "eE":  # parse_exponent
        i += 1
        positive_exp = True
        if s[i] in "+-":
            positive_exp = s[i] == "+"
            i += 1
        e = 0
        while i < n and "0" <= s[i] <= "9":
            d = ord(s[i]) - 48
            if e * 10 + d > _I32_MAX:  # parse_exponent_overflow
                if sig and positive_exp:
                    raise ValueError("number out of range")
                return 0.0 if positive else -0.0
            e = e * 10 + d
            i += 1
        exp = max(-_I32_MAX - 1, min(_I32_MAX, exp + e if positive_exp else exp - e))  # saturating
    return _f64_from_parts(positive, sig, exp)


def serde_float(s: str) -> float:
    """`serde_number` of a literal with a fraction or an exponent (json's parse_float hook): a plain
    decimal of at most 19 digits (every score XLM-R's files hold) straight, as its u64 cannot overflow."""
    if len(s) <= 20 and "e" not in s and "E" not in s:
        neg = s[0] == "-"
        dot = s.index(".")
        f = float(int(s[neg:dot] + s[dot + 1:])) / _POW10[len(s) - dot - 1]
        return -f if neg else f
    return float(serde_number(s))


def serde_int(s: str) -> int | float:
    """`serde_number` of an integer literal (json's parse_int hook): an int unless serde_json reads an f64."""
    return int(s) if len(s) < 19 and s != "-0" else serde_number(s)


# scores of the bge-m3 stand-in that the fast parse and a correctly rounded one read 1 ulp apart
PROBES = ("-9.010720252990723", "-9.362776756286621", "-9.363053321838379", "-9.356038093566895", "-9.457879066467285",
          "-9.469776153564453", "-10.047332763671875", "-10.082094192504883", "-10.125388145446777")


def unigram_json(scores: list[str]) -> str:
    """A bare tokenizer.json: a Unigram model of <unk> and one piece per score literal."""
    vocab = "".join(f', ["p{i}", {x}]' for i, x in enumerate(scores))
    return ('{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
            '"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"Unigram","unk_id":0,'
            f'"vocab":[["<unk>", 0.0]{vocab}],"byte_fallback":false}}}}')


@functools.lru_cache(maxsize=1)
def tokenizers_rounds_correctly() -> bool:
    """How the installed `tokenizers` reads decimals, asked of it on PROBES (a few milliseconds): False
    for serde_json's fast parse (`serde_number`; every release so far), True where a build enables
    `float_roundtrip` (correctly rounded, as Python's `json`). ValueError for neither."""
    from tokenizers import Tokenizer

    got = [s for _, s in json.loads(Tokenizer.from_str(unigram_json(list(PROBES))).to_str())["model"]["vocab"][1:]]
    if got == [serde_float(x) for x in PROBES]:
        return False
    if got == [float(x) for x in PROBES]:
        return True
    raise ValueError(f"tokenizers reads {PROBES[0]} as {got[0]!r}: neither serde_json's fast parse nor correctly rounded")


def read_json(path: Path) -> dict:
    """tokenizer.json with its numbers as `tokenizers` reads them."""
    text = Path(path).read_text(encoding="utf-8")
    if tokenizers_rounds_correctly():
        return json.loads(text)
    return json.loads(text, parse_float=serde_float, parse_int=serde_int)


def _pieces(pieces: list[str]) -> tuple[bytes, np.ndarray]:
    """The pieces as UTF-8 back to back, and their offsets (n + 1)."""
    raw = [p.encode("utf-8") for p in pieces]
    offsets = np.zeros(len(raw) + 1, dtype=np.uint32)
    np.cumsum([len(p) for p in raw], out=offsets[1:])
    return b"".join(raw), offsets


class NativeEncoder:
    """`tokenizer.json` encoded by ivy/native.c (Unigram or WordPiece, as the file says), the content
    wrapped in `wrap` (the post-processor's fixed prefix and suffix); the texts it hands back are the
    caller's to encode exactly; `lib`: a build of its own (`load`), else `library()`. ValueError: a tokenizer
    it does not cover; ImportError: no build."""

    def __init__(self, path: Path, wrap: tuple[list[int], list[int]] = ([], []), cache_bits: int = CACHE_BITS,
                 lib: ctypes.PyDLL | None = None):
        config = read_json(path)  # the scores as tokenizers has them, to the bit (see serde_number)
        why = unsupported(config)
        if why:
            raise ValueError(why)
        lib = lib or library()
        model = config["model"]
        self.kind = model["type"]
        if self.kind == "Unigram":
            pieces, offsets = _pieces([p for p, _ in model["vocab"]])
            scores = np.asarray([s for _, s in model["vocab"]], dtype=np.float64)
            charsmap = base64.b64decode(config["normalizer"]["normalizers"][0]["precompiled_charsmap"])
            handle = lib.ut_new(pieces, offsets.ctypes.data, scores.ctypes.data, len(offsets) - 1,
                                int(model["unk_id"]), charsmap, len(charsmap), join_bits(), cache_bits)
        else:  # WordPiece: vocab is token -> id
            vocab = model["vocab"]
            by_id = [""] * (max(vocab.values()) + 1)
            for token, i in vocab.items():
                by_id[i] = token
            unk = vocab.get(model.get("unk_token", "[UNK]"))
            if unk is None:
                raise ValueError("a WordPiece vocabulary without its unk_token")
            pieces, offsets = _pieces(by_id)
            prefix = model.get("continuing_subword_prefix", "##").encode()
            norm = config["normalizer"]
            lower = bool(norm.get("lowercase", True))
            strip = norm.get("strip_accents")
            handle = lib.ut_new_wordpiece(pieces, offsets.ctypes.data, len(offsets) - 1, unk,
                                          int(model.get("max_input_chars_per_word", 100)), int(lower),
                                          prefix, len(prefix), cache_bits)
            if handle:
                cls, off, length, cps = wordpiece_table(lower, lower if strip is None else bool(strip),
                                                        bool(norm.get("handle_chinese_chars", True)))
                if lib.ut_wordpiece_table(handle, cls, off.ctypes.data, length.ctypes.data, cps.ctypes.data, len(cps)):
                    lib.ut_free(handle)
                    handle = None
        if not handle:
            raise ValueError("ivy/native.c could not read this tokenizer.json (its charsmap or pieces)")
        self._lib, self._handle = lib, ctypes.c_void_p(handle)
        pre, suf = (np.asarray(x, dtype=np.int32) for x in wrap)
        if lib.ut_wrap(self._handle, pre.ctypes.data, len(pre), suf.ctypes.data, len(suf)):
            raise ValueError("more than 8 special tokens around a text")
        self._encode = lib.ut_encode
        self._grow(1 << 15)
        added = sorted({t["content"] for t in config.get("added_tokens", []) if t.get("content")})
        self.added = added
        self._starts = "".join(sorted({a[0] for a in added}))  # XLM-R's: "<" alone; BERT's "["
        self.fallbacks = 0

    def _grow(self, cap: int) -> None:
        """The scratch array the C writes a text's ids into (its address passed as a plain int)."""
        self._buf = np.empty(cap, dtype=np.int32)
        self._cap, self._addr = cap, self._buf.ctypes.data

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            try:
                self._lib.ut_free(handle)
            except Exception:  # interpreter shutdown: the library may already be gone
                pass

    def ids(self, text: str, budget: int | None = None) -> np.ndarray | None:
        """int32 ids of `text`, wrapped, its content cut to `budget` ids if given; None: a text for
        `tokenizers` (see the module's doc)."""
        starts = self._starts
        if (text.find(starts) >= 0 if len(starts) == 1 else any(c in text for c in starts)) \
                and any(a in text for a in self.added):
            return None
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            return None
        while True:
            n = self._encode(self._handle, raw, len(raw), -1 if budget is None else budget, self._addr, self._cap)
            if n == -1:
                return None
            if n < -1:
                raise MemoryError("ivy/native.c ran out of memory")
            if n <= self._cap:
                return self._buf[:n].copy()
            self._grow(n)  # a text longer than any before (or rewrites longer than it): again, with room

    def stats(self) -> dict[str, int]:
        """Remembered-word hits and misses, cache resets, words held, trie nodes; texts handed back."""
        out = np.zeros(5, dtype=np.uint64)
        self._lib.ut_stats(self._handle, out.ctypes.data)
        return dict(zip(("hits", "misses", "resets", "words", "nodes"), map(int, out)), fallbacks=self.fallbacks)


if __name__ == "__main__":  # python -m ivy.native: build the encoders beside their source (the gateway image)
    print(build(SOURCE.with_name(built_name())))
