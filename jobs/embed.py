"""`Embedder`: the unit of work of every way a job runs. One per worker (a thread of `trellis embed`, an actor
of a Ray Data `map_batches`), constructed once (model, tokenizer, backend), then called on batch after batch:

    embedder = Embedder(EmbedSettings(model="BAAI/bge-m3", outputs=("dense", "sparse")), device="cuda:0")
    out = embedder(table)               # a pyarrow Table (or RecordBatch, dict of columns, pandas DataFrame)
    good, errors = split_errors(out)    # the rows to write, [{"id": ..., "reason": ...}, ...]
    embedder.close()

`out` has one row per input row, in order: the id column (its input name and type; absent from the input: the
row number, `first_row` + i), `tokens` (int32: the tokens embedded, prompt and special tokens included; null
through an Ivy), `dense` (a fixed-size list: float32 / float16 / int8, or uint8 packed bits for binary),
`sparse` (map<int32, float32>: token id -> weight) and `colbert` (list of fixed-size float32 vectors) where
asked, and `error` (string): null, or why the row has no vectors (then its vectors are null).

Texts are templated and tokenized here exactly as Ivy does it (ivy.templates, ivy.tokenizer: the model's
prompts and tokenizer.json), and the vectors shaped by trellis.postprocess as Tulip shapes a reply, so a job's
rows equal what the HTTP API returns for the same texts and options.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from jobs.backends import Http, HttpError, Local, LoopThread, Remote, Rows
from jobs.config import EmbedSettings
from trellis import postprocess
from trellis.options import Options, OptionError, verify
from trellis.tulip.v1 import tulip_pb2

ERROR = "error"  # the result column naming why a row has no vectors (null: it has them)
READER_ERROR = "_error"  # an input column a reader may add: a row whose text could not be read, and why
TOKENIZE_ROWS = 256  # texts tokenized in one `tokenizers` batch (it spreads a batch over the cores, GIL released)
HTTP_ROWS = 64  # texts per /v1/embeddings request
_WIRE = {"float32": tulip_pb2.ENCODING_FLOAT32, "float16": tulip_pb2.ENCODING_FLOAT32,
         "int8": tulip_pb2.ENCODING_INT8, "binary": tulip_pb2.ENCODING_BINARY}
_VALUE = {"float32": pa.float32(), "float16": pa.float16(), "int8": pa.int8(), "binary": pa.uint8()}


def as_table(batch: Any) -> pa.Table:
    """A pyarrow Table of `batch`: a Table, RecordBatch, dict of columns (lists or numpy arrays: Ray's
    "numpy" batch format) or pandas DataFrame."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if isinstance(batch, dict):
        return pa.table({k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else list(v) for k, v in batch.items()})
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):
        return pa.Table.from_pandas(batch, preserve_index=False)
    raise TypeError(f"a batch is a pyarrow Table / RecordBatch, a dict of columns or a pandas DataFrame, not "
                    f"{type(batch).__name__}")


def split_errors(result: pa.Table) -> tuple[pa.Table, list[dict]]:
    """`Embedder`'s result -> (the rows with vectors, without the error column; [{id, reason}] of the others)."""
    err = result.column(ERROR)
    bad = err.is_valid()
    if not pa.compute.any(bad).as_py():
        return result.drop_columns([ERROR]), []
    ids, reasons = result.column(0).filter(bad).to_pylist(), err.filter(bad).to_pylist()
    good = result.filter(pa.compute.invert(bad)).drop_columns([ERROR])
    return good, [{result.column_names[0]: i, "reason": r} for i, r in zip(ids, reasons)]


