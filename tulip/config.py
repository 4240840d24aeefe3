"""Tulip's configuration: one frozen dataclass, flags and TULIP_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from rose.backends import BACKENDS, QUANTIZATIONS
from rose.extras import Extra
from trellis.cli import field, parse
from trellis.logs import FORMATS, check_format
from trellis.tracing import require as require_tracing


@dataclass(frozen=True)
class TulipConfig:
    """Tulip: the gRPC inference server for one model on one device."""

    model: str = field("default", "a Hugging Face Hub id ORG/NAME[@REVISION] (downloaded once into the Hugging "
                       "Face cache: HF_HOME, HF_TOKEN, HF_HUB_OFFLINE), a model directory (Hugging Face layout), "
                       "'default' (all-MiniLM-L6-v2) or preset:NAME (real shapes, RANDOM weights)")
    revision: str = field("", "with a Hub id: the branch, tag or commit to serve (as ORG/NAME@REVISION); empty: "
                          "the default branch")
    served_model_name: str = field("", "name reported by Info; defaults to the Hub id, the directory name, "
                                   "preset:NAME or all-MiniLM-L6-v2")
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(50051, "gRPC port (0 picks a free one)")
    uds: str = field("", "also listen on this Unix domain socket path (for a co-located Ivy: --tulip unix:PATH)")
    metrics_port: int = field(0, "Prometheus metrics HTTP port (0: no metrics server)")
    device: str = field("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = field("auto", "compute dtype", choices=("auto", "float32", "bfloat16", "float16"))
    attention: str = field("auto", "attention backend",
                           choices=("auto", *BACKENDS))
    attention_table: str = field("", "with --attention auto: JSON table from `python -m benchmarks.kernels` choosing "
                                 "the backend per batch shape, or a directory of them (e.g. benchmarks/results/"
                                 "2026-12-02_h200_attention-sweep: the one for the model's head shape, a causal model's "
                                 "*_causal.json; without one, the built-in choice)")
    graphs: str = field("lazy", "CUDA graphs per (sequences, tokens) bucket: captured on the second hit, "
                        "on the first (eager-all), or never", choices=("lazy", "eager-all", "off"))
    compile: bool = field(False, "fuse each layer's post-attention work with torch.compile (CUDA; slower start)")
    kernel_tokens: int = field(512, "steps of up to this many tokens run ROSE's Triton small-batch path (CUDA, half "
                               "precision, Triton installed; Qwen3 caps it at 256); 0: torch's path for every step")
    quantization: str = field("auto", "fp8: the encoder blocks' GEMMs in float8 e4m3 for steps of at least "
                              "--fp8-min-tokens tokens (BERT / XLM-RoBERTa / Qwen3 blocks; weights quantised per "
                              "channel at load, kept beside the bf16 ones; activations per row; attention and norms "
                              "bf16; a GPU of compute capability 8.9+); none: bf16 throughout (a checkpoint published "
                              "in fp8 dequantised); auto: fp8 for a checkpoint published in fp8 (compressed-tensors, "
                              "fbgemm_fp8; its weights as published) where that path runs, else none",
                              choices=QUANTIZATIONS)
    fp8_min_tokens: int = field(1024, "with --quantization fp8: the smallest step (tokens) whose GEMMs run in fp8; "
                                "smaller steps keep bf16 (python -m benchmarks.fp8's row sweep measures the "
                                "crossover per GPU)")
    online_lane_tokens: int = field(0, "CUDA: online steps of up to this many tokens run on a stream of their own "
                                    "at the highest priority, with their own graphs, beside the bulk steps in flight "
                                    "instead of behind them (rose.engine.EngineConfig.online_lane_tokens); 0: one stream")
    warmup: tuple[str, ...] = field((), "shapes NxL to run before reporting SERVING, e.g. --warmup 1x128 --warmup 32x512; "
                                    "A-BxL: every N from A to B (e.g. 1-16x512, the batches 16 concurrent callers "
                                    "form); NxL+sparse+colbert also warms the graphs of steps with those outputs (BGE-M3)")
    max_inflight: int = field(2, "engine steps in flight: batch N+1 is formed and launched while batch N runs "
                              "(once a quarter of --max-batch-tokens is waiting); batch-only steps one at a time while "
                              "online work is live (--online-batch-step-tokens)")
    spin_ms: float = field(10.0, "poll a running step's completion from the event loop for up to this long, then "
                           "wait in a thread, and keep the loop polling this long after each step (lowest latency, "
                           "one busy core meanwhile); 0: always a thread, no polling")
    max_batch_tokens: int = field(0, "token budget of one engine step, >= the model's max sequence length; "
                                  "0: 16384, or that length where it is longer (e.g. 32768 for Qwen3)")
    batch_step_tokens: int = field(2048, "the most tokens of batch-class work (PRIORITY_BATCH: bulk jobs) one step "
                                   "takes (one longer sequence still goes alone); online requests that arrive wait for "
                                   "the steps in flight, so smaller batch steps shorten their wait (H100, bge-m3, a job "
                                   "of 8 x 100 x 512 outstanding: online p99 61.8 ms at 0, 18.2 at 4096, 10.1 at 2048, "
                                   "the job's rate 1,574 / 1,641 / 1,705 emb/s); 0: the whole budget")
    online_batch_step_tokens: int = field(0, "--batch-step-tokens while online work is live (an online request came "
                                          "in the last second; batch-only steps then also go one at a time, "
                                          "tulip.loop.ONLINE_LIVE_S): an online request waits for at most one batch "
                                          "step, of at most this many tokens; 0: --batch-step-tokens")
    max_queued_tokens: int = field(1 << 20, "tokens allowed to wait; beyond it new requests get RESOURCE_EXHAUSTED")
    drain_seconds: float = field(10.0, "on SIGTERM, how long in-flight requests may take to finish")
    max_message_mb: int = field(64, "largest gRPC message accepted or sent, in MiB")
    grpc_server: str = field("ours", "the gRPC server: ours (tulip.h2server: HTTP/2 framing on the event loop, "
                             "~0.1-0.3 ms less a request; plaintext, identity encoding only) or grpcio (grpc.aio's "
                             "server, tulip.aioserver: TLS with --tls-cert / --tls-key, compressed requests); the "
                             "same services either way (docs/deploy.md)", choices=("ours", "grpcio"))
    tls_cert: str = field("", "with --grpc-server grpcio: PEM certificate chain file; every port then takes TLS only "
                          "(needs --tls-key); empty: plaintext")
    tls_key: str = field("", "with --grpc-server grpcio: PEM private key file of --tls-cert")
    stage_samples: int = field(0, "record per-stage timestamps (receipt, decode, validate, schedule, batch, launch, "
                               "wait, copy, deliver, reply, encode, write) of the last N requests and log their p50 "
                               "at shutdown (tulip.stages); 0: off")
    log_format: str = field("text", "log lines as text (TIME LEVEL LOGGER: MESSAGE) or json: one JSON object per "
                            "line (time, level, logger, message; trellis.logs); TULIP_READY stays a plain line on "
                            "stdout", choices=FORMATS)
    otlp_endpoint: str = field("", "send OpenTelemetry traces (a span per request, with its queue wait and engine step "
                               "as child spans, joined to the caller's trace) to this OTLP/gRPC collector, e.g. "
                               "http://otel-collector:4317; needs pip install 'trellis[tracing]'; empty: no tracing "
                               "(tulip.tracing)")

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} {getattr(self, name)} is not in 0..65535")
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be >= 1 (or 0: from the model)")
        if self.max_queued_tokens < self.max_batch_tokens:
            raise ValueError(
                f"max_queued_tokens {self.max_queued_tokens} must be >= max_batch_tokens {self.max_batch_tokens}"
            )
        warmup_shapes(self.warmup)
        for name in ("batch_step_tokens", "online_batch_step_tokens", "online_lane_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 0 (0: see its help)")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight {self.max_inflight} must be >= 1")
        if self.spin_ms < 0:
            raise ValueError(f"spin_ms {self.spin_ms} must be >= 0")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds {self.drain_seconds} must be >= 0")
        if self.stage_samples < 0:
            raise ValueError(f"stage_samples {self.stage_samples} must be >= 0")
        if self.kernel_tokens < 0:
            raise ValueError(f"kernel_tokens {self.kernel_tokens} must be >= 0 (0: torch's path)")
        if self.fp8_min_tokens < 1:
            raise ValueError(f"fp8_min_tokens {self.fp8_min_tokens} must be >= 1")
        if self.quantization == "fp8" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantization fp8 runs in bfloat16: dtype {self.dtype!r} (choose auto or bfloat16)")
        if self.max_message_mb < 1:
            raise ValueError(f"max_message_mb {self.max_message_mb} must be >= 1")
        if self.grpc_server not in ("ours", "grpcio"):
            raise ValueError(f"grpc_server {self.grpc_server!r} is not ours or grpcio")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(f"tls_cert {self.tls_cert!r} and tls_key {self.tls_key!r}: TLS needs both files")
        if self.tls_cert and self.grpc_server != "grpcio":
            raise ValueError("TLS (tls_cert, tls_key) is served by grpc.aio's server: add --grpc-server grpcio "
                             "(ours speaks plaintext HTTP/2 only)")
        check_format(self.log_format)
        if self.otlp_endpoint:
            require_tracing("--otlp-endpoint")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "TulipConfig":
        return parse(cls, argv, "TULIP")


def warmup_shapes(specs: tuple[str, ...]) -> list[tuple[int, int, frozenset]]:
    """--warmup values -> (sequences, length, outputs) per shape: "NxL", "A-BxL" (N = A..B), each
    optionally "+sparse" / "+colbert". Raises ValueError naming the bad value."""
    out = []
    for w in specs:
        shape, *extras = w.split("+")
        n, x, length = shape.partition("x")
        lo, dash, hi = n.partition("-")
        if not (x and lo.isdigit() and (hi.isdigit() or not dash) and length.isdigit()
                and 0 < int(lo) <= int(hi or lo) and int(length) > 0):
            raise ValueError(f"warmup shape {w!r} is not NxL or A-BxL (e.g. 1x128, 1-16x512)")
        if not set(extras) <= set(Extra):
            raise ValueError(f"warmup shape {w!r}: outputs after '+' are sparse and/or colbert")
        out += [(k, int(length), frozenset(Extra(e) for e in extras)) for k in range(int(lo), int(hi or lo) + 1)]
    return out
