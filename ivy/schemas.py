"""Request bodies (pydantic). Responses are built as plain dicts and encoded with orjson."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

EmbeddingInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings, as OpenAI's API plus documented extensions.

    Extensions (ignored by OpenAI clients, sent via `extra_body`):
    truncate: cut inputs longer than the model's maximum instead of answering 400.
    """

    model_config = ConfigDict(extra="ignore")

    input: EmbeddingInput
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    truncate: bool = False
