"""Tulip's Embed messages on the wire, apart from any server: an EmbedRequest checked against the
served model and unpacked (`parse_request`), a message that does not decode (`Undecodable`,
`decode_request`), the usual reply serialized straight from its rows (`plain_reply`,
`serialize_reply`), which request outputs are the engine's extras (`EXTRAS`) and which priority classes
exist (`PRIORITIES`, `bad_priority`). The servicer
(`tulip.servicer`) calls these; the tests call them without a server."""

from __future__ import annotations

import numpy as np

from rose.extras import Extra
from trellis.options import Options, verify
from trellis.protowire import read_varint, varint
from trellis.tulip.v1 import tulip_pb2


def parse_request(req: tulip_pb2.EmbedRequest, info: tulip_pb2.InfoReply
                  ) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None]:
    """Check an EmbedRequest against the served model (its options: `trellis.options.verify`) and unpack it
    into (int32 ids, lengths, pool_from or None, segment_starts or None; plain ints); raise ValueError (an
    option's: trellis.options.OptionError) with a caller-facing message."""
    lens = tuple(req.lengths)  # plain ints: cheaper than numpy for the usual handful of sequences
    raw = req.token_ids  # (each read of a bytes field makes a new bytes object)
    ids = np.frombuffer(raw, dtype="<i4") if not len(raw) % 4 else None
    vocab_size, max_seq_len = info.vocab_size, info.max_seq_len
    if not lens:
        raise ValueError("request has no sequences (lengths is empty)")
    if ids is None:
        raise ValueError(f"token_ids has {len(raw)} bytes, not a multiple of 4 (int32 little-endian)")
    if sum(lens) != ids.shape[0]:
        raise ValueError(f"lengths add up to {sum(lens)} tokens but token_ids holds {ids.shape[0]}")
    if min(lens) == 0:
        raise ValueError(f"sequence {lens.index(0)} is empty")
    longest = max(lens)
    if longest > max_seq_len:
        raise ValueError(f"sequence {lens.index(longest)} has {longest} tokens; "
                         f"this model accepts at most {max_seq_len}")
    if ids.view("<u4").max() >= vocab_size:
        lo, hi = int(ids.min()), int(ids.max())
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    verify(Options.from_proto(req), info, lens)
    pool_from = tuple(req.pool_from) if req.pool_from else None
    segments = tuple(req.segment_starts) if req.segment_starts else None
    return ids, lens, pool_from, segments


def parse_images(req: tulip_pb2.EmbedRequest, info: tulip_pb2.InfoReply, tokens: int,
                 size: int | None = None) -> tuple[int, tuple[int, ...]]:
    """Check an image request (`pixels`, `images`) against the served model: (images, each image's token cost
    `tokens` as the scheduler's lengths); raise ValueError with a caller-facing message. `size`: the pixels'
    bytes where they were cut from the message (`Images`), else `req.pixels` is read."""
    side, n = info.image_size, req.images
    size = len(req.pixels) if size is None else size
    if not side:
        raise ValueError(f"model {info.model} embeds text only: it takes no images (Info's image_size is 0)")
    if req.lengths or req.token_ids:
        raise ValueError("a request carries token ids (text) or pixels (images), not both")
    if n < 1 or size != n * side * side * 3:
        raise ValueError(f"pixels holds {size} bytes; {n} images of {side} x {side} RGB uint8 take {n * side * side * 3}"
                         if n else "pixels without `images` (the number of pictures in it)")
    if any(o != tulip_pb2.OUTPUT_DENSE for o in req.outputs) or req.pool_from or req.segment_starts or req.raw_scores:
        raise ValueError("images have one output, the dense vector: no sparse / ColBERT outputs, pool_from, "
                         "segment_starts or raw_scores")
    lens = (tokens,) * n
    verify(Options.from_proto(req), info, lens)
    return n, lens


# The EmbedRequest's `priority` values Tulip schedules (tulip.scheduler's ONLINE / BATCH are these numbers)
PRIORITIES = frozenset(tulip_pb2.Priority.values())


def bad_priority(value: int) -> str:
    """The INVALID_ARGUMENT message for a `priority` that is no Priority (proto3 keeps unknown enum numbers)."""
    known = ", ".join(f"{name} = {number}" for name, number in tulip_pb2.Priority.items())
    return f"priority {value} is not a scheduling class this server knows ({known})"


EXTRAS = {tulip_pb2.OUTPUT_SPARSE: Extra.SPARSE, tulip_pb2.OUTPUT_COLBERT: Extra.COLBERT}
NO_EXTRAS = frozenset()
F32 = np.dtype("<f4")  # the reply's float encoding


_PLAIN: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}  # (rows, dim, tokens) -> the bytes around the rows


