"""Long texts tokenized a segment at a time, so that the work and the memory a text costs follow the
tokens a request may keep, not the text's length (issue 47, fault 9).

A `tokenizers` Encoding holds ~100 bytes per token (ids, type ids, token strings, offsets, masks)
and a whole text is encoded before its truncation is applied: 8 MiB of text cost gigabytes and
seconds only to keep 512 tokens, or to learn that it is too long. Here a text longer than
SEGMENT_CHARS is cut into segments just before a space that follows a non-space (a word boundary:
every pre-tokenizer Ivy serves, BERT's, Metaspace, byte-level BPE, splits there, and a segment
then starts with the space the next word's token carries), tokenized one segment at a time, and
the caller stops as soon as it has the tokens it needs:

- truncating: the shortest prefix holding the tokens the model keeps (then tokenized as usual:
  the same ids as the whole text's, truncated);
- not truncating: a text is known to be over the maximum once a prefix is (a 400 without
  tokenizing the rest);
- counting (/v1/tokenize, truncate "start" / "chunk", TEI's /tokenize): up to the request's
  token limit (`--max-request-tokens`), then a 413.

That segments give the whole text's tokens is checked when a tokenizer is loaded
(`segments_agree`, on the check texts joined); a tokenizer where they do not is tokenized whole
(as before, bounded only by the body limit). A run of more than RUN_CHARS characters without a
space (no word boundary to cut at) is cut anyway, at a character that starts a grapheme: its
tokens may differ from `tokenizers`' by a token or two at each such cut (a 64 Ki-character word:
in practice CJK or Thai text without spaces, or junk); a shorter run is never cut.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable, Iterator

import numpy as np

SEGMENT_CHARS = 8192  # a text longer than this is tokenized in segments of about this many characters
RUN_CHARS = 65536  # a run without a word boundary longer than this is cut (see the module docstring)
_CUT = re.compile(r"(?<=\S) ")
_JOINING = {"Mn", "Mc", "Me", "Cf", "Cs", "Sk"}  # never cut before these: they belong to the character before


def _grapheme_cut(text: str, at: int) -> int:
    """A position at or after `at` where a new character starts (not a mark, format character or
    modifier that joins the one before, nor after a ZWJ)."""
    n = len(text)
    while at < n and (unicodedata.category(text[at]) in _JOINING or text[at - 1] == "\u200d"):
        at += 1
    return at


def segments(text: str, size: int = SEGMENT_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of `text`, each at least `size` characters (the last one
    may be shorter), cut just before a space that follows a non-space; a piece with no such cut
    within RUN_CHARS is cut at RUN_CHARS (at a character boundary)."""
    start, n = 0, len(text)
    while n - start > size:
        m = _CUT.search(text, start + size, min(start + RUN_CHARS, n))
        end = m.start() if m is not None else (n if n - start <= RUN_CHARS else _grapheme_cut(text, start + RUN_CHARS))
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


def scan(text: str, content: Callable[[str], np.ndarray], limit: int, size: int = SEGMENT_CHARS) -> Prefix:
    """`text`'s content ids (no special tokens; `content` encodes one segment), segment by segment,
    stopping after the segment that brings the count to `limit` or more."""
    parts, n, end = [], 0, 0
    for start, end in segments(text, size):
        a = content(text[start:end])
        parts.append(a)
        n += len(a)
        if n >= limit and end < len(text):
            break
    ids = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Prefix(ids, end >= len(text), end)


def segments_agree(content: Callable[[str], np.ndarray], texts: list[str]) -> bool:
    """Whether tokenizing `texts` (joined by spaces, and by runs of blanks and newlines) in small
    segments gives the same content ids as tokenizing them whole."""
    for sep in (" ", "  \n ", "\t "):
        text = sep.join(texts)
        whole = content(text).tolist()
        for size in (7, 64, 500):
            if scan(text, content, 1 << 62, size).ids.tolist() != whole:
                return False
    return True
