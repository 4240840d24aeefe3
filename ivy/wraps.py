"""What a tokenizer.json's post-processor puts around one text or a pair (its special tokens and where token
type 1 starts), read off the tokenizer itself, and the lengths `tokenizers`' LongestFirst truncation keeps of a
pair: what Ivy's fast encoders need to wrap and cut texts exactly as `tokenizers` would."""

from __future__ import annotations

from tokenizers import Tokenizer


def fixed_wrap(tok: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The special tokens `tok` puts around a single text ([CLS] ... [SEP], <s> ... </s>), as (prefix,
    suffix); None where its post-processor is not a fixed prefix and suffix."""
    enc = tok.encode("a")
    mask, ids = enc.special_tokens_mask, enc.ids
    if 0 not in mask:
        return None
    first, last = mask.index(0), len(mask) - mask[::-1].index(0)
    prefix, suffix = ids[:first], ids[last:]
    return (prefix, suffix) if tok.encode("").ids == prefix + suffix else None


def fixed_pair_wrap(tok: Tokenizer) -> tuple[list[int], list[int], list[int], int] | None:
    """The special tokens `tok`'s pair template puts around and between two texts (`<s> A </s></s> B
    </s>`, `[CLS] A [SEP] B [SEP]`) as (prefix, middle, suffix, k): token type 1 starts k tokens into
    the middle (len(middle): at B; -1: every token typed 0). None where the template is anything else."""
    enc = tok.encode("a", "b")
    seq, types, ids = enc.sequence_ids, enc.type_ids, enc.ids
    a = [i for i, x in enumerate(seq) if x == 0]
    b = [i for i, x in enumerate(seq) if x == 1]
    if not a or not b or a != list(range(a[0], a[-1] + 1)) or b != list(range(b[0], b[-1] + 1)) or a[-1] >= b[0]:
        return None
    prefix, middle, suffix = ids[:a[0]], ids[a[-1] + 1:b[0]], ids[b[-1] + 1:]
    if tok.encode("", "").ids != prefix + middle + suffix:
        return None
    if 1 not in types:
        return prefix, middle, suffix, -1
    first = types.index(1)
    if not a[-1] < first <= b[0] or types != [0] * first + [1] * (len(types) - first):
        return None
    return prefix, middle, suffix, first - a[-1] - 1


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """How many tokens of each text a pair keeps under `room` content tokens, as `tokenizers`'
    LongestFirst truncation cuts them (the shorter one kept whole where the longer can take the cut,
    else both to about half)."""
    if n1 + n2 <= room:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > room else max(n1, room - n1)
    if n1 + n2 > room:
        n1 = room // 2
        n2 = n1 + room % 2
    return (n2, n1) if swap else (n1, n2)
