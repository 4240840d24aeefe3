"""SigLIP 1's tokenizer read from its `spiece.model`: google/siglip-* publish only the SentencePiece model of
transformers' slow `SiglipTokenizer` (no tokenizer.json, and transformers has no fast SigLIP tokenizer: its issue
#29925), so this reproduces it, token for token, over a `tokenizers` Unigram model built when the directory is read.

What `SiglipTokenizer` (transformers 5, models/siglip/tokenization_siglip.py) does to a text, and where:
1. `tokenize`: "▁" + the text with every "▁" made a space, split at its special tokens (`</s>`, `<unk>`, the pad
   token, any additional ones) as its trie splits them; each other part canonicalised (`canonicalize_text`:
   `str.lower()` where do_lower_case, `string.punctuation` removed, each run of `\\s` one space, `strip()`).
   In Python here (`Canonical.parts`): `tokenizers`' Lowercase maps each character alone (no final sigma: "ΟΔΟΣ"
   gives "οδοσ", Python "οδος") with Rust's Unicode tables (55 code points Python 3.11's Unicode 14 leaves as they
   are), it would lower-case "</S>" into the special token before the split, and only the first part has a "▁".
2. `_tokenize`: SentencePiece encodes "<unk>" + the part and drops as many pieces as "<unk>" alone makes. Its
   normalisation (the precompiled charsmap, longest match first; runs of spaces one, leading / trailing ones
   dropped; spaces as "▁"; the dummy "▁" prefix) is `Charsmap.normalize`, in Python: `tokenizers`' Precompiled
   normalizer looks a whole grapheme up and takes a proper prefix's rule for all of it ("ϕﾟ" gives "φ",
   SentencePiece "φ゚"). The Unigram model is `tokenizers`' (`build`: the proto's pieces and float scores, its unk
   id; SentencePiece never matches its control and unknown pieces, so their strings in that model hold a space,
   which a normalised text never does), over the whole "<unk>" + part, its first ids dropped as SigLIP drops them.
3. `tokenize` drops a leading "▁" piece followed by a special token, and `build_inputs_with_special_tokens` appends
   `</s>` unless the ids end with it already (a text ending in a literal "</s>"): both on the ids here.
Known limit: SentencePiece sums scores in float32, `tokenizers` in float64, so a near-tie between two
segmentations could go the other way. Offsets are each part's span in the text. A SentencePiece model that is not
Unigram, has user-defined or byte pieces, or leaves spaces unescaped is refused with the reason.
"""

from __future__ import annotations

import functools
import json
import re
import string
from array import array
from dataclasses import dataclass, field
from pathlib import Path

