"""trellis.options (the request options declared once, `verify`) and trellis.postprocess (their
application) without a server: the options against the proto, their wire round trip, the checks'
messages and HTTP fields, and the post-processing against the code it replaced (Tulip's reply
building, its truncate_dims and encode, Ivy's window pooling, TEI's cut), kept here as references.
The served check, every option on one sequence applied or refused, is in tests/test_tulip.py."""

from dataclasses import fields

import numpy as np
import pytest

from trellis import options as o
from trellis import postprocess as pp
from trellis.client import EmbedOptions
from trellis.options import OptionError, Options, verify
from trellis.tulip.v1 import tulip_pb2

rng = np.random.default_rng(0)
EMBED = tulip_pb2.InfoReply(embedding_dim=8, max_seq_len=16, vocab_size=100, outputs=[tulip_pb2.OUTPUT_DENSE],
                            encodings=[tulip_pb2.ENCODING_FLOAT32])
CROSS = tulip_pb2.InfoReply(num_labels=1, max_seq_len=16, vocab_size=100, outputs=[tulip_pb2.OUTPUT_SCORES],
                            encodings=[tulip_pb2.ENCODING_FLOAT32])


def test_every_request_field_is_an_option_or_transport():
    wire = set(tulip_pb2.EmbedRequest.DESCRIPTOR.fields_by_name)
    assert set(o.NAMES) | o.TRANSPORT == wire and not set(o.NAMES) & o.TRANSPORT
    assert set(o.NAMES) <= set(f.name for f in fields(EmbedOptions))  # the client carries every option


@pytest.mark.parametrize("f", fields(Options), ids=lambda f: f.name)
def test_an_option_travels_and_is_not_the_default(f):
    value = f.metadata["example"]
    opts = Options(**{f.name: value})
    req = opts.to_proto(tulip_pb2.EmbedRequest())
    assert Options.from_proto(req) == opts and not opts.is_default()
    assert not o.no_options(req) and o.no_reply_options(req) == (f.metadata["stage"] != o.REPLY)
    assert o.no_options(tulip_pb2.EmbedRequest(token_ids=b"\0" * 4, lengths=[1], request_id="r", timeout_ms=5))
    assert Options().is_default() and Options.from_proto(tulip_pb2.EmbedRequest()) == Options()


def test_client_options_part_and_request():
    e = EmbedOptions(32, tulip_pb2.ENCODING_INT8, (tulip_pb2.OUTPUT_SPARSE,), [1, 2, 3], [0, 4, 5], True, "r", 9.0,
                     "tp")
    p = e.part(1, 3, 2)
    assert (p.pool_from, p.segment_starts, p.request_id, p.deadline, p.traceparent) == ([2, 3], [4, 5], "r-2", 9.0, "tp")
    assert Options.from_proto(p.request([[1, 2], [3]])) == Options(32, 1, (2,), (2, 3), (4, 5), True)
    assert EmbedOptions(dimensions=0).request([[1]]).SerializeToString() == EmbedOptions().request([[1]]).SerializeToString()


@pytest.mark.parametrize("opts, info, lengths, message, param", [
    (Options(dimensions=9), EMBED, None, "dimensions 9 exceeds the model's embedding size 8 (dimensions must be "
     "between 1 and 8)", "dimensions"),
    (Options(dimensions=0), EMBED, None, "dimensions must be between 1 and 8, got 0", "dimensions"),
    (Options(dimensions=4), CROSS, None, "dimensions applies to embeddings", "dimensions"),
    (Options(encoding=tulip_pb2.ENCODING_INT8), EMBED, None, "encoding ENCODING_INT8 is not supported by this model "
     "(supported: ENCODING_FLOAT32); encoding_format 'base64_int8'", "encoding_format"),
    (Options(outputs=(tulip_pb2.OUTPUT_COLBERT,)), EMBED, None, "output OUTPUT_COLBERT is not supported",
     "return_colbert"),
    (Options(outputs=(tulip_pb2.OUTPUT_DENSE,)), CROSS, None, "OUTPUT_DENSE is not supported", None),
    (Options(pool_from=(1,)), EMBED, (2, 3), "pool_from has 1 entries for 2 sequences", None),
    (Options(pool_from=(1, 3)), EMBED, (2, 3), "pool_from 3 leaves no token of sequence 1", None),
    (Options(segment_starts=(1,)), EMBED, None, "only a cross-encoder", None),
    (Options(segment_starts=(1, 3)), CROSS, (2, 3), "segment_starts 3 is not inside sequence 1", None),
    (Options(raw_scores=True), EMBED, None, "'raw_scores' applies to cross-encoders", "raw_scores"),
])
def test_verify_names_the_option(opts, info, lengths, message, param):
    with pytest.raises(OptionError) as e:
        verify(opts, info, lengths)
    assert message in e.value.message and e.value.param == param and isinstance(e.value, ValueError)


