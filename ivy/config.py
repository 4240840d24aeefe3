"""Ivy's configuration: frozen dataclasses, flags and IVY_* environment variables.

`IvyConfig` is the gateway's settings. The models it serves are `ModelConfig`s: the one named by
`--model` / `--tulip` / `--served-model-name` / `--prompts-file` (when `--tulip` is given), then each
entry of the `--model-config` file, in order. The first is the default: a request without `model`
goes to it.

The `--model-config` file is JSON, a list of models (or {"models": [...]}), each with the fields
of `ModelConfig`:

    [{"name": "reranker", "model": "/models/bge-reranker-v2-m3", "tulip": ["tulip-rr-0.tulip-rr:50051"]},
     {"name": "docs", "model": "/models/bge-m3", "tulip": ["10.0.0.5:50051", "10.0.0.6:50051"],
      "prompts_file": "/etc/ivy/docs-prompts.json"}]
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ivy.discovery import parse_target
from ivy.imagefetch import Allowed
from trellis.cli import field, parse
from trellis.logs import FORMATS, check_format
from trellis.tracing import require as require_tracing


def check_targets(targets: tuple[str, ...], where: str = "") -> None:
    """Each Tulip target is one ivy.discovery.parse_target takes, else a ValueError quoting it
    (after `where`, e.g. the model it belongs to)."""
    for t in targets:
        try:
            parse_target(t)
        except ValueError as e:
            raise ValueError(f"{where}: {e}" if where else str(e)) from None


@dataclass(frozen=True)
class ModelConfig:
    """One model Ivy serves: its directory (tokenizer, prompts, maximum length) and its own Tulips."""

    model: str = field("default", "a Hugging Face Hub id ORG/NAME[@REVISION], a model directory, 'default' "
                       "(all-MiniLM-L6-v2) or preset:NAME (random weights); Ivy reads its tokenizer and configs")
    tulip: tuple[str, ...] = field((), "its Tulip replicas, as --tulip takes them (IP:PORT, unix:PATH, a DNS name "
                                   "NAME:PORT or dns:///NAME:PORT); at least one")
    name: str = field("", "the name clients send as `model` and /v1/models lists; defaults to the directory name")
    prompts_file: str = field("", "JSON {input_type: prompt} overriding the model's prompts; re-read when it changes")
    revision: str = field("", "with a Hub id: the branch, tag or commit (as ORG/NAME@REVISION); its Tulips must "
                          "serve the same one")

    def __post_init__(self):
        what = f"model {self.name or self.model!r}"
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{what}: 'model' must be a Hub id, a model directory, 'default' or preset:NAME")
        if not all(isinstance(v, str) for v in (self.name, self.prompts_file, self.revision)):
            raise ValueError(f"{what}: 'name', 'prompts_file' and 'revision' must be strings")
        if not self.tulip or not all(isinstance(t, str) for t in self.tulip):
            raise ValueError(f"{what}: 'tulip' must list at least one HOST:PORT or unix:PATH")
        check_targets(self.tulip, what)


def read_model_config(path: str) -> tuple[ModelConfig, ...]:
    """The models listed in a --model-config file (see the module docstring), or a ValueError."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model-config {path!r}: {e}") from None
    entries = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--model-config {path!r} must hold a non-empty JSON list of models (or {{\"models\": [...]}})")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ValueError(f"--model-config {path!r}: entry {i} is not an object")
        if unknown := sorted(set(e) - known):
            raise ValueError(f"--model-config {path!r}: entry {i} has unknown field(s) {unknown}; "
                             f"the fields are {sorted(known)}")
        tulip = e.get("tulip", ())
        e = {**e, "tulip": (tulip,) if isinstance(tulip, str) else tuple(tulip) if isinstance(tulip, list) else tulip}
        out.append(ModelConfig(**e))
    return tuple(out)


@dataclass(frozen=True)
class IvyConfig:
    """Ivy: the OpenAI-compatible HTTP gateway in front of one or more Tulip replicas."""

    tulip: tuple[str, ...] = field((), "--model's Tulip replicas: IP:PORT or unix:PATH (one replica), or a DNS name "
                                   "NAME:PORT (or dns:///NAME:PORT) standing for one replica per address it resolves "
                                   "to, e.g. a Kubernetes headless Service; repeat the flag for several")
    resolve_interval: float = field(5.0, "seconds between lookups of each --tulip DNS name (replicas that appear "
                                    "are added, ones that leave finish what they have and are dropped); a "
                                    "connection failure also looks it up again, at most every 0.5 s")
    model: str = field("default", "--tulip's model, for its tokenizer.json and prompts: a Hugging Face Hub id "
                       "ORG/NAME[@REVISION] (its tokenizer and configs fetched into the Hugging Face cache: HF_HOME, "
                       "HF_TOKEN, HF_HUB_OFFLINE), a model directory, 'default' or preset:NAME")
    revision: str = field("", "with a Hub id: the branch, tag or commit (as ORG/NAME@REVISION); the Tulips must "
                          "serve the same one")
    served_model_name: str = field("", "model name clients send and /v1/models lists; defaults to the Hub id, the "
                                   "directory name, preset:NAME or all-MiniLM-L6-v2")
    prompts_file: str = field("", "JSON {input_type: prompt} overriding the model's prompts; re-read when it changes")
    model_config: str = field("", "a JSON file listing more models to serve, each with its own directory and "
                              "Tulips (ivy/config.py's docstring; docs/configuration.md); --model with --tulip, "
                              "if given, comes first and is the default")
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(8000, "HTTP port")
    workers: int = field(1, "worker processes (each with its own event loop and Tulip channels)")
    server: str = field("uvicorn", "the ASGI server: uvicorn (httptools, uvloop: the lower latency per request) "
                        "or granian (HTTP in a Rust thread, the app on uvloop: more requests/s per saturated "
                        "worker, ~0.1-0.3 ms more per request at one client; benchmarks.gateway)",
                        choices=("uvicorn", "granian"))
    transport: str = field("stream", "how Ivy calls each Tulip: one open EmbedStream per replica, or unary Embed calls",
                           choices=("stream", "unary"))
    tulip_spin_ms: float = field(0.0, "while a Tulip reply is due, keep the worker's event loop polling for up to "
                                 "this long (lower latency, one busy core per worker meanwhile); 0: sleep until it comes")
    max_chunk_tokens: int = field(8192, "a request is cut into chunks of at most this many tokens, one per replica call")
    max_inputs: int = field(2048, "most inputs accepted in one request")
    max_request_mb: int = field(32, "largest request body accepted, in MiB (413 beyond)")
    max_request_tokens: int = field(1 << 20, "most tokens one request may make, all its inputs together (special "
                                    "tokens and truncate \"chunk\" windows included): tokenizing stops there "
                                    "and the request is a 413 (2,048 inputs of 512 tokens fit; so does one Tulip's "
                                    "default --max-queued-tokens)")
    max_reply_mb: int = field(32, "largest reply /v1/tokenize and TEI's /tokenize build, in MiB (413 beyond): "
                              "a token's JSON is many times its text")
    max_connections: int = field(4096, "most HTTP connections one worker holds open; past it a new connection is "
                                 "answered 503 and closed at once (uvicorn), so idle or slow peers cannot take "
                                 "every file descriptor (the worker's soft RLIMIT_NOFILE is raised to its hard "
                                 "limit at start)")
    max_images: int = field(256, "most images in one request (a model with an image tower; 400 beyond)")
    max_image_mb: int = field(10, "largest image accepted, in MiB of its file (base64 decoded, or fetched; 413 beyond)")
    max_image_pixels: int = field(40_000_000, "most pixels an image may have, width x height as its header states "
                                  "them before anything is decoded (decompression bombs; 400 beyond); Pillow's own "
                                  "guard refuses over 2 x 89,478,485 whatever this says")
    allow_image_urls: tuple[str, ...] = field((), "hosts image inputs may name as http(s) URLs: HOST (any port) or "
                                              "HOST:PORT, comma-separated or the flag repeated; none: URLs are "
                                              "refused. A host name must resolve to public addresses only; an IP "
                                              "address written here is allowed even where private or loopback "
                                              "(ivy/imagefetch.py)")
    image_url_timeout_s: float = field(5.0, "an image URL's fetch (connect, headers, body) must end within this many "
                                       "seconds, else the request is a 400")
    request_timeout_s: float = field(60.0, "deadline for one request's Tulip calls, in seconds")
    read_timeout_s: float = field(30.0, "a request's headers and body must arrive within this many seconds of its "
                                  "first byte (of a new connection's opening), else the connection is closed "
                                  "(slow or stalled peers); under Granian: its header read timeout")
    keep_alive_s: float = field(5.0, "an idle keep-alive connection is closed after this many seconds (uvicorn)")
    tokenize_offload_chars: int = field(8192, "requests with more characters than this are tokenized off the event loop")
    api_keys: tuple[str, ...] = field((), "accepted API keys: every route but /health, /ready, /metrics and the "
                                      "API documents then needs 'Authorization: Bearer KEY'; prefer IVY_API_KEYS=k1,k2 "
                                      "(flags show in process lists); none: no authentication")
    access_log: bool = field(False, "log one line per HTTP request (the server's access log; under uvicorn it "
                             "cost ~0.1 ms of CPU per request, 10-15 %% of a worker's throughput, benchmarks.gateway); "
                             "with --log-format json, Ivy's own: method, path, status, duration_ms, request_id, model")
    log_level: str = field("info", "the server's log level", choices=("critical", "error", "warning", "info", "debug"))
    log_format: str = field("text", "log lines as text (TIME LEVEL LOGGER: MESSAGE) or json: one JSON object per "
                            "line (time, level, logger, message, request_id; trellis.logs)", choices=FORMATS)
    otlp_endpoint: str = field("", "send OpenTelemetry traces (spans of each HTTP request, its tokenization and "
                               "each chunk's Tulip call) to this OTLP/gRPC collector, e.g. http://otel-collector:4317; "
                               "needs pip install 'trellis[tracing]'; empty: no tracing (ivy.tracing)")
    batch_dir: str = field("", "directory of the OpenAI Batch API's files and jobs (a SQLite database in WAL mode "
                           "and the files; on a local filesystem, shared by this Ivy's workers): /v1/files and "
                           "/v1/batches are served, jobs run at batch priority and resume after a restart "
                           "(ivy.batches); empty: those routes answer 404 'the Batch API is not enabled'")
    max_batch_file_mb: int = field(200, "largest file POST /v1/files takes, in MiB (413 beyond; streamed to disk)")
    max_batch_lines: int = field(50000, "most requests (lines) one batch input file may hold (more: the batch fails "
                                 "validation, too_many_lines)")
    batch_concurrency: int = field(8, "a batch's requests run at once by the worker running it, each as one "
                                   "HTTP request to its endpoint would")

    def __post_init__(self):
        if not self.tulip and not self.model_config:
            raise ValueError("at least one --tulip HOST:PORT (or a --model-config file) is required")
        check_targets(self.tulip)
        if not self.resolve_interval > 0:
            raise ValueError(f"resolve_interval {self.resolve_interval} must be > 0 (seconds)")
        models = read_model_config(self.model_config) if self.model_config else ()
        if self.tulip:
            models = (ModelConfig(self.model, self.tulip, self.served_model_name, self.prompts_file, self.revision),
                      *models)
        object.__setattr__(self, "_models", models)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0..65535")
        for name in ("workers", "max_chunk_tokens", "max_inputs", "max_request_mb", "max_request_tokens",
                     "max_reply_mb", "max_connections", "max_images", "max_image_mb", "max_image_pixels",
                     "max_batch_file_mb", "max_batch_lines", "batch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.tulip_spin_ms < 0:
            raise ValueError(f"tulip_spin_ms {self.tulip_spin_ms} must be >= 0")
        object.__setattr__(self, "image_urls", Allowed.parse(self.allow_image_urls))  # a ValueError quotes a bad entry
        for name in ("request_timeout_s", "read_timeout_s", "keep_alive_s", "image_url_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)} must be > 0")
        for key in self.api_keys:  # `--api-keys "$UNSET"` must not turn into a key that an empty bearer matches
            if not key or not key.isprintable() or key != key.strip() or " " in key:
                raise ValueError(f"--api-keys: {key!r} is not a usable API key (empty, or with blanks or control "
                                 "characters); give each key as printable text, or leave the flag out for none")
        check_format(self.log_format)
        if self.otlp_endpoint:
            require_tracing("--otlp-endpoint")

    @property
    def models(self) -> tuple[ModelConfig, ...]:
        """The models served, the default first (see the module docstring)."""
        return self._models

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "IvyConfig":
        return parse(cls, argv, "IVY")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "IvyConfig":
        d = json.loads(s)
        d["tulip"], d["api_keys"] = tuple(d["tulip"]), tuple(d["api_keys"])
        d["allow_image_urls"] = tuple(d.get("allow_image_urls", ()))
        return cls(**d)
