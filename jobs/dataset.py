"""A job's input cut into numbered parts, and its output directory.

Input: a Parquet, JSONL or CSV file, or a directory of them (recursively; names starting with "." or "_"
skipped), on any filesystem pyarrow opens by URI (s3://, gs://, hdfs://) or fsspec does (its package installed).
Files are taken in path order and each is cut into parts of `rows_per_part` consecutive rows (a file's last
part may be shorter), numbered from 0 across the files: the same input and `rows_per_part` give the same parts,
which is what makes a restart exact. JSONL is read a line at a time (orjson): a line that is not a JSON object,
or whose text is not a string, is a row with a reader error, not a failed file (pyarrow's JSON reader stops
at the first such value).

Output (a local directory): `part-NNNNN.parquet` per input part, `_job.json` (the settings and the input's
files and sizes: a restart with others is refused), `_done/part-NNNNN.json` (the commit marker: rows,
errors, tokens), `_errors.jsonl` (bad rows: id and reason) and `_summary.json` when the job is complete.
Files starting with "_" or "." are what pyarrow, pandas, polars and DuckDB leave out of a dataset, so
`pandas.read_parquet(OUTPUT)` reads the vectors alone. A part is committed by writing it to a temporary
name, renaming it into place, then writing its marker the same way; a part without a marker (killed between
the two) is removed and done again, so every input row is in exactly one part.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs.embed import READER_ERROR

EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
              ".csv": "csv", ".tsv": "csv"}
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
READ_BYTES = 1 << 24


class JobMismatch(ValueError):
    """OUTPUT holds a job with other settings or another input."""


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of a local path or a URI: pyarrow's own filesystems, else fsspec's."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        import fsspec  # a scheme pyarrow lacks: fsspec's implementation (gcsfs, adlfs, memory, ...)

        fs, path = fsspec.core.url_to_fs(uri)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _format(path: str, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    stem = path
    for c in COMPRESSED:
        stem = stem.removesuffix(c)
    return EXTENSIONS.get(os.path.splitext(stem)[1].lower())


@dataclass
class Part:
    index: int  # the part's number (its file part-NNNNN.parquet)
    path: str  # the input file
    start: int  # its first row in that file
    first_row: int  # its first row in the whole input
    table: pa.Table


class Input:
    """The input's files (`files`: path, format, size), their row counts (`rows`, for progress) and `parts`."""

    def __init__(self, uri: str, fmt: str, rows_per_part: int):
        self.uri, self.rows_per_part = uri, rows_per_part
        self.fs, path = filesystem(uri)
        info = self.fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"input {uri!r} does not exist")
        if info.type == pafs.FileType.Directory:
            found = self.fs.get_file_info(pafs.FileSelector(path, recursive=True))
            infos = sorted((f for f in found if f.type == pafs.FileType.File and not any(
                p.startswith((".", "_")) for p in os.path.relpath(f.path, path).split(os.sep))), key=lambda f: f.path)
        else:
            infos = [info]
        self.files = [(f.path, _format(f.path, fmt), f.size) for f in infos]
        unknown = [p for p, f, _ in self.files if f is None]
        if unknown and info.type != pafs.FileType.Directory:
            raise ValueError(f"cannot tell the format of {unknown[0]!r} by its extension: give --input-format")
        self.files = [x for x in self.files if x[1] is not None]
        if not self.files:
            raise ValueError(f"input {uri!r} holds no .parquet, .jsonl or .csv file")

    def fingerprint(self) -> list:
        return [[p, size] for p, _, size in self.files]

    def rows(self) -> int:
        """Rows in all (Parquet: from the footers; JSONL / CSV: their lines, counted; compressed ones by reading)."""
        total = 0
        for path, fmt, _ in self.files:
            if fmt == "parquet":
                with self.fs.open_input_file(path) as f:
                    total += pq.ParquetFile(f).metadata.num_rows
            else:
                total += self._lines(path) - (fmt == "csv")
        return total

    def _lines(self, path: str) -> int:
        n, last = 0, b"\n"
        with self._stream(path) as f:
            while chunk := f.read(READ_BYTES):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        return n + (last != b"\n")

    def _stream(self, path: str):
        codec = pa.Codec.detect(path) if path.endswith(COMPRESSED) else None
        return self.fs.open_input_stream(path, compression=codec.name if codec else None)

    def parts(self, columns: list[str]) -> Iterator[Part]:
        """Every part in order (the columns of `columns` that the input has, plus READER_ERROR for JSONL)."""
        index = first = 0
        for path, fmt, _ in self.files:
            start = 0
            for table in self._chunks(path, fmt, columns):
                yield Part(index, path, start, first, table)
                index, start, first = index + 1, start + table.num_rows, first + table.num_rows

    def _chunks(self, path: str, fmt: str, columns: list[str]) -> Iterator[pa.Table]:
        n = self.rows_per_part
        if fmt == "jsonl":
            yield from self._jsonl(path, columns)
            return
        if fmt == "parquet":
            f = self.fs.open_input_file(path)
            pf = pq.ParquetFile(f)
            have = [c for c in columns if c in pf.schema_arrow.names]
            batches = pf.iter_batches(batch_size=n, columns=have or None)
        else:
            opts = pcsv.ConvertOptions(column_types={columns[0]: pa.string()}, strings_can_be_null=True)
            parse = pcsv.ParseOptions(delimiter="\t" if path.endswith((".tsv", ".tsv.gz")) else ",",
                                      newlines_in_values=True)
            f = self._stream(path)
            batches = pcsv.open_csv(f, parse_options=parse, convert_options=opts)
        with f:
            pending: list = []
            rows = 0
            for b in batches:
                b = b.select([c for c in columns if c in b.schema.names])
                pending.append(b)
                rows += b.num_rows
                while rows >= n:
                    t = pa.Table.from_batches(pending)
                    yield t.slice(0, n).combine_chunks()
                    rest = t.slice(n)
                    pending, rows = rest.to_batches(), rest.num_rows
            if rows:
                yield pa.Table.from_batches(pending).combine_chunks()

    def _jsonl(self, path: str, columns: list[str]) -> Iterator[pa.Table]:
        text_col, id_col = columns[0], columns[1]
        texts, ids, errors = [], [], []
        with self._stream(path) as raw:
            for k, line in enumerate(io.BufferedReader(raw, READ_BYTES)):
                if not line.strip():
                    continue
                try:
                    obj = orjson.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    texts.append(None), ids.append(None), errors.append(f"line {k + 1} is not a JSON object ({e})")
                else:
                    t = obj.get(text_col)
                    texts.append(t if isinstance(t, str) else None)
                    ids.append(obj.get(id_col))
                    errors.append(None if t is None or isinstance(t, str) else
                                  f"text is not a string ({type(t).__name__})")
                if len(texts) == self.rows_per_part:
                    yield _jsonl_table(text_col, id_col, texts, ids, errors)
                    texts, ids, errors = [], [], []
        if texts:
            yield _jsonl_table(text_col, id_col, texts, ids, errors)


