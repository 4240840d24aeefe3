"""A cross-encoder's (query, document) pairs through its chat template, for a model whose Transformer
module takes messages (causal-LM rerankers as sentence-transformers 6 publishes them, e.g.
Qwen3-Reranker, and their `*ForSequenceClassification` conversions), exactly as
`CrossEncoder.predict` builds them:

- each pair becomes the messages `[{"role": "query", ...}, {"role": "document", ...}]`, with a
  request's instruction first as `{"role": "system", ...}` (`predict(prompt=...)`); content a string
  ("flat") or `[{"type": "text", "text": ...}]` ("structured"), as `ModelSpec.message_format` says;
- the messages are rendered by the directory's template the way transformers renders chat templates
  (Jinja's immutable sandbox, `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
  `tojson`, `strftime_now`, the tokenizer's special tokens by name, no generation prompt);
- the text is tokenized whole, without added special tokens (`apply_chat_template(tokenize=True)`);
- a pair over the maximum is cut from the right and the template's closing tokens are written back
  over its last tokens (sentence-transformers' `restore_suffix`), so the last token a causal reranker
  reads is still the template's own. The closing tokens are found as sentence-transformers finds
  them: the longest common token suffix of two renders with different stand-in contents.

A caller's text is rendered as text: special-token strings inside it are matched as special tokens
by the tokenizer, as transformers does by default (`sanitize_control_tokens=False`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# The probe pairs whose contents must reach the render (else the template cannot carry a pair).
_PROBES = (("probe query", "probe document"), ("other query", "probe document"), ("probe query", "other document"))
_FILLERS = ("0", "1 2 3 4")  # sentence-transformers' stand-in contents for finding the closing tokens
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens(path: Path) -> dict:
    """The tokenizer's special tokens by name (`bos_token`, ...), as transformers hands them to a chat
    template: from tokenizer_config.json, else special_tokens_map.json; a name set to null is left out."""
    out: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as transformers reads
        f = path / name
        cfg = json.loads(f.read_text()) if f.is_file() else {}
        for key in _SPECIAL_NAMES:
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                out[key] = v
            elif key in cfg and v is None:
                out.pop(key, None)
    return out


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """`source` compiled in the environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as their body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore names (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {key!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=Namespace)
    return env.from_string(source)


class ChatPairs:
    """Pairs rendered by `template` and tokenized by `tokenizer` (no truncation set on it), cut to `max_len`."""

    def __init__(self, template: str, message_format: str, tokenizer: Tokenizer, max_len: int, specials: dict):
        self.template = compile_template(template)
        self.structured = message_format == "structured"
        self.tokenizer, self.max_len, self.specials = tokenizer, max_len, specials
        self.suffix = functools.lru_cache(maxsize=256)(self._suffix)  # by instruction: caller text, bounded
        try:
            base, *varied = (self.render(q, d) for q, d in _PROBES)
        except Exception as e:  # the template's own error (raise_exception, a bad construct)
            raise ValueError(f"the chat template cannot render a (query, document) pair: {type(e).__name__}: {e}")
        if base in varied:
            raise ValueError("the chat template does not render a (query, document) pair's query and document "
                             "('query' / 'document' roles), so it cannot score pairs")

    def _content(self, text: str):
        return [{"type": "text", "text": text}] if self.structured else text

    def messages(self, query: str, document: str, instruction: str | None = None) -> list[dict]:
        head = [] if instruction is None else [{"role": "system", "content": self._content(instruction)}]
        return head + [{"role": "query", "content": self._content(query)},
                       {"role": "document", "content": self._content(document)}]

    def render(self, query: str, document: str, instruction: str | None = None) -> str:
        return self.template.render(messages=self.messages(query, document, instruction), tools=None, documents=None,
                                    add_generation_prompt=False, **self.specials)

    def _suffix(self, instruction: str | None) -> tuple[int, ...]:
        """The template's closing tokens after the document: the longest common token suffix of two
        renders with different stand-in contents (none where they never differ)."""
        a, b = (self.tokenizer.encode(self.render(f, f, instruction), add_special_tokens=False).ids for f in _FILLERS)
        n = 0
        for x, y in zip(reversed(a), reversed(b)):
            if x != y:
                break
            n += 1
        return tuple(a[len(a) - n:]) if 0 < n < min(len(a), len(b)) else ()

    def encode(self, pairs: list[tuple[str, str]], truncate: bool, instruction: str | None = None) -> list[np.ndarray]:
        """Each pair's token ids; with `truncate`, cut to the maximum with the closing tokens restored."""
        try:
            texts = [self.render(q, d, instruction) for q, d in pairs]
        except Exception as e:  # the template's raise_exception, or its sandbox, on a caller's text
            raise ValueError(f"the model's chat template refused the input: {type(e).__name__}: {e}") from None
        out = []
        for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False):
            ids = np.asarray(e.ids, dtype=np.int32)
            if truncate and len(ids) >= self.max_len:
                ids = ids[:self.max_len].copy()
                tail = self.suffix(instruction)[-self.max_len:]
                if tail:
                    ids[len(ids) - len(tail):] = tail
            out.append(ids)
        return out
