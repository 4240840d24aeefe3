"""Request bodies: msgspec Structs, decoded from the raw JSON bytes in one typed pass
(`errors.parse_body`), and their JSON schemas for FastAPI's OpenAPI document (`schema`).

msgspec's unions may hold only one array type, so `input` is decoded as a string or an array of
strings / ints / int arrays / Jina's items, and `input_list` (ivy/app.py) checks that an array holds
one kind; the OpenAPI schema states the five accepted shapes. Booleans are taken as pydantic's lax mode
took them (true/false, 0/1, "yes"/"no", ...; `lax_bool`), every other field strictly.
Responses are built as plain dicts (or bytes) and encoded once.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

import msgspec

# What a bool field accepts, as pydantic's lax mode did before these were Structs.
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
LaxBool = Union[bool, int, float, str]


def lax_bool(v) -> bool:
    if v is True or v is False:
        return v
    if isinstance(v, str):
        s = v.lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
    elif v in (0, 1):
        return bool(v)
    raise ValueError("Input should be a valid boolean")


TRUNCATE_MODES = ("end", "start", "chunk")


def truncate_mode(v) -> str | None:
    """EmbeddingRequest.truncate as a mode: None (a longer input is a 400), "end" (true), "start", "chunk"."""
    if isinstance(v, str) and v in TRUNCATE_MODES:
        return v
    try:
        return "end" if lax_bool(v) else None
    except ValueError:
        raise ValueError('Input should be a valid boolean or one of "end", "start", "chunk"') from None


class Body(msgspec.Struct, kw_only=True):
    """A request body; unknown fields are ignored (as OpenAI's clients may send more)."""

    bools: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        for name in self.bools:
            v = getattr(self, name)
            if v is not True and v is not False:
                try:
                    setattr(self, name, lax_bool(v))
                except ValueError as e:
                    raise msgspec.ValidationError(f"{e} - at `$.{name}`") from None


class InputItem(msgspec.Struct, kw_only=True):
    """An item of /v1/embeddings' `input` in Jina's shape: {"text": ...} or {"image": a data URI
    (data:image/png;base64,...), bare base64, or an http(s) URL where --allow-image-urls names its host}
    (ivy/routes/images.py)."""

    text: Union[str, None] = None
    image: Union[str, None] = None


class EmbeddingRequest(Body):
    """POST /v1/embeddings, as OpenAI's API plus documented extensions.

    Extensions (ignored by OpenAI clients, sent via `extra_body`):
    input:           also Jina's items, `InputItem`s: {"text": ...} and {"image": ...} (a model with an
                     image tower), mixed in one array, plain strings among them as texts.
    truncate:        what to do with an input longer than the model's maximum: false (a 400), true or
                     "end" (keep its first tokens), "start" (keep its last tokens: the special tokens
                     at both ends and a prompt are kept), "chunk" (split into maximum-length windows,
                     all embedded, mean-pooled weighted by token count into one vector: ivy/app.py).
    input_type:      "query" or "document": prefix text inputs with the model's prompt for it.
    instruction:     a task for instruction-tuned models ("Instruct: {instruction}\nQuery:{text}").
    prompt_name:     the model's prompt of that name (a key of `prompts` in its
                     config_sentence_transformers.json), as sentence-transformers' `encode(prompt_name=...)`.
    encoding_format: also "base64_int8" (round(tanh(x) * 127) as int8) and "base64_binary"
                     (the bits x >= 0, packed MSB first) where the model has a quantizer module.
    return_sparse:   also return BGE-M3 lexical weights: "sparse_embedding" {token id: weight} and
                     "sparse_tokens" {token id: token string}.
    return_colbert:  also return BGE-M3 ColBERT vectors, "colbert_embedding": one vector per token
                     after the first (a list of lists, or base64 float32 with encoding_format base64).
    priority:        "online" (the default) or "batch": the request's scheduling class in Tulip (queued
                     online work goes first); the X-Trellis-Priority header says the same, this wins.
    """

    bools: ClassVar = ("return_sparse", "return_colbert")
    input_kinds: ClassVar[str] = ("a string, an array of strings, an array of token ids, an array of token-id arrays, "
                                  "or an array of {\"text\": ...} / {\"image\": ...} items")

    input: Union[str, list[Union[str, int, list[int], InputItem]]]
    model: Union[str, None] = None
    encoding_format: Literal["float", "base64", "base64_int8", "base64_binary"] = "float"
    dimensions: Union[int, None] = None
    user: Union[str, None] = None
    truncate: LaxBool = False
    input_type: Union[Literal["query", "document"], None] = None
    instruction: Union[str, None] = None
    prompt_name: Union[str, None] = None
    return_sparse: LaxBool = False
    return_colbert: LaxBool = False
    priority: Union[Literal["online", "batch"], None] = None

    def __post_init__(self):
        super().__post_init__()
        try:
            mode = truncate_mode(self.truncate)
        except ValueError as e:
            raise msgspec.ValidationError(f"{e} - at `$.truncate`") from None
        if self.truncate not in TRUNCATE_MODES:
            self.truncate = mode is not None  # the lax booleans as booleans; a mode stays its name

    @property
    def mode(self) -> str | None:
        """`truncate` as a mode (`truncate_mode`)."""
        return "end" if self.truncate is True else self.truncate or None


class ScoreWeights(msgspec.Struct, forbid_unknown_fields=True):
    """`weights` of a rerank or score request: BGE-M3's hybrid score, as FlagEmbedding's
    `BGEM3FlagModel.compute_score` defines it (its `weights_for_different_modes`, [dense, sparse,
    colbert], may be sent as that array): (dense * d + sparse * s + colbert * c) / (dense + sparse +
    colbert), where d is the dot of the normalised dense vectors (the cosine), s the lexical match (the
    sum over token ids in both texts of the query's weight times the document's) and c ColBERT's
    max-sim (the mean over the query's vectors of the largest dot with one of the document's, all
    normalised). A mode left out weighs 0; each weight is >= 0 and one at least > 0; a positive sparse
    or colbert weight needs the model's head for it (ivy/routes/scores.py)."""

    dense: float = 0.0
    sparse: float = 0.0
    colbert: float = 0.0


WEIGHTS_DOC = ("BGE-M3's hybrid score: {dense, sparse, colbert} weights (or FlagEmbedding's "
               "weights_for_different_modes [dense, sparse, colbert]); the score is the weighted mean of the "
               "dense cosine, the lexical match and ColBERT's max-sim. Absent: the cosine.")
_WEIGHTS_SCHEMA = {"anyOf": [
    {"type": "object", "additionalProperties": False,
     "properties": {m: {"type": "number", "minimum": 0, "default": 0} for m in ("dense", "sparse", "colbert")}},
    {"type": "array", "items": {"type": "number", "minimum": 0}, "minItems": 3, "maxItems": 3},
    {"type": "null"}], "default": None, "description": WEIGHTS_DOC}


class RerankRequest(Body):
    """POST /v1/rerank, in the shape Jina's and Cohere's rerank APIs take: the documents ordered by
    a cross-encoder's score of each (query, document) pair (a `*ForSequenceClassification` model, as
    TEI, vLLM and Infinity serve rerankers), or for an embedding model by the cosine similarity of
    their embeddings to the query's (the query with the model's query prompt, the documents with its
    document prompt).

    top_n:            return only the best `top_n` (default: all).
    return_documents: echo each document's text in its result.
    truncate:         cut texts longer than the model's maximum instead of answering 400 (a pair: the
                      longer side first, as sentence-transformers' CrossEncoder; in practice the document).
    instruction:      a task for instruction-tuned models, applied to the query (embedding models), or a
                      chat-template reranker's system message (Qwen3-Reranker's `<Instruct>`;
                      CrossEncoder.predict's `prompt`).
    raw_scores:       a cross-encoder's raw logits instead of its activated scores (sigmoid for one
                      label, unless the model saved another activation), as TEI's and Infinity's flag.
    max_tokens_per_doc: Cohere's: cut each document after its first this many tokens (tokenized
                      alone) before it is scored.
    weights:          BGE-M3's hybrid of dense, sparse and ColBERT scores (`ScoreWeights`); absent: the
                      cosine (an embedding model) or the pair score (a cross-encoder).
    priority:         "online" or "batch", as /v1/embeddings' `priority`.
    """

    bools: ClassVar = ("return_documents", "truncate", "raw_scores")

    query: str
    documents: list[str]
    model: Union[str, None] = None
    top_n: Union[int, None] = None
    return_documents: LaxBool = False
    truncate: LaxBool = False
    instruction: Union[str, None] = None
    raw_scores: LaxBool = False
    max_tokens_per_doc: Union[int, None] = None
    weights: Union[ScoreWeights, list[float], None] = None
    priority: Union[Literal["online", "batch"], None] = None


class ScoreRequest(Body):
    """POST /v1/score, as vLLM's score API: a relevance score per (text_1, text_2) pair, by a
    cross-encoder reading each pair together, or for an embedding model the cosine similarity of
    their embeddings (text_1 with the model's query prompt, text_2 with its document prompt).

    text_1 a string (or a one-item array) is scored against every text_2 (1:N); arrays of equal
    length are scored pairwise (N:N). text_2 may hold Jina's {"text"} / {"image"} items (a model with an
    image tower: texts against images by cosine, ivy/routes/images.py).
    truncate:   cut texts (a pair: longest side first) longer than the model's maximum instead of 400.
    raw_scores: a cross-encoder's raw logits instead of its activated scores (as /v1/rerank).
    weights:    BGE-M3's hybrid of dense, sparse and ColBERT scores (as /v1/rerank, `ScoreWeights`).
    priority:   "online" or "batch", as /v1/embeddings' `priority`.
    """

    bools: ClassVar = ("truncate", "raw_scores")

    text_1: Union[str, list[str]]
    text_2: Union[str, list[Union[str, InputItem]]]
    model: Union[str, None] = None
    truncate: LaxBool = False
    raw_scores: LaxBool = False
    weights: Union[ScoreWeights, list[float], None] = None
    priority: Union[Literal["online", "batch"], None] = None


class TokenizeRequest(Body):
    """POST /v1/tokenize: the token ids the model would see for each text (special tokens and, with
    `input_type` / `instruction`, the prompt included), and their count. Texts longer than the
    model's maximum are counted whole unless `truncate` is set."""

    bools: ClassVar = ("truncate",)
    input_kinds: ClassVar[str] = "a string or an array of strings"

    input: Union[str, list[str]]
    model: Union[str, None] = None
    input_type: Union[Literal["query", "document"], None] = None
    instruction: Union[str, None] = None
    prompt_name: Union[str, None] = None
    truncate: LaxBool = False


# Hugging Face text-embeddings-inference's request bodies (ivy/routes/tei.py), as its OpenAPI
# document states them; `model` is an extension (absent: the default model).
Direction = Literal["right", "left", "Right", "Left"]


class TEIEmbedRequest(Body):
    """TEI's POST /embed (and /embed_sparse, which takes no `normalize` / `dimensions`): `inputs` a
    text, token ids, or an array of either; `truncate` (absent: true, TEI's --auto-truncate default) cuts
    an input over the model's maximum instead of answering 422, keeping its first tokens
    (`truncation_direction` "right") or its last ("left");
    `prompt_name` a key of the model's prompts; `normalize` L2-normalises each vector (after the
    Matryoshka cut to `dimensions`)."""

    bools: ClassVar = ("normalize",)
    input_kinds: ClassVar[str] = "a string, token ids, or an array of strings or of token-id arrays"

    inputs: Union[str, list[Union[str, int, list[int]]]]
    model: Union[str, None] = None
    normalize: LaxBool = True
    truncate: Union[LaxBool, None] = None
    truncation_direction: Direction = "right"
    prompt_name: Union[str, None] = None
    dimensions: Union[int, None] = None


class TEIPredictRequest(Body):
    """TEI's POST /predict: a classifier's (a cross-encoder's) labels with their scores for `inputs`, a
    text, a pair [text, text], or an array of [text] and [text, text]; softmax over several labels,
    the sigmoid of one, or the logits with `raw_scores`."""

    bools: ClassVar = ("raw_scores",)
    input_kinds: ClassVar[str] = "a string, a pair [string, string], or an array of [string] and [string, string]"

    inputs: Union[str, list[Union[str, list[str]]]]
    model: Union[str, None] = None
    truncate: Union[LaxBool, None] = None
    truncation_direction: Direction = "right"
    raw_scores: LaxBool = False


class TEIRerankRequest(Body):
    """TEI's POST /rerank: `texts` ordered by their score against `query` (as /v1/rerank scores them);
    `return_text` echoes each text, `raw_scores` gives a cross-encoder's logits."""

    bools: ClassVar = ("raw_scores", "return_text")

    query: str
    texts: list[str]
    model: Union[str, None] = None
    truncate: Union[LaxBool, None] = None
    truncation_direction: Direction = "right"
    raw_scores: LaxBool = False
    return_text: LaxBool = False


class TEITokenizeRequest(Body):
    """TEI's POST /tokenize: each text's tokens (`prompt_name`'s prompt before it; special tokens with
    `add_special_tokens`, the default) with their ids and byte offsets in the text."""

    bools: ClassVar = ("add_special_tokens",)
    input_kinds: ClassVar[str] = "a string or an array of strings"

    inputs: Union[str, list[str]]
    model: Union[str, None] = None
    add_special_tokens: LaxBool = True
    prompt_name: Union[str, None] = None


class TEIDecodeRequest(Body):
    """TEI's POST /decode: token ids (one sequence, or an array of them) back to text."""

    bools: ClassVar = ("skip_special_tokens",)

    ids: list[Union[int, list[int]]]
    model: Union[str, None] = None
    skip_special_tokens: LaxBool = True


class SimilarityInputs(msgspec.Struct):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(msgspec.Struct):
    truncate: Union[LaxBool, None] = None
    truncation_direction: Direction = "right"
    prompt_name: Union[str, None] = None


class TEISimilarityRequest(Body):
    """TEI's POST /similarity (the Hub's sentence-similarity task): the cosine similarity of
    `source_sentence`'s embedding to each of `sentences`' (all with `parameters.prompt_name`'s prompt)."""

    inputs: SimilarityInputs
    model: Union[str, None] = None
    parameters: Union[SimilarityParameters, None] = None


_STR, _INT = {"type": "string"}, {"type": "integer"}
_EMBEDDING_INPUT = {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "array", "items": _INT},
                              {"type": "array", "items": {"type": "array", "items": _INT}}]}


