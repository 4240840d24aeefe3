"""The request options: what an embed request asks of the model beside its token ids, declared once.

`Options` is one frozen dataclass whose fields are the EmbedRequest proto fields of the same names
(the proto's transport fields, `TRANSPORT`, are the only others; importing this module fails if the
proto has a field that is neither, so a new field cannot be left out silently). Every side builds
one: Ivy's routes from their HTTP bodies (`ivy.routes.common.Context.options`, and the client's
`EmbedOptions`, which extends it), Tulip from the message (`Options.from_proto`). `verify` checks
one against the model's `Info` and raises `OptionError`, which Ivy answers 400 (`param`: the HTTP
field) and Tulip INVALID_ARGUMENT, with the same message. Each option's default is its proto's zero
value, so "all defaults" is one test over the fields (`is_default`, and `no_options` on a message: Tulip's
one-sequence fast path and its plain-reply check ask it instead of listing fields).
The options are applied once, in `trellis.postprocess` (the reply's) or by the engine (`ENGINE`).

Adding an option (docs/structure.md, "Adding a request option"): the proto field, a field here
(stage, example, its check in `verify`), its application (`trellis.postprocess`), Ivy's body field
(`ivy/schemas.py`) and the route that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Sequence

from trellis.tulip.v1 import tulip_pb2

ENGINE = "engine"  # the engine reads it (it changes the rows); Tulip hands it to the engine loop's Request
REPLY = "reply"  # applied to the rows after the engine (trellis.postprocess): Tulip's plain reply is off for it

# EmbedRequest fields that are not options: the inputs (token ids, or an image request's pixels) and how the
# message travels and is scheduled (ids, deadline, tracing, cancel, priority class)
TRANSPORT = frozenset({"token_ids", "lengths", "pixels", "images", "request_id", "timeout_ms", "cancel",
                       "traceparent", "priority"})

# OpenAI's `encoding_format` (Ivy's /v1/embeddings) -> the wire's encoding
ENCODING_FORMATS = {"float": tulip_pb2.ENCODING_FLOAT32, "base64": tulip_pb2.ENCODING_FLOAT32,
                    "base64_int8": tulip_pb2.ENCODING_INT8, "base64_binary": tulip_pb2.ENCODING_BINARY}
# the HTTP field that asks for an extra output (Ivy's /v1/embeddings)
OUTPUT_PARAMS = {tulip_pb2.OUTPUT_SPARSE: "return_sparse", tulip_pb2.OUTPUT_COLBERT: "return_colbert"}


class OptionError(ValueError):
    """An option this model cannot honour: the caller's error (HTTP 400 with `param`, the HTTP field that
    sets it, where one does; gRPC INVALID_ARGUMENT), with one message on both sides."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def option(default, stage: str, example, per_sequence: bool = False, kw_only: bool = True):
    """One option's field: its default (the proto's zero value, or None where the wire's zero means
    "unset"), the stage that applies it (ENGINE or REPLY), a non-default `example` value (the test that
    every option is applied or refused sends it), and whether it holds one entry per sequence (a
    request split into chunks splits it too). Keyword-only, so that a new option moves no positional
    argument of `Options` or of the client's `EmbedOptions` (whose own fields follow); the first six
    stay positional for the callers that predate this module."""
    return field(default=default, kw_only=kw_only,
                 metadata={"stage": stage, "example": example, "per_sequence": per_sequence})


@dataclass(frozen=True)
class Options:
    """An embed request's options (see the proto's EmbedRequest for each field's wire meaning).

    dimensions:     Matryoshka truncation: the first `dimensions` values, L2-normalised again (a quantised
                    encoding: the first codes of the full vector's); None (the wire's 0): the full width.
    encoding:       tulip_pb2.ENCODING_* of the reply's vectors (quantised ones where Info lists them).
    outputs:        tulip_pb2.OUTPUT_* asked beside the model's own (sparse, ColBERT) where it has them.
    pool_from:      per sequence, the leading (prompt) tokens pooling leaves out; empty: none.
    segment_starts: a cross-encoder's pairs: per sequence where its second segment starts (0: none).
    raw_scores:     a cross-encoder's logits, not activated.
    Per-sequence fields are sequences (lists or tuples), empty or one entry per sequence.
    """

    dimensions: int | None = option(None, REPLY, 2, kw_only=False)
    encoding: int = option(tulip_pb2.ENCODING_FLOAT32, REPLY, tulip_pb2.ENCODING_INT8, kw_only=False)
    outputs: tuple[int, ...] = option((), REPLY, (tulip_pb2.OUTPUT_SPARSE,), kw_only=False)
    pool_from: Sequence[int] = option((), ENGINE, (1,), per_sequence=True, kw_only=False)
    segment_starts: Sequence[int] = option((), ENGINE, (1,), per_sequence=True, kw_only=False)
    raw_scores: bool = option(False, REPLY, True, kw_only=False)

    @classmethod
    def from_proto(cls, request: tulip_pb2.EmbedRequest) -> "Options":
        """The options an EmbedRequest carries (repeated fields as tuples; a None-default field's zero as None)."""
        kw = {}
        for f in OPTION_FIELDS:
            v = getattr(request, f.name)
            if f.default is None:
                v = v or None
            elif isinstance(f.default, tuple):
                v = tuple(v)
            kw[f.name] = v
        return cls(**kw)

    def to_proto(self, request: tulip_pb2.EmbedRequest) -> tulip_pb2.EmbedRequest:
        """Set the options that are not their defaults on `request` (repeated fields only where set)."""
        for f in OPTION_FIELDS:
            v = getattr(self, f.name)
            if not _set(v):
                continue
            if isinstance(f.default, tuple):
                getattr(request, f.name).extend(v)
            else:
                setattr(request, f.name, v)
        return request

    def is_default(self) -> bool:
        """Whether every option is its default (a request that asks nothing but the model's own output)."""
        return not any(map(_set, _VALUES(self)))