SPIECE = "spiece.model"
CLASSES = ("SiglipTokenizer",)  # tokenizer_config.json's tokenizer_class read from spiece.model here
MAX_LENGTH = 64  # SiglipTokenizer's default model_max_length
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM = 1  # TrainerSpec.ModelType
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _proto_classes():
    """sentencepiece_model.proto's messages, the fields read here, defined at run time: protobuf's runtime
    parses them (the gateway has protobuf but neither sentencepiece nor transformers, whose generated modules hold
    this proto). Field numbers and defaults as in sentencepiece_model.proto; enums read as int32."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="trellis_spiece.proto", package="trellis_spiece", syntax="proto2")

    def message(name, fields):
        m = f.message_type.add(name=name)
        for fname, number, ftype, extra in fields:
            m.field.add(name=fname, number=number, type=ftype, label=extra.pop("label", F.LABEL_OPTIONAL), **extra)

    message("SentencePiece", [("piece", 1, F.TYPE_STRING, {}), ("score", 2, F.TYPE_FLOAT, {}),
                              ("type", 3, F.TYPE_INT32, {"default_value": "1"})])
    message("TrainerSpec", [("model_type", 3, F.TYPE_INT32, {"default_value": "1"}),
                            ("byte_fallback", 35, F.TYPE_BOOL, {"default_value": "false"})])
    message("NormalizerSpec", [("precompiled_charsmap", 2, F.TYPE_BYTES, {}),
                               ("add_dummy_prefix", 3, F.TYPE_BOOL, {"default_value": "true"}),
                               ("remove_extra_whitespaces", 4, F.TYPE_BOOL, {"default_value": "true"}),
                               ("escape_whitespaces", 5, F.TYPE_BOOL, {"default_value": "true"})])
    message("ModelProto", [
        ("pieces", 1, F.TYPE_MESSAGE, {"type_name": ".trellis_spiece.SentencePiece", "label": F.LABEL_REPEATED}),
        ("trainer_spec", 2, F.TYPE_MESSAGE, {"type_name": ".trellis_spiece.TrainerSpec"}),
        ("normalizer_spec", 3, F.TYPE_MESSAGE, {"type_name": ".trellis_spiece.NormalizerSpec"})])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("trellis_spiece.ModelProto"))


_ModelProto = functools.lru_cache(maxsize=1)(_proto_classes)


@dataclass(frozen=True)
class SpModel:
    """What a SentencePiece Unigram model (spiece.model) holds that encoding needs.

    pieces:   (piece, score, type) per id; score the proto's float32 as a Python float (exact).
    unk_id:   the UNKNOWN piece's id.
    charsmap: the normalizer's precompiled charsmap (b"": none, the identity).
    remove_extra_whitespaces: whether runs of spaces become one and leading / trailing ones are dropped.
    add_dummy_prefix: whether a "▁" goes before the normalised text.
    """

    pieces: tuple[tuple[str, float, int], ...]
    unk_id: int
    charsmap: bytes
    remove_extra_whitespaces: bool
    add_dummy_prefix: bool

    def id(self, piece: str) -> int | None:
        return self._ids.get(piece)

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        ids: dict[str, int] = {}
        for i, (p, _, _) in enumerate(self.pieces):
            ids.setdefault(p, i)
        return ids


def read_model(path: Path) -> SpModel:
    """spiece.model parsed and checked: a Unigram model this module reproduces, else a ValueError naming why."""
    stat = path.stat()
    return _read_model(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_model(path: Path, _mtime: int, _size: int) -> SpModel:
    from google.protobuf.message import DecodeError

    proto = _ModelProto()()
    try:
        proto.ParseFromString(path.read_bytes())
    except DecodeError as e:
        raise ValueError(f"{path} is not a SentencePiece model ({e})") from None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = tuple((p.piece, float(p.score), int(p.type)) for p in proto.pieces)
    unk = [i for i, p in enumerate(pieces) if p[2] == UNKNOWN]
    why = ("its model type is not Unigram" if trainer.model_type != UNIGRAM else
           "it falls back to bytes (byte_fallback)" if trainer.byte_fallback else
           "it leaves spaces unescaped (escape_whitespaces false)" if not norm.escape_whitespaces else
           "it has no single <unk> piece" if len(unk) != 1 else
           "it has user-defined or byte pieces" if any(t in (USER_DEFINED, BYTE) for _, _, t in pieces) else
           "it has no normal pieces" if not any(t == NORMAL for _, _, t in pieces) else "")
    if why:
        raise ValueError(f"{path}: this SentencePiece model cannot be served as SiglipTokenizer's: {why}")
    return SpModel(pieces, unk[0], bytes(norm.precompiled_charsmap), bool(norm.remove_extra_whitespaces),
                   bool(norm.add_dummy_prefix))


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


@dataclass(frozen=True)
class SiglipFiles:
    """A SigLIP 1 tokenizer's files, as `SiglipTokenizer.from_pretrained` reads them.

    model:     spiece.model, parsed (`SpModel`).
    lower:     tokenizer_config.json's do_lower_case (SiglipTokenizer's default: true).
    eos:       its eos_token ("</s>"), appended to every text.
    specials:  every special token's text -> id: eos, unk, pad, additional_special_tokens and the added tokens
               it lists (each must be a piece of the model: SigLIP's are).
    """

    model: SpModel
    lower: bool
    eos: str
    specials: dict[str, int]


def read_files(model_dir: Path) -> SiglipFiles | None:
    """The directory's SigLIP 1 tokenizer files: None where it has a tokenizer.json, no spiece.model, or a
    tokenizer_config.json naming a class other than SiglipTokenizer; a ValueError where they cannot be served."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file() or not (model_dir / SPIECE).is_file():
        return None
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if cfg.get("tokenizer_class") not in CLASSES:
        return None
    model = read_model(model_dir / SPIECE)
    special_map_path = model_dir / "special_tokens_map.json"
    special_map = json.loads(special_map_path.read_text()) if special_map_path.is_file() else {}

    def named(key: str, default: str) -> str:
        return _token(cfg.get(key)) or _token(special_map.get(key)) or default

    eos = named("eos_token", "</s>")
    texts = [eos, named("unk_token", "<unk>"), named("pad_token", "</s>")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = cfg.get(key) or special_map.get(key) or []
        texts += [_token(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    texts += [_token(t) for t in (cfg.get("added_tokens_decoder") or {}).values()]
    specials = {}
    for t in texts:
        if t and t not in specials:
            if model.id(t) is None:
                raise ValueError(f"{model_dir}: the special token {t!r} is not a piece of {SPIECE} (tokens added "
                                 "beyond the SentencePiece vocabulary are not supported)")
            specials[t] = model.id(t)
    return SiglipFiles(model, bool(cfg.get("do_lower_case", True)), eos, specials)


def tokenizer_dict(model_dir: Path) -> dict | None:
    """What trellis.modeldir reads of a tokenizer.json (added tokens, the Unigram vocabulary) for a SigLIP 1
    directory; None for any other."""
    files = read_files(model_dir)
    if files is None:
        return None
    return {"added_tokens": [{"id": i, "content": t, "special": True} for t, i in files.specials.items()],
            "model": {"type": "Unigram", "vocab": [[p, s] for p, s, _ in files.model.pieces]}}


class Charsmap:
    """SentencePiece's normaliser (normalizer.cc, `Normalize` / `NormalizePrefix`) over a precompiled charsmap: a
    darts-clone double array of the rules' UTF-8 keys (value: an offset into the NUL-terminated replacements after
    it), the longest rule matching at each point, else one character as it is."""

    SPACE = "\u2581".encode()

    def __init__(self, model: SpModel):
        blob = model.charsmap
        size = int.from_bytes(blob[:4], "little") if blob else 0
        self.units = array("I", blob[4:4 + size])  # uint32, little-endian (as written, on every host we run)
        self.rules = blob[4 + size:]
        self.remove_extra, self.dummy = model.remove_extra_whitespaces, model.add_dummy_prefix
        root = self._offset(self.units[0]) if self.units else 0
        # bytes a rule can start with (the first step of the search): any other character is kept as it is
        self.starts = {b for b in range(256) if self.units and root ^ b < len(self.units)
                       and self._label(self.units[root ^ b]) == b}

    @staticmethod
    def _offset(unit: int) -> int:
        return (unit >> 10) << ((unit & (1 << 9)) >> 6)

    @staticmethod
    def _label(unit: int) -> int:
        return unit & ((1 << 31) | 0xFF)

    def _rule(self, data: bytes, i: int) -> tuple[int, bytes] | None:
        """The longest rule matching `data` at `i`: (bytes it takes, its replacement), or None."""
        units, pos, best = self.units, self._offset(self.units[0]), None
        for j in range(i, len(data)):
            b = data[j]
            pos ^= b
            if pos >= len(units) or self._label(units[pos]) != b:
                break
            unit = units[pos]
            pos ^= self._offset(unit)
            if (unit >> 8) & 1:  # a rule ends here: its value is the leaf's
                at = units[pos] & ((1 << 31) - 1)
                best = (j + 1 - i, self.rules[at:self.rules.index(b"\0", at)])
        return best

    def _prefix(self, data: bytes, i: int) -> tuple[int, bytes]:
        """NormalizePrefix: (bytes taken, what they become) at `i`."""
        if data[i] in self.starts:
            rule = self._rule(data, i)
            if rule is not None:
                return rule
        lead = data[i]
        n = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4 if lead >> 3 == 30 else 0
        try:
            data[i:i + n].decode("utf-8") if n else b"\xff".decode()
        except UnicodeDecodeError:  # a malformed byte: U+FFFD, one byte taken
            return 1, "\ufffd".encode()
        return n, data[i:i + n]

    def normalize(self, text: str) -> str:
        """`text` as SentencePiece normalises it before its Unigram model (spaces as "▁")."""
        data, out, i = text.encode("utf-8", "surrogatepass"), bytearray(), 0
        if self.remove_extra:  # leading spaces
            while i < len(data):
                n, rep = self._prefix(data, i)
                if rep != b" ":
                    break
                i += n
        if i == len(data):
            return ""
        if self.dummy:
            out += self.SPACE
        prev_space = self.remove_extra
        while i < len(data):
            n, rep = self._prefix(data, i)
            if prev_space:
                rep = rep.lstrip(b" ")
            if rep:
                out += rep.replace(b" ", self.SPACE)
                prev_space = rep.endswith(b" ")
            i += n
            if not self.remove_extra:
                prev_space = False
        if self.remove_extra:
            while out.endswith(self.SPACE):
                del out[-len(self.SPACE):]
        return out.decode("utf-8", "replace")


def build(files: SiglipFiles):
    """SentencePiece's Unigram model as a `tokenizers.Tokenizer` (built with its Python API: the scores go in as
    the proto's exact values, not through JSON text). The pieces SentencePiece never matches in a text (unknown,
    control: "<unk>", "</s>", "<pad>") get a string with a space in it, which no normalised text holds, and the
    lowest normal score: SentencePiece takes unk's score from the lowest normal piece (less 10), tokenizers from
    the lowest of all."""
    from tokenizers import Tokenizer, models

    m = files.model
    low = min(s for _, s, t in m.pieces if t == NORMAL)
    vocab = [(p, s) if t == NORMAL else (f"{p} {i}", low) for i, (p, s, t) in enumerate(m.pieces)]
    return Tokenizer(models.Unigram(vocab, m.unk_id, False))


@dataclass
class Encoded:
    """One text's (or pair's) ids as `Canonical` gives them, with the fields of a `tokenizers.Encoding` that Ivy
    reads; offsets are the span of the part of the text each token came from."""

    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]
    special_tokens_mask: list[int]
    sequence_ids: list[int | None] = field(default_factory=list)

    @property
    def type_ids(self) -> list[int]:
        return [0] * len(self.ids)  # SiglipTokenizer's create_token_type_ids_from_sequences

    @property
    def attention_mask(self) -> list[int]:
        return [1] * len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class Canonical:
    """SiglipTokenizer over `build`'s Unigram model: `encode` / `encode_batch` / `encode_batch_fast` (texts, or
    pairs: A </s> B </s>), `decode` / `decode_batch`, `id_to_token`, `token_to_id`, the added (special) tokens, a
    truncation length; the rest of a `tokenizers.Tokenizer`'s attributes are the Unigram model's own."""

    def __init__(self, files: SiglipFiles, tokenizer):
        self.tokenizer, self.files = tokenizer, files
        self.charsmap = Charsmap(files.model)
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(files.specials, key=len, reverse=True))) + ")")
        self._space = files.model.id("\u2581")
        self._eos = files.specials[files.eos]
        self._unk = next(t for t, i in files.specials.items() if i == files.model.unk_id) if (
            files.model.unk_id in files.specials.values()) else "<unk>"
        # the ids "<unk>" alone makes, dropped from each part's (step 2: SiglipTokenizer's unk_token_length)
        self._drop = len(tokenizer.encode(self._pieces(""), add_special_tokens=False).ids)
        self._special_ids = frozenset(files.specials.values())
        self.max_length: int | None = None

    def __getattr__(self, name):
        if name in ("tokenizer", "files"):  # not set yet
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def parts(self, text: str) -> list[tuple[str, int, int] | tuple[int, int, int]]:
        """Step 1: the text's parts in order, (canonical text, start, end) or (special token id, start, end)."""
        src = "\u2581" + text.replace("\u2581", " ")
        out, at = [], 0
        for k, p in enumerate(self._split.split(src)):
            span = (max(at - 1, 0), max(at - 1 + len(p), 0))  # in `text` (without the leading "▁")
            at += len(p)
            if k % 2:
                out.append((self.files.specials[p], *span))
            else:
                p = p.lower() if self.files.lower else p
                p = re.sub(r"\s+", " ", p.translate(_PUNCTUATION)).strip()
                if p:
                    out.append((p, *span))
        return out

    def _pieces(self, part: str) -> str:
        """What the Unigram model reads for a part: "<unk>" + the part, normalised as SentencePiece does."""
        return self.charsmap.normalize(self._unk + part)

    def _encode(self, texts: list[str], special: bool) -> list[Encoded]:
        split = [self.parts(t) for t in texts]
        chunks = [self._pieces(p[0]) for ps in split for p in ps if isinstance(p[0], str)]
        got = iter(self.tokenizer.encode_batch_fast(chunks, add_special_tokens=False) if chunks else [])
        out = []
        for ps in split:
            ids, offsets, literal = [], [], []
            for p in ps:
                new = [p[0]] if isinstance(p[0], int) else next(got).ids[self._drop:]
                ids += new
                offsets += [p[1:]] * len(new)
                literal += [isinstance(p[0], int)] * len(new)
            # step 3: a leading "▁" before a special token goes; no eos after one
            if len(ids) > 1 and ids[0] == self._space and literal[1]:
                ids, offsets, literal = ids[1:], offsets[1:], literal[1:]
            if special and self.max_length is not None:
                ids, offsets, literal = (x[:max(self.max_length - 1, 0)] for x in (ids, offsets, literal))
            if special and not (ids and ids[-1] == self._eos):
                ids, offsets, literal = ids + [self._eos], offsets + [(0, 0)], literal + [True]
            out.append(Encoded(ids, [self.id_to_token(i) for i in ids], offsets,
                               [int(x and i in self._special_ids) for x, i in zip(literal, ids)], [0] * len(ids)))
        return out

    def encode(self, sequence, pair=None, is_pretokenized=False, add_special_tokens=True) -> Encoded:
        if is_pretokenized:
            raise ValueError("SigLIP's SentencePiece tokenizer takes texts, not pre-tokenized words")
        if pair is None:
            return self._encode([sequence], add_special_tokens)[0]
        a, b = self._encode([sequence, pair], add_special_tokens)
        seq = [0] * len(a.ids) + [1] * len(b.ids)
        if add_special_tokens:  # each side ends with one eos (SiglipTokenizer's build_inputs: A </s> B </s>)
            seq[len(a.ids) - 1], seq[-1] = None, None
        return Encoded(a.ids + b.ids, a.tokens + b.tokens, a.offsets + b.offsets,
                       a.special_tokens_mask + b.special_tokens_mask, seq)

    def encode_batch(self, input, is_pretokenized=False, add_special_tokens=True) -> list[Encoded]:
        if is_pretokenized:
            raise ValueError("SigLIP's SentencePiece tokenizer takes texts, not pre-tokenized words")
        if all(isinstance(x, str) for x in input):
            return self._encode(list(input), add_special_tokens)
        return [self.encode(*((x,) if isinstance(x, str) else x), add_special_tokens=add_special_tokens)
                for x in input]

    encode_batch_fast = encode_batch

    def id_to_token(self, i: int) -> str | None:
        pieces = self.files.model.pieces
        return pieces[i][0] if 0 <= i < len(pieces) else None

    def token_to_id(self, token: str) -> int | None:
        return self.files.model.id(token)

    def get_added_tokens_decoder(self) -> dict:
        from tokenizers import AddedToken

        return {i: AddedToken(t, special=True, normalized=False) for t, i in self.files.specials.items()}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The pieces joined, "▁" as spaces (SentencePiece's decoding), special tokens as their text or left out."""
        out = "".join(("" if skip_special_tokens else self.id_to_token(i)) if i in self._special_ids else
                      (self.id_to_token(i) or "") for i in ids)
        return out.replace("\u2581", " ").strip()

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def enable_truncation(self, max_length: int, **_) -> None:
        self.max_length = max_length

    def no_truncation(self) -> None:
        self.max_length = None

    def no_padding(self) -> None:
        pass


def load(model_dir: Path):
    """The directory's tokenizer for Ivy: its tokenizer.json (a `tokenizers.Tokenizer`), else a SigLIP 1
    spiece.model (`Canonical`); a ValueError where it has neither."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    files = read_files(Path(model_dir))
    if files is None:
        has = " (its spiece.model is read for tokenizer_class SiglipTokenizer only)" if (
            Path(model_dir) / SPIECE).is_file() else ""
        raise ValueError(f"{model_dir} has no tokenizer.json{has}")
    return Canonical(files, build(files))
