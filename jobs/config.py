"""`trellis embed`'s configuration: `EmbedSettings` (what decides the output, stored in OUTPUT/_job.json and
compared on a restart) and `EmbedJobConfig` (every flag, TRELLIS_EMBED_* environment variables; trellis.cli)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trellis.cli import field, parse

TRUNCATE = ("none", "end", "start", "chunk")
ENCODINGS = ("float32", "float16", "int8", "binary")
OUTPUTS = ("dense", "sparse", "colbert")
INPUT_TYPES = ("", "query", "document")
FORMATS = ("auto", "parquet", "jsonl", "csv")


def _split(values: tuple[str, ...]) -> tuple[str, ...]:
    """A tuple flag given as repeated flags or comma-separated values (or both), blanks dropped."""
    return tuple(v.strip() for x in values for v in x.split(",") if v.strip())


@dataclass(frozen=True)
class EmbedSettings:
    """What an embedding job computes for each row: two runs with equal settings write equal outputs.

    model:        the model reference (trellis.modelref: a Hub id, a directory, 'default', preset:NAME); its
                  tokenizer and prompts are read here whichever backend runs the steps.
    text_column:  the input column holding the texts.
    id_column:    the input column copied to the output beside each vector; absent from the input (and left
                  at its default "id"), the row's number in the input (int64, from 0, files in path order).
    input_type:   "query" or "document": the model's prompt for it before each text ("" none: the model's
                  default prompt, if it names one), as Ivy's `input_type`.
    prompt_name:  the model's prompt of that name (sentence-transformers' prompt_name); "" none.
    instruction:  an instruction-tuned model's task ("Instruct: {instruction}\\nQuery:" before each text).
    dimensions:   Matryoshka: the first N values, L2-normalised again; 0: the model's full width.
    truncate:     a text longer than the model's maximum: "none" (the row goes to the errors file), "end"
                  (its first tokens), "start" (its last tokens), "chunk" (windows, token-weighted mean).
    outputs:      "dense", and "sparse" / "colbert" where the model has those heads (BGE-M3, SPLADE).
    encoding:     the dense vectors as float32, float16, int8 or binary (int8 / binary where the model has a
                  quantizer module, as the HTTP API offers them).
    """

    model: str = "default"
    text_column: str = "text"
    id_column: str = "id"
    input_type: str = ""
    prompt_name: str = ""
    instruction: str = ""
    dimensions: int = 0
    truncate: str = "end"
    outputs: tuple[str, ...] = ("dense",)
    encoding: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "outputs", _split(tuple(self.outputs)) or ("dense",))
        bad = [o for o in self.outputs if o not in OUTPUTS]
        if bad:
            raise ValueError(f"outputs {bad} are not among {', '.join(OUTPUTS)}")
        if "dense" not in self.outputs:
            raise ValueError(f"outputs {list(self.outputs)}: dense is always written (add it: --outputs dense,...)")
        if self.truncate not in TRUNCATE:
            raise ValueError(f"truncate {self.truncate!r} is not one of {', '.join(TRUNCATE)}")
        if self.truncate == "chunk" and len(self.outputs) > 1:
            raise ValueError("truncate chunk pools a long text's windows into one dense vector; sparse and colbert "
                             "outputs need truncate none, end or start")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding {self.encoding!r} is not one of {', '.join(ENCODINGS)}")
        if self.input_type not in INPUT_TYPES:
            raise ValueError(f"input_type {self.input_type!r} is not query or document")
        if self.dimensions < 0:
            raise ValueError(f"dimensions {self.dimensions} must be >= 1 (or 0: the model's width)")
        if not self.text_column or not self.id_column:
            raise ValueError("text_column and id_column must be column names")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EmbedJobConfig:
    """trellis embed INPUT OUTPUT --model MODEL: embed a dataset's texts into a Parquet dataset, resumably.

    INPUT: a Parquet file or directory, JSONL or CSV (local or any filesystem pyarrow / fsspec reads, e.g.
    s3://...). OUTPUT: a local directory of part-NNNNN.parquet files (pandas.read_parquet(OUTPUT) reads them),
    with _job.json (the settings), _done/ (one marker per committed part) and _errors.jsonl (bad rows).
    Run again with the same arguments, it continues where it stopped (docs/bulk.md)."""

    input: str = field("", "the dataset to embed (or the first positional argument)")
    output: str = field("", "the output directory (or the second positional argument)")
    model: str = field("default", "a Hugging Face Hub id ORG/NAME[@REVISION], a model directory, 'default' "
                       "(all-MiniLM-L6-v2) or preset:NAME (random weights)")
    text_column: str = field("text", "the input column with the texts")
    id_column: str = field("id", "the input column copied beside each vector (absent: the row number)")
    input_format: str = field("auto", "the input's format (auto: by file extension)", choices=FORMATS)
    input_type: str = field("", "query or document: the model's prompt for it before each text",
                            choices=INPUT_TYPES)
    prompt_name: str = field("", "the model's prompt of this name before each text")
    instruction: str = field("", "an instruction-tuned model's task for query texts")
    dimensions: int = field(0, "Matryoshka: keep the first N values (re-normalised); 0: all")
    truncate: str = field("end", "texts over the model's maximum: none (an error row), end, start or chunk",
                          choices=TRUNCATE)
    outputs: tuple[str, ...] = field(("dense",), "dense, sparse, colbert (comma-separated or repeated; sparse / "
                                     "colbert where the model has them)")
    encoding: str = field("float32", "the dense vectors' type", choices=ENCODINGS)
    device: str = field("auto", "in-process: auto | cpu | cuda | cuda:N")
    devices: tuple[str, ...] = field((), "in-process on several GPUs: one engine (and worker) per device, e.g. "
                                     "--devices cuda:0,cuda:1")
    dtype: str = field("auto", "in-process compute dtype", choices=("auto", "float32", "bfloat16", "float16"))
    max_batch_tokens: int = field(0, "in-process token budget of one engine step (0: 16384, or the model's "
                                  "maximum length where longer)")
    tulip: tuple[str, ...] = field((), "run the steps on these running Tulips (HOST:PORT, repeated or "
                                   "comma-separated; one worker each), at batch priority")
    url: str = field("", "run through this Ivy (its base URL, e.g. http://127.0.0.1:8000): texts sent to "
                     "/v1/embeddings with X-Trellis-Priority: batch (dense float vectors)")
    api_key: str = field("", "with --url: the bearer token Ivy asks for")
    served_model: str = field("", "with --url: the model name the Ivy serves it as (default: Ivy's default model)")
    ray: str = field("", "run on Ray: 'local' (--ray alone: a Ray instance started for the job), 'auto' (the "
                     "cluster this host is a node of), ray://HOST:PORT (Ray Client) or HOST:PORT; each part one "
                     "call of an actor holding an Embedder (jobs.ray; pip install 'trellis[ray]')")
    ray_actors: int = field(0, "with --ray: actors, one Embedder each (0: one per GPU of the cluster, one GPU each; "
                            "1 on a cluster without GPUs)")
    ray_cpus: float = field(0.0, "with --ray: CPUs each actor asks Ray for (0: 1 beside a GPU, else an equal share "
                            "of the cluster's CPUs)")
    rows_per_part: int = field(10000, "input rows per output part (the unit that is committed and resumed)")
    max_rows_per_s: float = field(0.0, "throttle the job to at most this many rows a second (a shared fleet's "
                                  "quota); 0: as fast as it goes")
    json: bool = field(False, "print one JSON summary object on stdout at the end")
    progress: str = field("auto", "a progress bar on stderr: auto (when stderr is a terminal), on, off",
                          choices=("auto", "on", "off"))

    def __post_init__(self):
        for name in ("outputs", "devices", "tulip"):
            object.__setattr__(self, name, _split(getattr(self, name)))
        if not self.input or not self.output:
            raise ValueError("give INPUT and OUTPUT: trellis embed INPUT OUTPUT --model MODEL")
        if sum(map(bool, (self.devices, self.tulip, self.url, self.ray))) > 1:
            raise ValueError("run in one place: --devices, --tulip, --url or --ray")
        if self.ray and self.ray not in ("local", "auto") and not (self.ray.startswith("ray://") or ":" in self.ray):
            raise ValueError(f"ray {self.ray!r} is not local, auto, ray://HOST:PORT or HOST:PORT")
        if self.ray_actors < 0 or self.ray_cpus < 0 or ((self.ray_actors or self.ray_cpus) and not self.ray):
            raise ValueError(f"ray_actors {self.ray_actors}, ray_cpus {self.ray_cpus}: counts >= 0, with --ray")
        if self.rows_per_part < 1:
            raise ValueError(f"rows_per_part {self.rows_per_part} must be >= 1")
        if self.max_batch_tokens < 0 or self.max_rows_per_s < 0:
            raise ValueError("max_batch_tokens and max_rows_per_s must be >= 0")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r} is not an http:// or https:// base URL")
        self.settings()  # the settings' checks, with the same messages

    def settings(self) -> EmbedSettings:
        return EmbedSettings(self.model, self.text_column, self.id_column, self.input_type, self.prompt_name,
                             self.instruction, self.dimensions, self.truncate, self.outputs, self.encoding)

    @classmethod
    def from_args(cls, argv: list[str]) -> "EmbedJobConfig":
        """INPUT and OUTPUT as the first two arguments (or --input / --output), the rest flags; `--ray` with no
        address is `--ray local`."""
        argv = list(argv)
        lead = []
        while argv and not argv[0].startswith("-") and len(lead) < 2:
            lead.append(argv.pop(0))
        for k in reversed(range(len(argv))):  # `--ray` alone (last, or before another flag): a local instance
            if argv[k] == "--ray" and (k + 1 == len(argv) or argv[k + 1].startswith("-")):
                argv.insert(k + 1, "local")
        return parse(cls, [*(x for k, v in zip(("--input", "--output"), lead) for x in (k, v)), *argv],
                     "TRELLIS_EMBED")
