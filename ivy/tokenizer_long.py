"""Long texts tokenized a segment at a time, so that the work and the memory a text costs follow the
tokens a request may keep, not the text's length (issue 47, fault 9).

A `tokenizers` Encoding holds ~100 bytes per token (ids, type ids, token strings, offsets, masks)
and a whole text is encoded before its truncation is applied: 8 MiB of text cost gigabytes and
seconds only to keep 512 tokens, or to learn that it is too long. Here a text longer than
SEGMENT_CHARS is cut into segments just before a space (U+0020), the space kept with the segment
after it, tokenized one segment at a time, and the caller stops as soon as it has the tokens it needs:

- truncating: the shortest prefix holding the tokens the model keeps (then tokenized as usual:
  the same ids as the whole text's, truncated);
- not truncating: a text is known to be over the maximum once a prefix is (a 400 without
  tokenizing the rest);
- counting (/v1/tokenize, truncate "start" / "chunk", TEI's /tokenize): up to the request's
  token limit (`--max-request-tokens`), then a 413.

Where a cut is exact is derived from the tokenizer's normalizer, pre-tokenizer and added tokens
(`cut_rule`; a tokenizer it cannot vouch for is tokenized whole, as before: bounded only by the
body limit):

- a pre-tokenizer that drops whitespace (BERT's, Whitespace, WhitespaceSplit): any space after a
  non-space is a word boundary in both the text and its segments;
- one where a space belongs to the word after it (Metaspace with split, prepend_scheme always /
  first / never; byte-level BPE, GPT-2's regex or a Split by GPT-2 / Qwen2 / Llama 3's pattern
  before it): the segment after a cut starts with the space, so Metaspace prepends no second "▁"
  and the regex starts a word there, as in the whole text; this holds only where the character
  before the space is still there, and not a space, once normalized: XLM-R's charsmap maps some
  characters (U+FFFD, zero-width spaces, controls) to a space, and `Replace(" {2,}", " ")` then
  folds it into the run after it in the whole text but not in a segment. So the character before a
  cut is a letter, number, punctuation or symbol (not a modifier symbol, nor one that may join a
  grapheme with its neighbour: the charsmap rewrites graphemes of under 6 bytes whole) that the
  tokenizer's own normalizer maps to a non-empty text ending in a non-space, learned per character;
- a Metaspace without split, or none at all, hands the model the whole text as one word: no rule
  (for Unigram the Viterbi sums would also carry across a cut); likewise a normalizer that strips
  or prepends, an added token holding a space, an unknown component.

Offsets need no adjusting: a segment's tokens are the whole text's, their offsets shifted by where
the segment starts. That segments give the whole text's tokens is still checked when a tokenizer is
loaded (`segments_agree`, on the check texts joined). A run of more than RUN_CHARS characters
without a cut (in practice CJK or Thai text without spaces, or junk) is cut anyway, at a character
that starts a grapheme: its tokens may differ from `tokenizers`' by a token or two at each such cut;
a shorter run is never cut.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import unicodedata
from typing import Callable, Iterator

import numpy as np

from ivy.native import JOIN, PREPEND

SEGMENT_CHARS = 8192  # a text longer than this is tokenized in segments of about this many characters
RUN_CHARS = 65536  # a run without a word boundary longer than this is cut (see the module docstring)
_JOINING = {"Mn", "Mc", "Me", "Cf", "Cs", "Sk"}  # never cut before these: they belong to the character before
# Split patterns (tokenizer.json's, as written) that never put a non-space and the space after it in
# one piece, so a piece starts at every such space: GPT-2's (ByteLevel's own regex), Qwen2 / Qwen3's,
# Llama 3's / cl100k's
SPACE_LED = {
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# normalizers that rewrite each character on its own (or, Precompiled, a grapheme: see above)
PER_CHAR = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Precompiled", "BertNormalizer", "StripAccents", "Nmt"}
MAX_LEARNED = 4096  # characters the normalizer was found to empty or end in a space, excluded by the regex


def _grapheme_cut(text: str, at: int) -> int:
    """A position at or after `at` where a new character starts (not a mark, format character or
    modifier that joins the one before, nor after a ZWJ)."""
    n = len(text)
    while at < n and (unicodedata.category(text[at]) in _JOINING or text[at - 1] == "\u200d"):
        at += 1
    return at


def _class(ranges: list[tuple[int, int]]) -> str:
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


def _ranges(bad: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], bad.view(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), (edges[1::2] - 1).tolist()))


@functools.lru_cache(maxsize=1)
def _unsafe_class() -> str:
    """Characters never before a cut where the space is a word's (a regex class body, ~0.1 s once):
    marks, controls, format characters, separators, unassigned, modifier symbols, the ones that may
    join a grapheme (ivy.native's JOIN, PREPEND), everything from U+30000."""
    bad = np.zeros(0x30000, dtype=bool)
    bad[:] = [c[0] in "MCZ" or c == "Sk" for c in map(unicodedata.category, map(chr, range(0x30000)))]
    for a, b in JOIN + PREPEND:
        bad[a:min(b, 0x2FFFF) + 1] = True
    return _class(_ranges(bad)) + "\U00030000-\U0010ffff"


class CutRule:
    """Where a text may be cut: before a space whose previous character `find` accepts (see the
    module's doc). `attach`: the space belongs to the word after it (Metaspace, byte-level), so the
    character before it must survive normalization as a non-space; else whitespace is dropped and
    any non-space will do. `normalize`: the tokenizer's normalizer (None: none). `no_end`:
    characters ending an added token that strips the spaces after it (never cut after one)."""

    def __init__(self, attach: bool, normalize: Callable[[str], str] | None = None, no_end: str = ""):
        self.attach, self._normalize = attach, normalize
        self._no_end = "".join(sorted(set(no_end)))
        self._learned: list[str] = []  # characters found unsafe by the normalizer
        self._known: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._compile()

    def _compile(self) -> None:
        extra = re.escape("".join(self._learned) + self._no_end)
        prepend = _class(PREPEND)
        if self.attach:
            self._re = re.compile(f"(?<=[^\\s{_unsafe_class()}{extra}])(?<![{prepend}].) ")
        else:
            self._re = re.compile(f"(?<=[^\\s{prepend}{extra}])(?<![{prepend}].) ")

    def _safe(self, c: str) -> bool:
        """Whether the normalizer leaves `c`, alone and before a space, as a non-empty text ending in
        a non-space (learned once per character; a character found unsafe joins the regex's
        exclusions, so that a text of many of them costs one regex scan, not a Python step each)."""
        n = self._normalize
        got = n(c)
        ok = bool(got) and not got[-1].isspace() and n(c + " ") == got + " "
        with self._lock:
            self._known[c] = ok
            if not ok and len(self._learned) < MAX_LEARNED:
                self._learned.append(c)
                self._compile()
        return ok

    def find(self, text: str, pos: int, endpos: int) -> int | None:
        """The first cut in text[pos:endpos] (the index of its space), or None."""
        while True:
            m = self._re.search(text, pos, endpos)
            if m is None:
                return None
            k = m.start()
            if not self.attach or self._normalize is None:
                return k
            ok = self._known.get(text[k - 1])
            if ok is None:
                ok = self._safe(text[k - 1])
            if ok:
                return k
            pos = k + 1


def cut_rule(tok) -> CutRule | str:
    """The CutRule of a `tokenizers.Tokenizer`, from its normalizer, pre-tokenizer and added tokens
    (read as tokenizer.json has them), or why it has none."""
    norm = json.loads(tok.normalizer.__getstate__()) if tok.normalizer is not None else None
    pre = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else None
    for n in (norm.get("normalizers", []) if norm and norm["type"] == "Sequence" else [norm] if norm else []):
        kind = n.get("type")
        if kind == "Replace":
            pattern = n.get("pattern", {})
            if not (pattern.get("Regex") == " {2,}" or " " not in pattern.get("String", " ")[1:]):
                return f"the normalizer replaces {pattern}"
        elif kind not in PER_CHAR:
            return f"a {kind} normalizer"
    if norm is not None and tok.normalizer.normalize_str(" ") != " ":
        return "the normalizer rewrites the space"
    split = None  # what the pre-tokenizers so far made of spaces: "drop", "attach", or None (not split at them)
    for p in (pre.get("pretokenizers", []) if pre and pre["type"] == "Sequence" else [pre] if pre else []):
        kind = p.get("type")
        if kind in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit"):
            split = split or "drop"
        elif kind == "Metaspace":
            if p.get("split", True):
                split = split or "attach"
            elif split is None:
                return "a Metaspace without split: the model sees the whole text as one word"
        elif kind == "ByteLevel":
            if p.get("use_regex", True):
                split = split or "attach"
            elif split is None:
                return "a ByteLevel pre-tokenizer without its regex: the model sees the whole text as one word"
        elif kind == "Split":
            if not (p.get("pattern", {}).get("Regex") in SPACE_LED and p.get("behavior") == "Isolated"
                    and not p.get("invert")):
                return f"a Split by {p.get('pattern')} ({p.get('behavior')})"
            split = split or "attach"
        elif kind not in ("Punctuation", "Digits"):
            return f"a {kind} pre-tokenizer"
    if split is None:
        return "no pre-tokenizer splits at spaces: the model sees the whole text as one word"
    added = tok.get_added_tokens_decoder().values()
    if any(any(c.isspace() for c in t.content) for t in added):
        return "an added token holds a space"
    no_end = "".join(t.content[-1] for t in added if t.rstrip and t.content)
    normalize = tok.normalizer.normalize_str if tok.normalizer is not None else None
    return CutRule(split == "attach", normalize, no_end)


def segments(text: str, rule: CutRule, size: int = SEGMENT_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of `text`, each at least `size` characters (the last one
    may be shorter), cut where `rule` finds (before a space); a piece with no cut within RUN_CHARS
    is cut at RUN_CHARS (at a character boundary)."""
    start, n = 0, len(text)
    while n - start > size:
        k = rule.find(text, start + size, min(start + RUN_CHARS, n))
        end = k if k is not None else (n if n - start <= RUN_CHARS else _grapheme_cut(text, start + RUN_CHARS))
        if end >= n:
            break
        yield start, end
        start = end
    yield start, n


class Prefix:
    """What `scan` learned of a text: its content ids up to where it stopped (`ids`), whether that
    is the whole text (`whole`), and the end of the characters they come from (`end`)."""

    __slots__ = ("ids", "whole", "end")

    def __init__(self, ids: np.ndarray, whole: bool, end: int):
        self.ids, self.whole, self.end = ids, whole, end


def scan(text: str, content: Callable[[str], np.ndarray], limit: int, rule: CutRule, size: int = SEGMENT_CHARS
         ) -> Prefix:
    """`text`'s content ids (no special tokens; `content` encodes one segment), segment by segment,
    stopping after the segment that brings the count to `limit` or more."""
    parts, n, end = [], 0, 0
    for start, end in segments(text, rule, size):
        a = content(text[start:end])
        parts.append(a)
        n += len(a)
        if n >= limit and end < len(text):
            break
    ids = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Prefix(ids, end >= len(text), end)


def segments_agree(content: Callable[[str], np.ndarray], texts: list[str], rule: CutRule) -> bool:
    """Whether tokenizing `texts` (joined by spaces, and by runs of blanks and newlines) in small
    segments cut by `rule` gives the same content ids as tokenizing them whole."""
    for sep in (" ", "  \n ", "\t ", " \u3000 "):
        text = sep.join(texts)
        whole = content(text).tolist()
        for size in (7, 64, 500):
            if scan(text, content, 1 << 62, rule, size).ids.tolist() != whole:
                return False
    return True
