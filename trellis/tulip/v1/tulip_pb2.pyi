from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_UNSPECIFIED: _ClassVar[Output]
    OUTPUT_DENSE: _ClassVar[Output]
    OUTPUT_SPARSE: _ClassVar[Output]
    OUTPUT_COLBERT: _ClassVar[Output]
    OUTPUT_SCORES: _ClassVar[Output]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FLOAT32: _ClassVar[Encoding]
    ENCODING_INT8: _ClassVar[Encoding]
    ENCODING_BINARY: _ClassVar[Encoding]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_ONLINE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]
OUTPUT_UNSPECIFIED: Output
OUTPUT_DENSE: Output
OUTPUT_SPARSE: Output
OUTPUT_COLBERT: Output
OUTPUT_SCORES: Output
ENCODING_FLOAT32: Encoding
ENCODING_INT8: Encoding
ENCODING_BINARY: Encoding
PRIORITY_ONLINE: Priority
PRIORITY_BATCH: Priority

class SparseVector(_message.Message):
    __slots__ = ("token_ids", "weights")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("token_ids", "lengths", "dimensions", "outputs", "request_id", "encoding", "timeout_ms", "pool_from", "cancel", "segment_starts", "raw_scores", "traceparent", "priority", "pixels", "images")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    POOL_FROM_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_STARTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    dimensions: int
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    request_id: str
    encoding: Encoding
    timeout_ms: int
    pool_from: _containers.RepeatedScalarFieldContainer[int]
    cancel: bool
    segment_starts: _containers.RepeatedScalarFieldContainer[int]
    raw_scores: bool
    traceparent: str
    priority: Priority
    pixels: bytes
    images: int
    def __init__(self, token_ids: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ..., dimensions: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., request_id: _Optional[str] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., timeout_ms: _Optional[int] = ..., pool_from: _Optional[_Iterable[int]] = ..., cancel: _Optional[bool] = ..., segment_starts: _Optional[_Iterable[int]] = ..., raw_scores: _Optional[bool] = ..., traceparent: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., pixels: _Optional[bytes] = ..., images: _Optional[int] = ...) -> None: ...

class EmbedReply(_message.Message):
    __slots__ = ("embeddings", "shape", "prompt_tokens", "encoding", "sparse", "colbert", "colbert_lengths", "colbert_dim", "request_id", "error_code", "error_message", "scores")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    COLBERT_FIELD_NUMBER: _ClassVar[int]
    COLBERT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COLBERT_DIM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    embeddings: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    encoding: Encoding
    sparse: _containers.RepeatedCompositeFieldContainer[SparseVector]
    colbert: bytes
    colbert_lengths: _containers.RepeatedScalarFieldContainer[int]
    colbert_dim: int
    request_id: str
    error_code: int
    error_message: str
    scores: bytes
    def __init__(self, embeddings: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., sparse: _Optional[_Iterable[_Union[SparseVector, _Mapping]]] = ..., colbert: _Optional[bytes] = ..., colbert_lengths: _Optional[_Iterable[int]] = ..., colbert_dim: _Optional[int] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., scores: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model", "embedding_dim", "max_seq_len", "vocab_size", "pooling", "normalized", "outputs", "dtype", "device", "max_batch_tokens", "encodings", "attention", "num_labels", "activation", "revision", "random_weights", "image_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embedding_dim: int
    max_seq_len: int
    vocab_size: int
    pooling: str
    normalized: bool
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    dtype: str
    device: str
    max_batch_tokens: int
    encodings: _containers.RepeatedScalarFieldContainer[Encoding]
    attention: str
    num_labels: int
    activation: str
    revision: str
    random_weights: bool
    image_size: int
    def __init__(self, model: _Optional[str] = ..., embedding_dim: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., pooling: _Optional[str] = ..., normalized: _Optional[bool] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., encodings: _Optional[_Iterable[_Union[Encoding, str]]] = ..., attention: _Optional[str] = ..., num_labels: _Optional[int] = ..., activation: _Optional[str] = ..., revision: _Optional[str] = ..., random_weights: _Optional[bool] = ..., image_size: _Optional[int] = ...) -> None: ...