def plain_reply(vectors: np.ndarray, tokens: int, request_id: str = "") -> bytes:
    """The usual reply, float32 rows and nothing else, serialized straight from the rows (C-contiguous
    little-endian float32 [n, dim]): byte for byte `EmbedReply(embeddings=vectors.tobytes(), shape=vectors.shape,
    prompt_tokens=tokens, request_id=request_id).SerializeToString()`, with one copy of the rows and no message."""
    n, dim = vectors.shape
    around = _PLAIN.get((n, dim, tokens))
    if around is None:
        if len(_PLAIN) > 4096:
            _PLAIN.clear()
        shape = varint(n) + varint(dim)  # fields 1 (bytes), 2 (packed uint32), 3 (uint32; 0: left out)
        around = _PLAIN[n, dim, tokens] = (
            b"\x0a" + varint(4 * n * dim) if n * dim else b"",
            b"\x12" + varint(len(shape)) + shape + (b"\x18" + varint(tokens) if tokens else b""))
    if not request_id:
        return b"".join((around[0], vectors, around[1]))
    rid = request_id.encode()  # field 9 (string)
    return b"".join((around[0], vectors, around[1], b"J", varint(len(rid)), rid))


def serialize_reply(reply: tulip_pb2.EmbedReply | bytes) -> bytes:
    """The servicer's replies on the wire: an EmbedReply, or one already serialized (`plain_reply`)."""
    return reply if type(reply) is bytes else reply.SerializeToString()


class Undecodable:
    """An Embed message that is not an EmbedRequest: answered INVALID_ARGUMENT on its own (on a
    stream, the stream and its other requests carry on), never UNKNOWN or a dropped stream."""

    request_id = ""  # no id could be read: the reply says so with an empty one
    timeout_ms = 0

    def __init__(self, error: str):
        self.error = error


class Images:
    """An image request whose pixels were cut from the message's bytes (`decode_request`): `request` the
    EmbedRequest of the rest (no `pixels`), `pixels` a uint8 view of the message's buffer; it answers
    `cancel` and `request_id` as a message does (a stream reads them before anything else)."""

    __slots__ = ("request", "pixels")

    def __init__(self, request: tulip_pb2.EmbedRequest, pixels: np.ndarray):
        self.request, self.pixels = request, pixels

    @property
    def cancel(self) -> bool:
        return self.request.cancel

    @property
    def request_id(self) -> str:
        return self.request.request_id


_PIXELS = 14  # EmbedRequest.pixels' field number
_MAX_FIELDS = 64  # top-level fields `_cut_pixels` reads before it leaves a message to protobuf


def _cut_pixels(buf: np.ndarray) -> Images | None:
    """Read the top level of a serialized EmbedRequest (protobuf's wire format: a key varint, then a varint,
    8 or 4 bytes, or a length and that many bytes) and cut the `pixels` field out of it: protobuf parses the
    rest (a few small fields) and the pixels stay a view of `buf`. None where the reader leaves the message
    to protobuf: no pixels, a wire type or length it does not take, more than _MAX_FIELDS fields.

    Why hand-written: protobuf (upb) copies a bytes field when it parses it and again at each read of it,
    and takes no numpy buffer; a request's 38.5 MB of pixels cost ~33 ms a copy on the 2-core CPU machine.
    Parsing the other fields' bytes gives the same message as parsing all of them (a message is its fields'
    records, merged in order; the last record of a singular field wins, as here)."""
    end, mv = len(buf), buf.data  # (a memoryview's items are ints; numpy's are uint8 scalars)
    pos, keep, pixels = 0, [], None
    for _ in range(_MAX_FIELDS):
        if pos >= end:
            break
        start = pos
        key, pos = read_varint(mv, pos, end)
        kind = key & 7
        if kind == 0:
            _, pos = read_varint(mv, pos, end)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            length, pos = read_varint(mv, pos, end)
            if length < 0:
                return None
            pos += length
            if pos <= end and key >> 3 == _PIXELS:
                pixels = (pos - length, pos)
                continue
        else:
            return None  # groups, wire types 6 and 7, a broken key: protobuf says what they are
        if pos > end:
            return None
        keep.append((start, pos))
    else:
        if pos < end:
            return None
    if pixels is None:
        return None
    rest = b"".join(mv[a:b] for a, b in keep)
    return Images(tulip_pb2.EmbedRequest.FromString(rest), buf[pixels[0]:pixels[1]])


def decode_request(data):
    """An Embed message's bytes (bytes; a big one a writable uint8 array, tulip.h2body) as an EmbedRequest,
    an `Images` (a big one with pixels, those left where they are), or `Undecodable`."""
    try:
        if type(data) is np.ndarray:
            cut = _cut_pixels(data)
            return cut if cut is not None else tulip_pb2.EmbedRequest.FromString(memoryview(data))
        return tulip_pb2.EmbedRequest.FromString(data)
    except Exception as e:  # protobuf's DecodeError, or whatever a hostile message provokes
        return Undecodable(f"{type(e).__name__}: {e}")