class Embedder:
    """Rows of texts in, vectors out (see the module docstring). Where the steps run, one of:
    `device` ("auto", "cpu", "cuda", "cuda:N": an engine in this process, Tulip's EngineLoop in front of it;
    `dtype`, `max_batch_tokens` as Tulip's flags), `tulip` ("HOST:PORT": a running Tulip serving the same
    model) or `url` (an Ivy's base URL; `api_key`, `served_model`: its bearer token and model name).
    `inflight_tokens`: tokens sent and not yet answered (0: six steps' budget), so the tokenizing of the
    next rows overlaps the steps of the earlier ones. Raises ValueError for settings the model cannot honour."""

    def __init__(self, settings: EmbedSettings, *, device: str = "auto", dtype: str = "auto",
                 max_batch_tokens: int = 0, tulip: str = "", url: str = "", api_key: str = "",
                 served_model: str = "", inflight_tokens: int = 0):
        self.settings = s = settings
        self.io = LoopThread()
        self.tokenizer = None
        self.colbert_dim = 0  # known from the engine's heads in-process, else from the first ColBERT reply
        try:
            if url:
                if s.encoding not in ("float32", "float16") or s.outputs != ("dense",):
                    raise ValueError("through an Ivy (--url) a job writes dense float32 / float16 vectors; "
                                     "run it in-process or with --tulip for other encodings and outputs")
                self.backend = Http(url, api_key, served_model, self.io)
                probe, _ = self.io.call(self.backend.embed(["a"], self._http_body()))
                self.dim, self.normalized, self.budget = probe.shape[1], True, 0
            else:
                self._prepare(tulip, device, dtype, max_batch_tokens)
        except BaseException:
            self.close()
            raise
        self.inflight_tokens = inflight_tokens or 6 * max(self.budget, 1)
        self._window = Window(self.inflight_tokens)
        self.out_dim = s.dimensions or self.dim
        if s.encoding == "binary":
            self.out_dim = -(-self.out_dim // 8)
        self._tok_loop = asyncio.new_event_loop()  # TextTokenizer.encode is a coroutine (Ivy awaits it)

    def _prepare(self, tulip: str, device: str, dtype: str, max_batch_tokens: int) -> None:
        from ivy.errors import APIError
        from ivy.templates import Templates
        from ivy.tokenizer import TextTokenizer
        from trellis.modeldir import ModelSpec
        from trellis.modelref import resolve

        s = self.settings
        ref = resolve(s.model, weights=not tulip)
        spec = ModelSpec.read(ref.path)
        self.backend = Remote(tulip, self.io) if tulip else Local(ref, device, dtype, max_batch_tokens, self.io)
        info = self.info = self.backend.info
        self.budget = self.backend.budget
        if info.num_labels:
            raise ValueError(f"{s.model} is a cross-encoder (it scores pairs); trellis embed takes embedding models")
        if info.vocab_size != spec.vocab_size:
            raise ValueError(f"the Tulip at {tulip} serves a model with a vocabulary of {info.vocab_size} "
                             f"({info.model!r}), {s.model} has {spec.vocab_size}: give the model it serves")
        try:
            verify(Options(s.dimensions or None, _WIRE[s.encoding],
                           tuple(tulip_pb2.OUTPUT_SPARSE if o == "sparse" else tulip_pb2.OUTPUT_COLBERT
                                 for o in s.outputs if o != "dense")), info)
        except OptionError as e:
            raise ValueError(e.message.replace("encoding_format", "--encoding")) from None
        self.dim, self.normalized, self.max_len = info.embedding_dim, info.normalized, info.max_seq_len
        if isinstance(self.backend, Local) and self.backend.engine.heads is not None:
            self.colbert_dim = self.backend.engine.heads.colbert_dim
        # `tokenizers` (not Ivy's native encoder): its batches run on every core with the GIL released, while
        # this process's engine loop and the next slice's reading go on; no request-size cap (a job is large)
        self.tokenizer = TextTokenizer.for_model(spec, 1 << 62, backend="tokenizers", max_request_tokens=1 << 62)
        templates = Templates(spec.prompts, None, spec.default_prompt_name)
        try:
            self.prefix = templates.prefix(s.input_type or None, s.instruction or None, s.prompt_name or None)
        except APIError as e:
            raise ValueError(e.message) from None
        pool_without_prompt = spec.pooling != "last" and not spec.include_prompt  # as Ivy's ServedModel
        self.n_prompt = self.tokenizer.prompt_length(self.prefix) if self.prefix and pool_without_prompt else 0
        self.keep = 0  # truncate start: the prompt's tokens kept at the front (ServedModel.long_text_sequences)
        if self.prefix and self.tokenizer.wrap:
            self.keep = max(self.tokenizer.prompt_length(self.prefix) - len(self.tokenizer.wrap[0]), 0)

    def _http_body(self) -> dict:
        s = self.settings
        body = {"truncate": False if s.truncate == "none" else s.truncate}
        for k in ("input_type", "instruction", "prompt_name", "dimensions"):
            if getattr(s, k):
                body[k] = getattr(s, k)
        return body

    # ---- one batch ----

    def __call__(self, batch: Any, first_row: int = 0) -> pa.Table:
        """The result table of `batch`'s rows (module docstring). `first_row`: the input row number of its
        first row (the ids where the input has no id column)."""
        return self.submit(batch, first_row).result()

    def submit(self, batch: Any, first_row: int = 0) -> "Pending":
        """`batch`'s rows read and tokenized, and their requests sent (waiting only while `inflight_tokens`
        are in flight, this batch's and earlier ones'); `.result()` of what it returns is `self(batch)`. A
        runner calls it for the next batch while the steps of this one run, and builds and writes this one's
        table on another thread (jobs.run): the engine has the next rows before it finishes these. Through
        an Ivy (--url) the batch is done when it returns."""
        table = as_table(batch)
        s, n = self.settings, table.num_rows
        if s.text_column not in table.column_names:
            raise ValueError(f"the input has no column {s.text_column!r} (its columns: "
                             f"{', '.join(table.column_names)}); give --text-column")
        if s.id_column in table.column_names:
            ids = table.column(s.id_column)
        elif s.id_column == "id":
            ids = pa.array(np.arange(first_row, first_row + n, dtype=np.int64))
        else:
            raise ValueError(f"the input has no column {s.id_column!r} (its columns: {', '.join(table.column_names)})")
        texts, reasons = self._texts(table)
        good = [i for i in range(n) if reasons[i] is None]
        if self.tokenizer is None:
            vectors, tokens = self._http_rows([texts[i] for i in good], good, reasons)
            ok = [i for i in good if reasons[i] is None]
            return Pending(table=self._table(ids, n, ok, reasons, vectors, tokens, None, None))
        futures, seq_rows, seq_lens = self._send_rows([texts[i] for i in good], good, reasons)

        def finish() -> pa.Table:
            vectors, tokens, sparse, colbert = self._assemble([f.result() for f in futures], seq_rows, seq_lens)
            ok = [i for i in good if reasons[i] is None]  # (rows over the maximum were marked when tokenized)
            return self._table(ids, n, ok, reasons, vectors, tokens, sparse, colbert)

        return Pending(finish, futures)

    def _texts(self, table: pa.Table) -> tuple[list, list]:
        col = table.column(self.settings.text_column)
        reasons: list = table.column(READER_ERROR).to_pylist() if READER_ERROR in table.column_names \
            else [None] * table.num_rows
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
                or pa.types.is_string_view(col.type) or pa.types.is_null(col.type)):
            return [None] * table.num_rows, [r or f"text is not a string ({col.type})" for r in reasons]
        texts = col.to_pylist()
        for i, t in enumerate(texts):
            if reasons[i] is None:
                if t is None:
                    reasons[i] = "text is null"
                elif not isinstance(t, str):
                    reasons[i] = f"text is not a string ({type(t).__name__})"
                elif not t.strip():
                    reasons[i] = "text is empty"
        return texts, reasons

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        p = self.prefix
        return self._tok_loop.run_until_complete(
            self.tokenizer.encode([p + t for t in texts] if p else texts, self.settings.truncate == "end",
                                  check_length=False))

    def _send_rows(self, texts: list[str], rows: list[int], reasons: list):
        """Tokenize `texts` (input rows `rows`) a slice at a time, sending each `budget` tokens as one request
        while the next slice is tokenized; return the requests' futures, and the input row and tokens of each
        sequence sent, in order. A row over the maximum with truncate none gets its reason instead."""
        s, tok = self.settings, self.tokenizer
        mode = s.truncate
        futures: list = []
        seq_rows: list[int] = []  # the input row of each sequence sent, in order
        seq_lens: list[int] = []  # and its tokens
        batch: list[np.ndarray] = []
        pool: list[int] = []

        def send():
            nonlocal batch, pool
            n_tok = sum(map(len, batch))
            self._window.acquire(n_tok)
            fut = self.io.submit(self.backend.embed(batch, pool if self.n_prompt else None, s.outputs))
            fut.add_done_callback(lambda _, n=n_tok: self._window.release(n))
            futures.append(fut)
            batch, pool = [], []

        for a in range(0, len(texts), TOKENIZE_ROWS):
            part_rows = rows[a:a + TOKENIZE_ROWS]
            for row, seq in zip(part_rows, self._tokenize(texts[a:a + TOKENIZE_ROWS])):
                if len(seq) <= self.max_len:
                    parts = [seq]
                elif mode == "none":
                    reasons[row] = (f"text has {len(seq)} tokens, more than the model's maximum of {self.max_len} "
                                    "(--truncate end, start or chunk embeds it)")
                    continue
                else:  # start / chunk ("end" was cut by the tokenizer), as Ivy's long_text_sequences
                    parts = tok.windows(seq, mode, self.keep)
                for k, p in enumerate(parts):
                    batch.append(p)
                    pool.append(min(self.n_prompt, len(p) - 1) if k == 0 else 0)
                    seq_rows.append(row)
                    seq_lens.append(len(p))
                if sum(map(len, batch)) >= self.budget:
                    send()
        if batch:
            send()
        return futures, seq_rows, seq_lens

    def _assemble(self, results: list[Rows], seq_rows: list[int], lengths: list[int]):
        """The requests' rows in order -> per input row: vector, tokens, sparse, ColBERT."""
        s = self.settings
        if not results:
            return np.zeros((0, self.dim), np.float32), [], None, None
        vectors = np.concatenate([r.vectors for r in results]) if len(results) > 1 else results[0].vectors
        sparse = [x for r in results for x in r.sparse] if "sparse" in s.outputs else None
        colbert = [x for r in results for x in r.colbert] if "colbert" in s.outputs else None
        seq_rows_a = np.asarray(seq_rows)
        starts = np.flatnonzero(np.r_[True, seq_rows_a[1:] != seq_rows_a[:-1]])
        windows = np.diff(np.r_[starts, len(seq_rows_a)]).tolist()
        tokens = np.add.reduceat(np.asarray(lengths, dtype=np.int64), starts).tolist()
        if len(windows) < len(seq_rows):  # truncate chunk: a row's windows pooled into one vector
            vectors = postprocess.pool_windows(vectors, lengths, windows, self.normalized, None)
        return vectors, tokens, sparse, colbert

    def _http_rows(self, texts: list[str], rows: list[int], reasons: list):
        """Through an Ivy: HTTP_ROWS texts a request, several in flight; a request refused as a whole (e.g.
        an over-long text with truncate none) is split in halves until the bad rows are found."""
        body = self._http_body()
        futs = [(self.io.submit(self.backend.embed(texts[a:a + HTTP_ROWS], body)), a)
                for a in range(0, len(texts), HTTP_ROWS)]
        out = np.zeros((len(texts), self.dim), np.float32)
        for fut, a in futs:
            self._http_fill(fut, texts, rows, reasons, out, a, min(a + HTTP_ROWS, len(texts)), body)
        keep = [k for k, r in enumerate(rows) if reasons[r] is None]
        return out[keep], [None] * len(keep)

    def _http_fill(self, fut, texts, rows, reasons, out, a: int, b: int, body: dict) -> None:
        try:
            out[a:b] = fut.result()[0]
        except HttpError as e:
            if e.status not in (400, 413, 422):
                raise
            if b - a == 1:
                reasons[rows[a]] = e.message
                return
            m = (a + b) // 2
            for lo, hi in ((a, m), (m, b)):
                self._http_fill(self.io.submit(self.backend.embed(texts[lo:hi], body)), texts, rows, reasons, out,
                                lo, hi, body)

    # ---- the result table ----

    def _dense(self, vectors: np.ndarray) -> np.ndarray:
        """float32 rows -> the stored values, as Tulip's reply would carry them (trellis.postprocess)."""
        s = self.settings
        v = postprocess.dense(vectors, Options(s.dimensions or None, _WIRE[s.encoding]))
        if s.encoding in ("int8", "binary"):
            return np.frombuffer(postprocess.encode(v, _WIRE[s.encoding]),
                                 np.int8 if s.encoding == "int8" else np.uint8).reshape(len(v), -1)
        return v.astype(np.float16 if s.encoding == "float16" else np.float32, copy=False)

    def _table(self, ids, n: int, ok: list[int], reasons: list, vectors, tokens, sparse, colbert) -> pa.Table:
        s = self.settings
        valid = np.zeros(n, dtype=bool)
        valid[ok] = True
        mask = pa.array(~valid)
        values = np.zeros((n, self.out_dim), dtype=_VALUE[s.encoding].to_pandas_dtype())
        if ok:
            values[ok] = self._dense(vectors)
        cols = {s.id_column: ids,
                "tokens": pa.array([None] * n if not ok else _spread(n, ok, tokens), pa.int32()),
                "dense": pa.FixedSizeListArray.from_arrays(pa.array(values.ravel(), _VALUE[s.encoding]),
                                                           self.out_dim, mask=mask)}
        if sparse is not None:
            cols["sparse"] = _sparse(n, ok, sparse)
        if colbert is not None:
            self.colbert_dim = next((c.shape[1] for c in colbert if c.ndim == 2), self.colbert_dim)
            cols["colbert"] = _colbert(n, ok, colbert, self.colbert_dim)
        cols[ERROR] = pa.array(reasons, pa.string())
        return pa.table(cols)

    def close(self) -> None:
        if hasattr(self, "_window"):
            self._window.close()
        backend = getattr(self, "backend", None)
        if backend is not None and self.io.loop.is_running():
            try:
                self.io.call(backend.close(), timeout=30)
            except Exception:
                pass
        self.io.stop()
        if hasattr(self, "_tok_loop"):
            self._tok_loop.close()