def _set(v) -> bool:
    return v is not None and (len(v) > 0 if hasattr(v, "__len__") else bool(v))  # (a numpy array's bool raises)


OPTION_FIELDS = fields(Options)
NAMES = tuple(f.name for f in OPTION_FIELDS)
PER_SEQUENCE = tuple(f.name for f in OPTION_FIELDS if f.metadata["per_sequence"])
REPLY_NAMES = tuple(f.name for f in OPTION_FIELDS if f.metadata["stage"] == REPLY)


def _getter(names: tuple[str, ...]):
    """attrgetter over `names`, always giving a tuple (attrgetter of one name gives the value)."""
    get = attrgetter(*names)
    return get if len(names) > 1 else (lambda o: (get(o),))


_VALUES, _REPLY_VALUES = _getter(NAMES), _getter(REPLY_NAMES)


def no_options(request: tulip_pb2.EmbedRequest) -> bool:
    """Whether an EmbedRequest sets no option (on the wire every default is falsy): Tulip's one-sequence
    fast path. One C call for the values: this runs on every online request."""
    return not any(_VALUES(request))


def no_reply_options(request: tulip_pb2.EmbedRequest) -> bool:
    """Whether an EmbedRequest sets no option applied to the reply (stage REPLY): its rows go out as they are."""
    return not any(_REPLY_VALUES(request))


def _check_declared() -> None:
    """Every EmbedRequest field is an option or transport, and every option is an EmbedRequest field whose
    default is falsy: a field added to the proto alone would be ignored by the fast path."""
    wire = set(tulip_pb2.EmbedRequest.DESCRIPTOR.fields_by_name)
    undeclared = wire - set(NAMES) - TRANSPORT
    unknown = set(NAMES) - wire
    if undeclared or unknown:
        raise RuntimeError(f"trellis.options out of step with the proto: EmbedRequest fields {sorted(undeclared)} "
                           f"are neither an Options field nor TRANSPORT; Options fields {sorted(unknown)} are not "
                           "EmbedRequest fields")
    for f in OPTION_FIELDS:
        if _set(f.default) or not _set(f.metadata["example"]):
            raise RuntimeError(f"Options.{f.name}: the default must be falsy (the wire's zero) and the example not")


_check_declared()


def _names(enum, values) -> str:
    return ", ".join(enum.Name(v) if v in enum.values() else str(v) for v in values)


def verify(options: Options, info: tulip_pb2.InfoReply, lengths: Sequence[int] | None = None) -> None:
    """Check `options` against the served model's Info (and, given the request's sequence `lengths`, the
    per-sequence fields against them); raise OptionError naming the first one it cannot honour.
    Ivy calls it before tokenizing (without lengths), Tulip on receipt."""
    cross = info.num_labels > 0
    d = options.dimensions
    if d is not None:
        if cross:
            raise OptionError("dimensions applies to embeddings; this model is a cross-encoder (it returns scores)",
                              "dimensions")
        dim = info.embedding_dim
        if d > dim:
            raise OptionError(f"dimensions {d} exceeds the model's embedding size {dim} (dimensions must be between "
                              f"1 and {dim})", "dimensions")
        if d < 1:
            raise OptionError(f"dimensions must be between 1 and {dim}, got {d}", "dimensions")
    enc = options.encoding
    if enc not in info.encodings:
        formats = [k for k, v in ENCODING_FORMATS.items() if v == enc]
        raise OptionError(f"encoding {_names(tulip_pb2.Encoding, [enc])} is not supported by this model (supported: "
                          f"{_names(tulip_pb2.Encoding, info.encodings)})"
                          + (f"; encoding_format '{formats[0]}'" if formats else ""), "encoding_format")
    for o in options.outputs:
        if o != tulip_pb2.OUTPUT_UNSPECIFIED and o not in info.outputs:
            param = OUTPUT_PARAMS.get(o)
            raise OptionError(f"output {_names(tulip_pb2.Output, [o])} is not supported by this model (supported: "
                              f"{_names(tulip_pb2.Output, info.outputs)})"
                              + (f"; '{param}': it has no such head" if param else ""), param)
    n = None if lengths is None else len(lengths)
    if len(options.pool_from) and n is not None:
        if len(options.pool_from) != n:
            raise OptionError(f"pool_from has {len(options.pool_from)} entries for {n} sequences")
        for i, (p, k) in enumerate(zip(options.pool_from, lengths)):
            if p >= k:
                raise OptionError(f"pool_from {p} leaves no token of sequence {i} ({k} tokens) to pool")
    if len(options.segment_starts):
        if not cross:
            raise OptionError("segment_starts: this model is an embedding model; only a cross-encoder "
                              "(Info num_labels > 0) scores two-segment sequences")
        if n is not None:
            if len(options.segment_starts) != n:
                raise OptionError(f"segment_starts has {len(options.segment_starts)} entries for {n} sequences")
            for i, (s, k) in enumerate(zip(options.segment_starts, lengths)):
                if s >= k:
                    raise OptionError(f"segment_starts {s} is not inside sequence {i} ({k} tokens): the second "
                                      f"segment starts at 1..{k - 1}, or 0 for none")
    if options.raw_scores and not cross:
        raise OptionError("'raw_scores' applies to cross-encoders: this model is an embedding model (it returns no "
                          "scores)", "raw_scores")
