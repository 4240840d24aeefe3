"""Tokenization with the model's own tokenizer.json: Ivy's native encoders (`ivy.native`, in C,
token-exact) for XLM-RoBERTa-style Unigram tokenizers (BGE-M3, its rerankers) and BERT's WordPiece
(all-MiniLM-L6-v2), else Hugging Face `tokenizers`."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from ivy.errors import APIError
from ivy.tokenizer_long import SEGMENT_CHARS, CutRule, cut_rule, scan, segments, segments_agree
from ivy.tokenizer_texts import EDGE_CASES, SENTENCES
from ivy.wraps import fixed_pair_wrap, fixed_wrap, longest_first
from trellis import spiece
from trellis.modeldir import ModelSpec

log = logging.getLogger("ivy.tokenizer")
YIELD_CHARS = 8192  # the fast encoder holds the GIL: a large batch yields to the event loop this often
SLICE_CHARS = 65536  # `tokenizers` encodes a large batch this many characters at a time (its Encodings are ~100 B a token)
MAX_REQUEST_TOKENS = 1 << 20  # the default of --max-request-tokens
COUNT_CHARS = 65536  # a text over the maximum up to this long is counted whole (the 400 says how many tokens)
BACKENDS = ("auto", "native", "tokenizers")


class FastEncoder:
    """`ivy.native` over the same tokenizer.json, with the post-processor's fixed prefix and suffix
    (<s> ... </s>, written by the C) and truncation as `tokenizers` applies them; the texts it hands
    back (see ivy/native.py) are encoded here by `reference` (no truncation)."""

    def __init__(self, path: Path, reference: Tokenizer):
        from ivy.native import NativeEncoder

        wrap = fixed_wrap(reference)
        if wrap is None:
            raise ValueError("the post-processor is not a fixed prefix and suffix")
        self.prefix, self.suffix = wrap
        self.n_special = len(self.prefix) + len(self.suffix)
        self.reference = reference
        self.native = NativeEncoder(path, wrap)

    def ids(self, text: str, budget: int | None = None) -> np.ndarray:
        """Token ids of `text` with the special tokens; content cut to `budget` tokens if given."""
        a = self.native.ids(text, budget)
        if a is None:  # the exact path for this text
            self.native.fallbacks += 1
            ids = self.reference.encode(text).ids
            head, tail = len(self.prefix), len(self.suffix)
            body = ids[head:len(ids) - tail]
            a = np.asarray(self.prefix + (body if budget is None else body[:budget]) + self.suffix, dtype=np.int32)
        return a

    def ids_many(self, texts: list[str], budget: int | None = None) -> list[np.ndarray]:
        """`ids` of each text (one call into the C per text)."""
        return [self.ids(t, budget) for t in texts]

    def mismatches(self, reference: Tokenizer, texts: list[str]) -> list[str]:
        """The texts (of `texts`) on which this encoder and `reference` give different ids."""
        return [t for t in texts if self.ids(t).tolist() != reference.encode(t).ids]


def fast_encoder(path: Path, reference: Tokenizer, backend: str = "auto") -> FastEncoder | None:
    """A FastEncoder where `backend` allows it ("auto" or "native"), ivy/native.c builds here, the
    tokenizer is one it covers and it reproduces `reference` on the check texts; else None (logged;
    an error for "native")."""
    if backend == "tokenizers":
        return None
    try:
        enc = FastEncoder(path, reference)
    except ImportError as e:  # no C compiler, or the build failed
        why = str(e)
    except ValueError as e:  # a tokenizer it does not cover
        why = str(e)
    else:
        bad = enc.mismatches(reference, EDGE_CASES + SENTENCES)
        if not bad:
            return enc
        why = f"it differs from tokenizers on {len(bad)} check texts, e.g. {bad[0][:40]!r}"
    if backend == "native":
        raise ValueError(f"tokenizer backend native cannot serve {path}: {why}")
    log.info("tokenizing with tokenizers: %s", why)
    return None


class TextTokenizer:
    """Turns texts into token-id arrays, exactly, or truncated to `max_len` on request.

    `backend`: "auto" (ivy.native where it applies and is token-exact, else tokenizers), "native"
    or "tokenizers". `chat_template` (with its `message_format`): a cross-encoder's pairs are rendered
    by it (`ivy.chat`) instead of going through the pair template. `pad_to`, `pad_id`, `pad_left`: a
    text's ids padded as ModelSpec says (SigLIP: to its full width, as its processor pads with
    padding="max_length"; 0: never)."""

    def __init__(self, model_path: Path, max_len: int, offload_chars: int, backend: str = "auto",
                 chat_template: str = "", message_format: str = "flat", max_request_tokens: int = MAX_REQUEST_TOKENS,
                 pad_to: int = 0, pad_id: int = -1, pad_left: bool = False):
        path = Path(model_path) / "tokenizer.json"
        # tokenizer.json, else SigLIP 1's spiece.model (trellis.spiece: SiglipTokenizer's steps around a Unigram)
        self.exact = spiece.load(Path(model_path))
        if pad_to and pad_id < 0:
            raise ValueError(f"{model_path}: this model's texts are padded to {pad_to} tokens (as its processor pads "
                             "them), but neither its tokenizer nor its config.json names a pad token")
        self.pad_to, self.pad_id, self.pad_left = pad_to, pad_id, pad_left
        if backend not in BACKENDS:
            raise ValueError(f"tokenizer backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        self.exact.no_truncation()
        self.exact.no_padding()
        # `tokenizers` with truncation only where a fixed template cannot cut (a second parse of the
        # file: ~0.5 s of CPU for 250k pieces, so built on first use)
        self._path, self._truncating, self._lock = Path(model_path), None, threading.Lock()
        self.max_len = max_len
        self.offload_chars = offload_chars
        self.max_request_tokens = max_request_tokens
        if not path.is_file() and backend == "native":
            raise ValueError(f"tokenizer backend native cannot serve {model_path}: it has no tokenizer.json")
        self.fast = fast_encoder(path, self.exact, backend) if path.is_file() else None
        self.backend = "native" if self.fast else "tokenizers"
        # long texts a segment at a time (ivy.tokenizer_long) where its rule holds for this tokenizer
        # and segments give the whole text's ids on the check texts
        rule = cut_rule(self.exact)
        self.cuts: CutRule | None = rule if isinstance(rule, CutRule) else None
        self.segmentable = self.cuts is not None and segments_agree(self.content, EDGE_CASES + SENTENCES, self.cuts)
        if not self.segmentable:
            why = rule if isinstance(rule, str) else "segments of a text do not tokenize as the text does"
            log.warning("long texts are tokenized whole: %s", why)
        # where the pair template is fixed: its special tokens as arrays, and where type 1 starts in the
        # middle (-1: none); pairs are then cut as LongestFirst cuts them here, and natively too where
        # the native pairs match tokenizers'
        pair_wrap = fixed_pair_wrap(self.exact)
        self._pair_template = None if pair_wrap is None else (
            *(np.asarray(x, dtype=np.int32) for x in pair_wrap[:3]), pair_wrap[3])
        self._pair_wrap = self._pair_template if self.fast else None
        if self._pair_wrap is not None:
            checks = [(q, d) for q in SENTENCES[:3] for d in EDGE_CASES + SENTENCES]
            for truncate in (False, True):
                native, exact = self._pairs_native(checks, truncate), self._pairs_exact(checks, truncate)
                if native[1] != exact[1] or any(x.tolist() != y.tolist() for x, y in zip(native[0], exact[0])):
                    log.info("pairs tokenized with tokenizers: the native pairs differ on the check texts")
                    self._pair_wrap = None
                    break
        self._special = {i for i, t in self.exact.get_added_tokens_decoder().items() if t.special}
        self.chat = None
        if chat_template:
            from ivy.chat import ChatPairs, special_tokens

            self.chat = ChatPairs(chat_template, message_format, self.exact, max_len, special_tokens(Path(model_path)))
        # bounded: instructions are caller text
        self._prompt_length = functools.lru_cache(maxsize=1024)(self._count_prompt)

    @classmethod
    def for_model(cls, spec: ModelSpec, offload_chars: int, **kw) -> "TextTokenizer":
        """The tokenizer of the model directory `spec` was read from (ModelSpec.read): its tokenizer.json where
        the transformers checkpoint lives (sentence-transformers' older CLIP layout: 0_CLIPModel/), its maximum,
        its chat template and its padding. `kw`: backend, max_request_tokens."""
        return cls(spec.path, spec.max_seq_len, offload_chars, chat_template=spec.chat_template,
                   message_format=spec.message_format, pad_to=spec.pad_to, pad_id=spec.pad_id, pad_left=spec.pad_left,
                   **kw)

    @functools.cached_property
    def pair_boundary(self) -> bool:
        """Whether the pair template types a pair's tokens 0 ... 0 1 ... 1 (one boundary) or all 0."""
        types = self.exact.encode("a", "b").type_ids
        return 1 not in types or types == sorted(types)

    def _pairs(self, pairs: list[tuple[str, str]], truncate: bool) -> tuple[list[np.ndarray], list[int]]:
        if self._pair_wrap is not None:
            return self._pairs_native(pairs, truncate)
        return self._pairs_exact(pairs, truncate)

    @property
    def truncating(self) -> Tokenizer:
        """`tokenizers` truncating to the maximum (built on first use)."""
        with self._lock:
            if self._truncating is None:
                tok = spiece.load(self._path)
                tok.no_padding()
                tok.enable_truncation(self.max_len)
                self._truncating = tok
            return self._truncating

    def _pairs_native(self, pairs: list[tuple[str, str]], truncate: bool) -> tuple[list[np.ndarray], list[int]]:
        """Each text of a pair by the native encoder alone (each distinct text once: a query comes
        with every document), cut as LongestFirst cuts them, put into the pair template."""
        content: dict[str, np.ndarray] = {}
        for t in {t for pair in pairs for t in pair}:
            content[t] = self.content(t)
        return self._pairs_template(pairs, truncate, content)

    def _pairs_template(self, pairs: list[tuple[str, str]], truncate: bool, content: dict[str, np.ndarray]
                        ) -> tuple[list[np.ndarray], list[int]]:
        """Pairs of texts whose content ids are `content[text]`, cut as `tokenizers`' LongestFirst cuts
        them, put into the fixed pair template."""
        pre, mid, suf, k = self._pair_template
        room = self.max_len - len(pre) - len(mid) - len(suf)
        seqs, starts = [], []
        for q, d in pairs:
            a, b = content[q], content[d]
            if truncate:
                n1, n2 = longest_first(len(a), len(b), max(room, 0))
                a, b = a[:n1], b[:n2]
            seqs.append(np.concatenate([pre, a, mid, b, suf]))
            starts.append(0 if k < 0 else len(pre) + len(a) + k)
        return seqs, starts

    def _pairs_exact(self, pairs: list[tuple[str, str]], truncate: bool) -> tuple[list[np.ndarray], list[int]]:
        if truncate and self._pair_template is not None:  # each text alone (once), cut here
            texts = list({t for pair in pairs for t in pair})
            encs = self.exact.encode_batch_fast(texts, add_special_tokens=False)
            return self._pairs_template(pairs, True, {t: np.asarray(e.ids, dtype=np.int32) for t, e in zip(texts, encs)})
        tok = self.truncating if truncate else self.exact
        seqs, starts = [], []
        for e in tok.encode_batch_fast(pairs):
            t = e.type_ids
            seqs.append(np.asarray(e.ids, dtype=np.int32))
            starts.append(t.index(1) if 1 in t else 0)
        return seqs, starts

    async def encode_pairs(self, query: str | list[str], documents: list[str], truncate: bool,
                           param: str = "documents", item: str = "document {} with the query",
                           instruction: str | None = None) -> tuple[list[np.ndarray], list[int]]:
        """A cross-encoder's (query, document) pairs as the tokenizer's pair template builds them
        (`tokenizer(query, document)`: `[CLS] q [SEP] d [SEP]`, `<s> q </s></s> d </s>`), and per pair
        where token type 1 starts (0: the template types every token 0). `query`: one for every
        document, or one per document (pairwise). With `truncate` the pair is cut to the maximum
        longest side first (`truncation="longest_first"`, as sentence-transformers' CrossEncoder cuts
        it: in practice the document); without, a longer pair is a 400 for `param` naming it as
        `item.format(i)`. A model with a chat template (`chat`) renders each pair by it instead, with
        `instruction` as its system message, one segment each."""
        queries = [query] * len(documents) if isinstance(query, str) else query
        if self.chat is None and self.segmentable and max(map(len, [*queries, *documents])) > SEGMENT_CHARS:
            queries, documents = await asyncio.to_thread(self._long_pairs, queries, documents, truncate, param, item)
        pairs = list(zip(queries, documents))
        chars = sum(map(len, queries)) + sum(map(len, documents))
        if self.chat is not None:
            try:
                seqs = await self._chat_pairs(pairs, truncate, instruction, chars)
            except ValueError as e:
                raise APIError(400, str(e), param) from None
            starts = [0] * len(seqs)
        elif not self.pair_boundary:
            raise APIError(400, "this model's tokenizer types a pair's tokens other than as two segments; "
                           "it cannot score pairs", "model")
        elif chars <= self.offload_chars:
            seqs, starts = self._pairs(pairs, truncate)
        else:  # `tokenizers` releases the GIL: off the event loop
            seqs, starts = await asyncio.to_thread(self._pairs_exact, pairs, truncate)
        if not truncate:
            for i, s in enumerate(seqs):
                if len(s) > self.max_len:
                    raise APIError(400, f"{item.format(i)} has {len(s)} tokens, more than this model's "
                                   f"maximum of {self.max_len}; shorten it or send \"truncate\": true",
                                   param, "context_length_exceeded")
        return seqs, starts

    def _long_pairs(self, queries: list[str], documents: list[str], truncate: bool, param: str, item: str
                    ) -> tuple[list[str], list[str]]:
        """Pairs holding a text over SEGMENT_CHARS, that text tokenized only as far as needed
        (ivy.tokenizer_long): truncating, cut to a prefix holding more tokens than a pair keeps of
        it (a side is cut to at most the pair's room); not truncating, a 400 for the first pair with
        a text that alone is over the maximum. Known limit: when both texts of a pair are cut and
        the room is odd, `tokenizers` gives the extra token to the longer text, here to the one with
        the longer prefix."""
        room = self.max_len
        cut: dict[str, str] = {}
        for i, pair in enumerate(zip(queries, documents)):
            for t in pair:
                if len(t) > SEGMENT_CHARS and t not in cut:
                    p = scan(t, self.content, room + 1, self.cuts)
                    if not truncate and not p.whole:
                        raise APIError(400, f"{item.format(i)} has more than this model's maximum of {self.max_len} "
                                       "tokens; shorten it or send \"truncate\": true", param, "context_length_exceeded")
                    cut[t] = t if p.whole else t[:p.end]
        return [cut.get(q, q) for q in queries], [cut.get(d, d) for d in documents]

    async def _chat_pairs(self, pairs: list[tuple[str, str]], truncate: bool, instruction: str | None,
                          chars: int) -> list[np.ndarray]:
        if chars <= self.offload_chars:
            return self.chat.encode(pairs, truncate, instruction)
        return await asyncio.to_thread(self.chat.encode, pairs, truncate, instruction)

    def cut(self, texts: list[str], max_tokens: int) -> list[str]:
        """Each text cut after its first `max_tokens` tokens (tokenized alone, special tokens not
        counted): at the end of that token's characters. WordPiece re-tokenizes the cut text to
        exactly those tokens (its greedy longest match is prefix-stable); other models may differ
        at the boundary by a token."""
        out = []
        for t, e in zip(texts, self.exact.encode_batch(texts, add_special_tokens=False)):
            out.append(t if len(e.offsets) <= max_tokens else t[: e.offsets[max_tokens - 1][1]])
        return out

    def prompt_length(self, prompt: str) -> int:
        """Tokens a prompt takes at the start of an input, counted as sentence-transformers (6.x)
        counts them for `include_prompt: false`: the prompt encoded alone with the special tokens the
        tokenizer adds, less a trailing special token (BERT's [SEP]; a BOS-only tokenizer keeps all)."""
        return self._prompt_length(prompt)

    def _count_prompt(self, prompt: str) -> int:
        ids = self.exact.encode(prompt).ids
        return len(ids) - (1 if ids and ids[-1] in self._special else 0)

    @functools.cached_property
    def wrap(self) -> tuple[list[int], list[int]] | None:
        """The special tokens the tokenizer puts around a single text ([CLS] ... [SEP], <s> ... </s>),
        as (prefix, suffix); None where its post-processor is not a fixed prefix and suffix."""
        return fixed_wrap(self.exact)

    def windows(self, seq: np.ndarray, mode: str, keep: int = 0) -> list[np.ndarray]:
        """A whole encoded text (`seq`, special tokens included) longer than the maximum, cut to it:
        "start" keeps its last content tokens after the first `keep` (a prompt), "chunk" splits its
        content into consecutive windows of `max_len - specials` tokens (the last one shorter);
        each result wrapped in the tokenizer's special tokens as a single text is."""
        if self.wrap is None:
            raise APIError(400, f"truncate \"{mode}\" needs a tokenizer that wraps a text in fixed special "
                           "tokens; this model's does not", "truncate")
        prefix, suffix = self.wrap
        room = self.max_len - len(prefix) - len(suffix)
        if room < 1:
            raise APIError(400, f"this model's maximum of {self.max_len} tokens leaves no room for content",
                           "truncate")
        content = seq[len(prefix): len(seq) - len(suffix)]
        head, tail = np.asarray(prefix, np.int32), np.asarray(suffix, np.int32)
        if mode == "start":
            keep = keep if keep < room else 0  # a prompt longer than the room is not kept whole
            return self.padded([np.concatenate([head, content[:keep], content[len(content) - (room - keep):], tail])])
        return self.padded([np.concatenate([head, content[i: i + room], tail]) for i in range(0, len(content), room)])

    def padded(self, seqs: list[np.ndarray]) -> list[np.ndarray]:
        """Each sequence shorter than `pad_to` padded to it with `pad_id` (before it where `pad_left`): SigLIP's
        text tower was trained on texts of its full width and reads every position unmasked, pooling the
        last, so a text is what its processor makes with padding="max_length" (ModelSpec.pad_to)."""
        if not self.pad_to:
            return seqs
        out = []
        for s in seqs:
            if len(s) < self.pad_to:
                pad = np.full(self.pad_to - len(s), self.pad_id, np.int32)
                s = np.concatenate([pad, s] if self.pad_left else [s, pad])
            out.append(s)
        return out

    def token(self, token_id: int) -> str:
        return self.exact.id_to_token(token_id) or ""

    def segments(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of a long text's segments, cut where this tokenizer's rule allows
        (ivy.tokenizer_long; only where `segmentable`)."""
        return segments(text, self.cuts)

    def content(self, text: str) -> np.ndarray:
        """`text`'s ids without the special tokens (one segment of a long text)."""
        if self.fast is not None:
            a = self.fast.ids(text)
            return a[len(self.fast.prefix): len(a) - len(self.fast.suffix)]
        return np.asarray(self.exact.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def _wrapped(self, content: np.ndarray) -> np.ndarray:
        prefix, suffix = self.wrap
        return np.concatenate([np.asarray(prefix, np.int32), content, np.asarray(suffix, np.int32)])

    def _long(self, text: str, truncate: bool, check_length: bool, room: int, which: str, param: str
              ) -> np.ndarray | str:
        """A text over SEGMENT_CHARS tokenized only as far as the request needs (ivy.tokenizer_long):
        its ids, or the text (a prefix of it where truncating) for the usual path where the
        tokenizer's special tokens are not a fixed prefix and suffix. `room`: the tokens the request
        may still take (--max-request-tokens)."""
        wrap = self.wrap
        n_special = len(wrap[0]) + len(wrap[1]) if wrap is not None else 0
        if truncate:
            budget = max(self.max_len - n_special, 0)
            p = scan(text, self.content, budget, self.cuts)
            return self._wrapped(p.ids[:budget]) if wrap is not None else text[:p.end]
        if check_length:  # over the maximum as soon as a prefix is: the rest is counted only while cheap
            p = scan(text, self.content, self.max_len - n_special + 1 if len(text) > COUNT_CHARS else room + 1,
                     self.cuts)
            if not p.whole:
                raise APIError(400, f"{which} has more than this model's maximum of {self.max_len} tokens; "
                               "shorten it or send \"truncate\": true", param, "context_length_exceeded")
        else:
            p = scan(text, self.content, room - n_special + 1, self.cuts)
            if not p.whole or len(p.ids) + n_special > room:
                raise self.too_many_tokens()
        return self._wrapped(p.ids) if wrap is not None else text

    def too_many_tokens(self) -> APIError:
        return APIError(413, f"the request makes more than {self.max_request_tokens} tokens (this server's "
                        "--max-request-tokens); send fewer or shorter inputs", None, "request_too_large")

    def _encode(self, texts: list[str], truncate: bool) -> list[np.ndarray]:
        if self.fast is not None:
            budget = max(self.max_len - self.fast.n_special, 0) if truncate else None
            return self.fast.ids_many(texts, budget)
        return self._encode_exact(texts, truncate)  # encode_batch_fast: no character offsets (15-25 % faster)

    def _encode_exact(self, texts: list[str], truncate: bool, room: int | None = None) -> list[np.ndarray]:
        """`tokenizers` whatever the fast encoder: it releases the GIL, so it can run in a thread. In
        slices of ~SLICE_CHARS characters (its Encodings cost ~100 bytes a token, held until they
        are turned into arrays); more than `room` tokens in all is a 413 at the slice that makes them."""
        wrap = self.wrap if truncate else None
        if wrap is not None and self.max_len >= len(wrap[0]) + len(wrap[1]):  # cut here: no truncating Tokenizer
            budget = self.max_len - len(wrap[0]) - len(wrap[1])
            head, tail = np.asarray(wrap[0], np.int32), np.asarray(wrap[1], np.int32)

            def batch(part: list[str]) -> list[np.ndarray]:
                return [np.concatenate([head, np.asarray(e.ids[:budget], dtype=np.int32), tail])
                        for e in self.exact.encode_batch_fast(part, add_special_tokens=False)]
        else:
            tok = self.truncating if truncate else self.exact

            def batch(part: list[str]) -> list[np.ndarray]:
                return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(part)]
        out: list[np.ndarray] = []
        start, chars, total = 0, 0, 0
        for i, t in enumerate(texts):
            chars += len(t)
            if chars >= SLICE_CHARS or i == len(texts) - 1:
                out += batch(texts[start:i + 1])
                total += sum(map(len, out[start:]))
                if room is not None and total > room:
                    raise self.too_many_tokens()
                start, chars = i + 1, 0
        return out

    async def _encode_yielding(self, texts: list[str], truncate: bool, room: int) -> list[np.ndarray]:
        """The fast encoder on a large batch: in slices of ~YIELD_CHARS characters, letting the event
        loop run between them (a worker thread would not help: ivy.native holds the GIL while it
        encodes); more than `room` tokens in all is a 413 at the slice that makes them."""
        out: list[np.ndarray] = []
        start, chars, total = 0, 0, 0
        for i, t in enumerate(texts):
            chars += len(t)
            if chars >= YIELD_CHARS or i == len(texts) - 1:
                out += self._encode(texts[start:i + 1], truncate)
                total += sum(map(len, out[start:]))
                if total > room:
                    raise self.too_many_tokens()
                start, chars = i + 1, 0
                await asyncio.sleep(0)
        return out

    async def encode(self, texts: list[str], truncate: bool, check_length: bool = True,
                     param: str = "input", item: str | None = "input") -> list[np.ndarray]:
        """Encode; large batches (over `offload_chars` characters) go to a worker thread with
        `tokenizers` (its Rust encoder releases the GIL) or yield to the event loop between slices
        with the fast encoder. Without `truncate`, a text over the maximum is a 400 for `param` (the
        request field the texts came from) naming text i as "{item} {i}", or as `param` when item is
        None (a field of one text), unless `check_length` is off (counting only). A text over
        SEGMENT_CHARS characters is tokenized (in a thread) only as far as that needs
        (`_long`). More than `max_request_tokens` tokens in all is a 413, found as they are made."""
        room = self.max_request_tokens
        done: dict[int, np.ndarray] = {}
        if self.segmentable and texts and max(map(len, texts)) > SEGMENT_CHARS:
            texts = list(texts)
            for i, t in enumerate(texts):
                if len(t) > SEGMENT_CHARS:
                    which = param if item is None else f"{item} {i}"
                    got = await asyncio.to_thread(self._long, t, truncate, check_length, room, which, param)
                    if isinstance(got, str):
                        texts[i] = got
                    else:
                        done[i] = got
                        room -= len(got)
            rest = [t for i, t in enumerate(texts) if i not in done] if done else texts
        else:
            rest = texts
        if not rest:
            seqs = []
        elif sum(map(len, rest)) <= self.offload_chars:
            seqs = self._encode(rest, truncate)
        elif self.fast is not None and max(map(len, rest)) <= YIELD_CHARS:
            seqs = await self._encode_yielding(rest, truncate, room)
        else:  # the fast encoder cannot yield inside one long text: `tokenizers` (same tokens) in a thread
            seqs = await asyncio.to_thread(self._encode_exact, rest, truncate, room)
        if sum(map(len, seqs)) > room:
            raise self.too_many_tokens()
        if done:
            it = iter(seqs)
            seqs = [done[i] if i in done else next(it) for i in range(len(texts))]
        if not truncate and check_length:
            for i, s in enumerate(seqs):
                if len(s) > self.max_len:
                    which = param if item is None else f"{item} {i}"
                    raise APIError(
                        400,
                        f"{which} has {len(s)} tokens, more than this model's maximum of {self.max_len}; "
                        "shorten it or send \"truncate\": true",
                        param, "context_length_exceeded",
                    )
        return self.padded(seqs)