def test_verify_passes_what_the_model_has():
    verify(Options(dimensions=8, pool_from=(1, 2)), EMBED, (2, 3))
    verify(Options(pool_from=(5,)), EMBED)  # without lengths (Ivy, before tokenizing) the per-sequence checks wait
    verify(Options(segment_starts=(1, 0), raw_scores=True), CROSS, (2, 3))


# The code trellis.postprocess replaced, as it was (tulip/server.py, ivy/routes/embeddings.py, ivy/routes/tei.py)
def old_truncate_dims(vectors, dims):
    if dims == 0 or dims == vectors.shape[1]:
        return vectors
    v = vectors[:, :dims]
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def old_encode(vectors, encoding):
    if encoding == tulip_pb2.ENCODING_INT8:
        return np.rint(np.tanh(vectors) * 127).astype(np.int8).tobytes()
    if encoding == tulip_pb2.ENCODING_BINARY:
        return np.packbits(vectors >= 0, axis=1).tobytes()
    return np.ascontiguousarray(vectors, dtype="<f4").tobytes()


def old_reply(request, vectors, tokens, request_id):
    if request.encoding:
        vectors = vectors[:, :request.dimensions or None]
    else:
        vectors = old_truncate_dims(vectors, request.dimensions)
    return tulip_pb2.EmbedReply(embeddings=old_encode(vectors, request.encoding), shape=vectors.shape,
                                prompt_tokens=tokens, encoding=request.encoding, request_id=request_id)


def old_pool_windows(vectors, seqs, windows, normalized, dims):
    v = vectors.astype(np.float64)
    if len(windows) < len(seqs):
        w = np.array([len(s) for s in seqs], dtype=np.float64)
        starts = np.cumsum([0, *windows[:-1]])
        v = np.add.reduceat(v * w[:, None], starts, axis=0) / np.add.reduceat(w, starts)[:, None]
        if normalized:
            v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    if dims and dims < v.shape[1]:
        v = v[:, :dims]
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return v.astype("<f4")


@pytest.mark.parametrize("dims", [0, 1, 5, 16, 17])
@pytest.mark.parametrize("encoding", [tulip_pb2.ENCODING_FLOAT32, tulip_pb2.ENCODING_INT8, tulip_pb2.ENCODING_BINARY])
def test_embed_reply_is_the_old_reply(dims, encoding):
    vectors = rng.standard_normal((3, 17), dtype=np.float32)
    vectors[1] = 0  # a zero row stays zero
    request = tulip_pb2.EmbedRequest(dimensions=dims, encoding=encoding)
    got = pp.embed_reply(vectors, Options.from_proto(request), 12, "r")
    assert got.SerializeToString() == old_reply(request, vectors, 12, "r").SerializeToString()
    np.testing.assert_array_equal(pp.matryoshka(vectors, dims or None), old_truncate_dims(vectors, dims))


def test_embed_reply_sparse_and_colbert():
    sparse = [(np.array([5, 3], np.uint32), np.array([0.5, 0.25], np.float32)), (np.array([], np.uint32),
                                                                                   np.array([], np.float32))]
    colbert = [rng.standard_normal((2, 4), dtype=np.float32), rng.standard_normal((1, 4), dtype=np.float32)]
    r = pp.embed_reply(rng.standard_normal((2, 6), dtype=np.float32), Options(), 7, sparse=sparse, colbert=colbert,
                       colbert_dim=4)
    assert [list(s.token_ids) for s in r.sparse] == [[5, 3], []] and list(r.sparse[0].weights) == [0.5, 0.25]
    assert (list(r.colbert_lengths), r.colbert_dim) == ([2, 1], 4)
    np.testing.assert_array_equal(np.frombuffer(r.colbert, "<f4").reshape(3, 4), np.concatenate(colbert))
    scores = pp.scores_reply(np.array([[0.5], [2.0]], np.float64), 7, "x")
    assert (list(scores.shape), np.frombuffer(scores.scores, "<f4").tolist(), scores.embeddings) == ([2, 1],
                                                                                                    [0.5, 2.0], b"")


@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("dims", [None, 3, 8])
def test_pool_windows_is_the_old_pooling(normalized, dims):
    seqs = [np.zeros(n) for n in (5, 2, 7, 7, 1)]
    windows = [1, 3, 1]
    vectors = rng.standard_normal((5, 8), dtype=np.float32)
    got = pp.pool_windows(vectors, [len(s) for s in seqs], windows, normalized, dims)
    assert got.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got, old_pool_windows(vectors, seqs, windows, normalized, dims or 0))
    one_each = pp.pool_windows(vectors[:2], [5, 2], [1, 1], normalized, dims)  # no input with windows: a cut alone
    np.testing.assert_array_equal(one_each, old_pool_windows(vectors[:2], seqs[:2], [1, 1], normalized, dims or 0))


def test_tei_cut_without_renormalising():
    v = rng.standard_normal((2, 6), dtype=np.float32)
    np.testing.assert_array_equal(pp.matryoshka(v, 4, renormalize=False), v[:, :4])
    assert pp.matryoshka(v, 6, renormalize=False) is v and pp.matryoshka(v, None) is v