class Window:
    """Tokens sent and not yet answered, across batches: `acquire(n)` waits while `n` more would pass `limit`
    (one request always goes: a request over the limit alone), `release(n)` when a request is answered
    (called by its future, on the I/O loop's thread). Replaces waiting on a batch's own oldest request, so
    the next batch's requests queue behind this one's instead of after it has drained."""

    def __init__(self, limit: int):
        self.limit, self.used, self.closed = limit, 0, False
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            while self.used and self.used + n > self.limit:
                if self.closed:
                    raise RuntimeError("the Embedder was closed")
                self.cond.wait(1.0)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Pending:
    """A batch sent by `Embedder.submit`: `result()` waits for its requests and returns its table (raises what
    a request raised); `done()` tells, without waiting, whether they are all answered."""

    def __init__(self, finish: Callable[[], pa.Table] | None = None, futures: list | None = None,
                 table: pa.Table | None = None):
        self._finish, self._futures, self._table = finish, futures or [], table

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> pa.Table:
        if self._table is None:
            self._table, self._finish = self._finish(), None
        return self._table


def _spread(n: int, ok: list[int], values) -> list:
    out = [None] * n
    for i, v in zip(ok, values):
        out[i] = v
    return out


def _offsets(n: int, ok: list[int], sizes: list[int]) -> pa.Array:
    """List offsets of n rows where the rows `ok` hold `sizes` entries and the others are null."""
    lens = np.zeros(n, dtype=np.int32)
    lens[ok] = sizes
    offsets = np.r_[0, np.cumsum(lens)].astype(np.int32)
    null = np.ones(n + 1, dtype=bool)
    null[ok] = False
    null[-1] = False
    return pa.array(offsets, pa.int32(), mask=null)


def _sparse(n: int, ok: list[int], sparse: list) -> pa.Array:
    keys = np.concatenate([np.asarray(t, np.int32) for t, _ in sparse]) if sparse else np.zeros(0, np.int32)
    items = np.concatenate([np.asarray(w, np.float32) for _, w in sparse]) if sparse else np.zeros(0, np.float32)
    return pa.MapArray.from_arrays(_offsets(n, ok, [len(t) for t, _ in sparse]), pa.array(keys), pa.array(items))


def _colbert(n: int, ok: list[int], colbert: list, dim: int) -> pa.Array:
    flat = np.concatenate(colbert).astype(np.float32).ravel() if colbert else np.zeros(0, np.float32)
    vecs = pa.FixedSizeListArray.from_arrays(pa.array(flat), dim)
    return pa.ListArray.from_arrays(_offsets(n, ok, [len(c) for c in colbert]), vecs)
