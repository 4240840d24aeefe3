"""BERT (BertModel, as in all-MiniLM-L6-v2) over a ragged batch.

Parameter names follow Hugging Face's BertModel so checkpoints load with a
small map; the one change is that query/key/value are stacked into one `qkv`
GEMM (`stacked_params`). The pooler is not used by embedding models and is
skipped when loading; a `BertForSequenceClassification` directory (a cross-encoder) loads it
with its `classifier` (`Family.classify`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rose.layers.activation import GELUS, get_activation, linear_gelu
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.fp8 import Fp8Blocks, post_norm_forward
from rose.layers.pooling import keep_rows
from rose.layers.small_step import SmallStepKernels, post_norm_block
from rose.models.base import Family, last_only


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))

    def fused(self, input_ids: torch.Tensor, positions: torch.Tensor, offset: int) -> torch.Tensor:
        """The same with one segment, in one kernel (`rose.kernels.rows.embed_norm`), positions
        before the family's offset."""
        from rose.kernels.rows import embed_norm

        ln = self.LayerNorm
        return embed_norm(input_ids, positions, self.word_embeddings.weight, self.position_embeddings.weight,
                          self.token_type_embeddings.weight[0], ln.weight, ln.bias, ln.eps, offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # `positions` already include the family's offset (Family.position_offset). Without token
        # types (one segment) every token is type 0: one row, no gather. A model with one token type
        # (XLM-RoBERTa) numbers every token 0 whatever the segments, as its tokenizer does.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = h // self.num_heads
        self.qkv = nn.Linear(h, 3 * h)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return attn(q, k, v, meta).reshape(x.shape[0], -1)


class BertDenseLayerNorm(nn.Module):
    """`dense` then residual add then `LayerNorm` (BertSelfOutput and BertOutput)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Holds `self` (q/k/v and attention) and `output`; BertLayer calls them separately."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.self = BertSelfAttention(cfg)
        self.output = BertDenseLayerNorm(h, h, eps)


class BertIntermediate(nn.Module):
    """`dense` then the activation. GELU models in half precision on CUDA run both as one GEMM
    (`linear_gelu`); float32 and CPU keep the two steps, with the exact activation: the reference."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.act = get_activation(cfg.get("hidden_act", "gelu"))
        self.gelu = cfg.get("hidden_act", "gelu") in GELUS

    def forward(self, x):
        if self.gelu and x.is_cuda and x.dtype != torch.float32:
            return linear_gelu(x, self.dense.weight, self.dense.bias)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseLayerNorm(cfg["intermediate_size"], h, eps)

    def forward(self, x, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attention.self(x, meta, attn), x))

    def small_step(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The same layer for small steps, in fewer kernels (`rose.layers.small_step`)."""
        sa, so = self.attention.self, self.attention.output
        return post_norm_block(x, meta, attn, sa.num_heads, sa.qkv, so.dense, so.LayerNorm, self.intermediate.dense,
                               self.output.dense, self.output.LayerNorm, rows=rows)

    def feed_forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Everything after attention (projection, residual + LayerNorm, FFN, residual +
        LayerNorm): the elementwise work `Engine(compile=True)` fuses."""
        x = self.attention.output(a, x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))


class BertPooler(nn.Module):
    """`dense` then tanh on each sequence's first token (BertForSequenceClassification's pooler)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


POSITION_IDS = re.compile(r"(^|\.)position_ids$")


class BertModel(SmallStepKernels, Fp8Blocks, Family):
    # Checkpoint names -> ours (`Family`): strip these prefixes, skip what matches `ignored`,
    # and stack q/k/v into qkv (shard index along dim 0).
    strip_prefixes = ("bert.", "model.")
    ignored = re.compile(r"(^|\.)position_ids$|^pooler\.")
    classifier_architectures = frozenset({"BertForSequenceClassification"})
    stacked_params = {
        ".attention.self.query.": (".attention.self.qkv.", 0),
        ".attention.self.key.": (".attention.self.qkv.", 1),
        ".attention.self.value.": (".attention.self.qkv.", 2),
    }

    def __init__(self, cfg: dict):
        super().__init__()
        self.offset = self.position_offset(cfg)
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r}")
        self.hidden_size = cfg["hidden_size"]
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        if n := self.num_labels(cfg):
            self.add_classifier(cfg, n)

    def add_classifier(self, cfg: dict, n: int) -> None:
        """BertForSequenceClassification's head: `pooler` (dense + tanh) then `classifier` (dropout is
        inference's identity)."""
        self.pooler = BertPooler(cfg)
        self.classifier = nn.Linear(cfg["hidden_size"], n)
        self.ignored = POSITION_IDS  # the pooler is the head's: loaded, not skipped

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(first))

    def embed(self, input_ids, positions, token_type_ids, small: bool) -> torch.Tensor:
        """The embeddings' output, the first layer's input (one fused kernel in small steps of one segment)."""
        if small and (token_type_ids is None or self.embeddings.token_type_embeddings.num_embeddings == 1):
            return self.embeddings.fused(input_ids, positions, self.offset)
        return self.embeddings(input_ids, positions + self.offset if self.offset else positions, token_type_ids)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layer

    @property
    def ffn_fits(self) -> bool:
        return self.blocks[0].intermediate.gelu

    def fp8_linears(self, layer: BertLayer) -> dict[str, nn.Linear]:
        return {"qkv": layer.attention.self.qkv, "out": layer.attention.output.dense,
                "up": layer.intermediate.dense, "down": layer.output.dense}

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        small = input_ids.shape[0] <= self.kernel_tokens  # host-side: the ids' rows are the graph's token bucket
        x = self.embed(input_ids, positions, token_type_ids, small)
        if not small and 0 < self.fp8_tokens <= input_ids.shape[0]:  # --quantization fp8, a large step
            return post_norm_forward(self, x, meta, attn, rows)
        for layer, r in zip(self.encoder.layer, last_only(self.encoder.layer, rows)):
            x = layer.small_step(x, meta, attn, r) if small else layer(x, meta, attn, r)
        return x
