"""Ivy's configuration: one frozen dataclass, flags and IVY_* environment variables."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ivy.discovery import parse_target
from trellis.cli import field, parse


@dataclass(frozen=True)
class IvyConfig:
    """Ivy: the OpenAI-compatible HTTP gateway in front of one or more Tulip replicas."""

    tulip: tuple[str, ...] = field((), "Tulip replicas: IP:PORT or unix:PATH (one replica), or a DNS name NAME:PORT "
                                   "(or dns:///NAME:PORT) standing for one replica per address it resolves to, "
                                   "e.g. a Kubernetes headless Service; repeat the flag for several")
    resolve_interval: float = field(5.0, "seconds between lookups of each --tulip DNS name (replicas that appear "
                                    "are added, ones that leave finish what they have and are dropped); a "
                                    "connection failure also looks it up again, at most every 0.5 s")
    model: str = field("default", "model directory (for tokenizer.json and prompts) or 'default'")
    served_model_name: str = field("", "model name clients send and /v1/models lists; defaults to the directory name")
    prompts_file: str = field("", "JSON {input_type: prompt} overriding the model's prompts; re-read when it changes")
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
    request_timeout_s: float = field(60.0, "deadline for one request's Tulip calls, in seconds")
    read_timeout_s: float = field(30.0, "a request's headers and body must arrive within this many seconds of its "
                                  "first byte (of a new connection's opening), else the connection is closed "
                                  "(slow or stalled peers); under Granian: its header read timeout")
    keep_alive_s: float = field(5.0, "an idle keep-alive connection is closed after this many seconds (uvicorn)")
    tokenize_offload_chars: int = field(8192, "requests with more characters than this are tokenized off the event loop")
    api_keys: tuple[str, ...] = field((), "accepted API keys: /v1/* and /v2/* then need 'Authorization: "
                                      "Bearer KEY'; prefer IVY_API_KEYS=k1,k2 (flags show in process lists); none: "
                                      "no authentication")
    access_log: bool = field(False, "log one line per HTTP request (the server's access log; under uvicorn it "
                             "cost ~0.1 ms of CPU per request, 10-15 %% of a worker's throughput, benchmarks.gateway)")
    log_level: str = field("info", "the server's log level", choices=("critical", "error", "warning", "info", "debug"))

    def __post_init__(self):
        if not self.tulip:
            raise ValueError("at least one --tulip HOST:PORT is required")
        for t in self.tulip:
            parse_target(t)  # ValueError quoting it
        if not self.resolve_interval > 0:
            raise ValueError(f"resolve_interval {self.resolve_interval} must be > 0 (seconds)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0..65535")
        for name in ("workers", "max_chunk_tokens", "max_inputs", "max_request_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.tulip_spin_ms < 0:
            raise ValueError(f"tulip_spin_ms {self.tulip_spin_ms} must be >= 0")
        for name in ("request_timeout_s", "read_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)} must be > 0")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "IvyConfig":
        return parse(cls, argv, "IVY")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "IvyConfig":
        d = json.loads(s)
        d["tulip"], d["api_keys"] = tuple(d["tulip"]), tuple(d["api_keys"])
        return cls(**d)