def _jsonl_table(text_col: str, id_col: str, texts: list, ids: list, errors: list) -> pa.Table:
    cols = {text_col: pa.array(texts, pa.string())}
    if any(i is not None for i in ids):
        try:
            cols[id_col] = pa.array(ids)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # ids of mixed types: kept as their JSON text
            cols[id_col] = pa.array([None if i is None else orjson.dumps(i).decode() for i in ids], pa.string())
    cols[READER_ERROR] = pa.array(errors, pa.string())
    return pa.table(cols)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Output:
    """The output directory of one job (module docstring): `done` holds the committed parts' numbers and
    `committed` their markers (rows, errors, tokens)."""

    def __init__(self, path: str, job: dict):
        if "://" in path:
            raise ValueError(f"output {path!r}: a local directory (parts are committed by renaming them)")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "_done").mkdir(exist_ok=True)
        job_file = self.path / "_job.json"
        if job_file.is_file():
            old = json.loads(job_file.read_text())
            if old != job:
                diff = sorted(k for k in {*old, *job} if old.get(k) != job.get(k))
                detail = "; ".join(f"{k}: {old.get(k)!r} there, {job.get(k)!r} now" for k in diff)
                raise JobMismatch(f"{path} holds a job with other settings ({detail[:600]}): run it with the same "
                                  "arguments to continue it, or give another OUTPUT")
        else:
            if any(self.path.glob("part-*.parquet")):
                raise JobMismatch(f"{path} holds part files but no _job.json: give an empty or new OUTPUT")
            _atomic_write(job_file, json.dumps(job, indent=1).encode())
        self.committed: dict[int, dict] = {}
        for m in sorted((self.path / "_done").glob("part-*.json")):
            self.committed[int(m.stem[5:])] = json.loads(m.read_text())
        for stray in [*self.path.glob("part-*.parquet"), *self.path.glob(".*.tmp"),
                      *(self.path / "_done").glob(".*.tmp")]:
            if stray.suffix == ".tmp" or int(stray.stem[5:]) not in self.committed:
                stray.unlink()  # written but never committed (killed before its marker): done again
        # the errors of the committed parts, whatever a kill left half-appended
        _atomic_write(self.path / "_errors.jsonl",
                      b"".join(orjson.dumps(e) + b"\n" for k in sorted(self.committed)
                               for e in self.committed[k]["errors"]))
        self._errors = open(self.path / "_errors.jsonl", "ab")

    @property
    def done(self) -> set[int]:
        return set(self.committed)

    def commit(self, part: Part, table: pa.Table, errors: list[dict], tokens: int, seconds: float) -> dict:
        name = f"part-{part.index:05d}"
        tmp = self.path / f".{name}.parquet.tmp"
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / f"{name}.parquet")
        marker = {"part": part.index, "input": part.path, "start": part.start, "input_rows": part.table.num_rows,
                  "rows": table.num_rows, "tokens": tokens, "seconds": round(seconds, 3), "errors": errors}
        _atomic_write(self.path / "_done" / f"{name}.json", orjson.dumps(marker, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
        self.committed[part.index] = marker
        if errors:
            self._errors.write(b"".join(orjson.dumps(e, default=str, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for e in errors))
            self._errors.flush()
        return marker

    def finish(self, summary: dict) -> None:
        _atomic_write(self.path / "_summary.json", json.dumps(summary, indent=1).encode())
        self._errors.close()
