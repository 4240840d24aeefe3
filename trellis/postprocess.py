"""The request options applied to a model's output rows, in one place (numpy only: Ivy imports it and
never torch): the Matryoshka cut and its re-normalisation, the quantised encodings, a long input's
windows pooled back into one row, and the reply message's rows, sparse weights and ColBERT vectors.
Tulip builds its replies with `embed_reply`; Ivy's window pooling (truncate "chunk") and TEI's /embed
(`normalize`) cut with `matryoshka`.
"""

from __future__ import annotations

import numpy as np

from trellis.options import Options
from trellis.tulip.v1 import tulip_pb2

EPS = 1e-12  # the norm floor of every L2 normalisation here (a zero row stays zero)


def normalize(v: np.ndarray) -> np.ndarray:
    """Rows L2-normalised, computed in `v`'s dtype."""
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), EPS)


def matryoshka(vectors: np.ndarray, dims: int | None, renormalize: bool = True) -> np.ndarray:
    """Matryoshka truncation: the first `dims` values of each row (None or 0: all), L2-normalised again
    (`renormalize`), computed in the rows' dtype. Rows of `dims` values or fewer come back as they are."""
    if not dims or dims >= vectors.shape[1]:
        return vectors
    v = vectors[:, :dims]
    return normalize(v) if renormalize else v


def encode(vectors: np.ndarray, encoding: int) -> bytes:
    """float32 [n, dim] -> the reply's bytes in `encoding` (see tulip.proto). The quantised ones are
    pplx-embed-v1's quantizer module (st_quantize.FlexibleQuantizer): int8 = round(tanh(x) * 127)
    (half to even, as torch.round; tanh keeps it within [-127, 127]); binary = the bits x >= 0, packed."""
    if encoding == tulip_pb2.ENCODING_INT8:
        return np.rint(np.tanh(vectors) * 127).astype(np.int8).tobytes()
    if encoding == tulip_pb2.ENCODING_BINARY:
        return np.packbits(vectors >= 0, axis=1).tobytes()
    return np.ascontiguousarray(vectors, dtype="<f4").tobytes()


def dense(vectors: np.ndarray, options: Options) -> np.ndarray:
    """The rows as `options` shape them before encoding: float32 cut to `dimensions` and re-normalised; a
    quantised encoding takes the first `dimensions` of the full vector's (sentence-transformers' truncate_dim
    then its quantizer), not re-normalised."""
    if options.encoding:
        return vectors[:, :options.dimensions or None]
    return matryoshka(vectors, options.dimensions)


def embed_reply(vectors: np.ndarray, options: Options, tokens: int, request_id: str = "", sparse=None,
                colbert=None, colbert_dim: int = 0) -> tulip_pb2.EmbedReply:
    """An embedding model's EmbedReply: the dense rows as `options` ask (`dense`, `encode`), and where asked
    the sparse weights ((token ids, weights) per sequence) and ColBERT vectors (float32 [tokens, colbert_dim]
    per sequence, back to back)."""
    vectors = dense(vectors, options)
    reply = tulip_pb2.EmbedReply(embeddings=encode(vectors, options.encoding), shape=vectors.shape,
                                 prompt_tokens=tokens, encoding=options.encoding, request_id=request_id)
    if sparse is not None:
        reply.sparse.extend(tulip_pb2.SparseVector(token_ids=t, weights=w) for t, w in sparse)
    if colbert is not None:
        reply.colbert = np.concatenate(colbert).astype("<f4").tobytes()
        reply.colbert_lengths.extend(len(c) for c in colbert)
        reply.colbert_dim = colbert_dim
    return reply


def scores_reply(scores: np.ndarray, tokens: int, request_id: str = "") -> tulip_pb2.EmbedReply:
    """A cross-encoder's EmbedReply: float32 [sequences, num_labels] scores."""
    return tulip_pb2.EmbedReply(scores=np.ascontiguousarray(scores, dtype="<f4").tobytes(), shape=scores.shape,
                                prompt_tokens=tokens, request_id=request_id)


def pool_windows(vectors: np.ndarray, lengths: list[int], windows: list[int], normalized: bool,
                 dims: int | None) -> np.ndarray:
    """Ivy's truncate "chunk": per input the mean of its windows' rows weighted by their token counts
    `lengths` (special tokens included), L2-normalised again where the model normalises; then `dims`
    (`matryoshka`) as Tulip applies it. In float64, returned as float32. `windows`: per input how
    many consecutive rows are its windows."""
    v = vectors.astype(np.float64)
    if len(windows) < len(lengths):
        w = np.array(lengths, dtype=np.float64)
        starts = np.cumsum([0, *windows[:-1]])
        v = np.add.reduceat(v * w[:, None], starts, axis=0) / np.add.reduceat(w, starts)[:, None]
        if normalized:
            v = normalize(v)
    return matryoshka(v, dims).astype("<f4")