_INPUT_ITEM = {"oneOf": [{"type": "object", "properties": {"text": _STR}, "required": ["text"]},
                         {"type": "object", "properties": {"image": {**_STR, "description": "a data URI, base64, or "
                                                                      "an http(s) URL of an allowed host"}},
                          "required": ["image"]}]}


def schema(model: type[Body]) -> dict:
    """The body's JSON schema (inline, for OpenAPI): the accepted shapes, not the decoder's."""
    (ref,), defs = msgspec.json.schema_components([model], ref_template="#/components/schemas/{name}")
    s = defs.pop(ref["$ref"].rsplit("/", 1)[-1])
    props = s["properties"]
    defaults = {f.name: f.default for f in msgspec.structs.fields(model)}
    for name in model.bools:
        props[name] = {"type": "boolean", "default": defaults[name]}
    if model is EmbeddingRequest:
        props["input"] = {"anyOf": [*_EMBEDDING_INPUT["anyOf"], {"type": "array", "items": _INPUT_ITEM}]}
        props["truncate"] = {"anyOf": [{"type": "boolean"}, {"enum": list(TRUNCATE_MODES)}], "default": False}
    if model is TEIEmbedRequest:
        props["inputs"] = _EMBEDDING_INPUT
    if model is TEIPredictRequest:
        seq = {"type": "array", "items": _STR, "minItems": 1, "maxItems": 2}
        props["inputs"] = {"anyOf": [_STR, {**seq, "minItems": 2}, {"type": "array", "items": seq}]}
    if "weights" in props:
        props["weights"] = _WEIGHTS_SCHEMA  # inline: the document has no ScoreWeights component
    _inline(s, defs)
    return s


def _inline(node, defs: dict) -> None:
    """Nested Structs' schemas (TEI's similarity inputs and parameters) in place of their references,
    and TEI's optional `truncate` as a boolean or null."""
    if isinstance(node, dict):
        if "$ref" in node:
            node.update(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        props = node.get("properties", {})
        if "truncate" in props and "anyOf" in props["truncate"] and {"type": "null"} in props["truncate"]["anyOf"]:
            props["truncate"] = {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None,
                                 "description": "absent or null: true (TEI's --auto-truncate default)"}
        for v in node.values():
            _inline(v, defs)
    elif isinstance(node, list):
        for v in node:
            _inline(v, defs)
