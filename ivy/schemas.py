"""Request bodies (pydantic). Responses are built as plain dicts and encoded with orjson."""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

EmbeddingInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings, as OpenAI's API plus documented extensions.

    Extensions (ignored by OpenAI clients, sent via `extra_body`):
    truncate:        cut inputs longer than the model's maximum instead of answering 400.
    input_type:      "query" or "document": prefix text inputs with the model's prompt for it.
    instruction:     a task for instruction-tuned models ("Instruct: {instruction}\nQuery:{text}").
    encoding_format: also "base64_int8" (clamp(round(tanh(x) * 127)) as int8) and "base64_binary"
                     (sign bits, packed MSB first) where the model supports quantised outputs.
    return_sparse:   also return BGE-M3 lexical weights: "sparse_embedding" {token id: weight} and
                     "sparse_tokens" {token id: token string}.
    return_colbert:  also return BGE-M3 ColBERT vectors, "colbert_embedding": one vector per token
                     after the first (a list of lists, or base64 float32 with encoding_format base64).
    """

    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64", "base64_int8", "base64_binary"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    truncate: bool = False
    input_type: Literal["query", "document"] | None = None
    instruction: StrictStr | None = None
    return_sparse: bool = False
    return_colbert: bool = False


class RerankRequest(BaseModel):
    """POST /v1/rerank, in the shape Jina's and Cohere's rerank APIs take: the documents ordered by
    the cosine similarity of their embeddings to the query's (the query with the model's query
    prompt, the documents with its document prompt).

    top_n:            return only the best `top_n` (default: all).
    return_documents: echo each document's text in its result.
    truncate:         cut texts longer than the model's maximum instead of answering 400.
    instruction:      a task for instruction-tuned models, applied to the query.
    """

    model_config = ConfigDict(extra="ignore")

    query: StrictStr
    documents: list[StrictStr]
    model: StrictStr | None = None
    top_n: StrictInt | None = None
    return_documents: bool = False
    truncate: bool = False
    instruction: StrictStr | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: the token ids the model would see for each text (special tokens and, with
    `input_type` / `instruction`, the prompt included), and their count. Texts longer than the
    model's maximum are counted whole unless `truncate` is set."""

    model_config = ConfigDict(extra="ignore")
    input_kinds: ClassVar[str] = "a string or an array of strings"

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    input_type: Literal["query", "document"] | None = None
    instruction: StrictStr | None = None
    truncate: bool = False
