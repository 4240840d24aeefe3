"""T5's encoder (T5EncoderModel, as in sentence-transformers/sentence-t5-base and gtr-t5-base) over a
ragged batch: pre-norm blocks with T5's RMS layer norm (no mean, no bias), no absolute positions but a
relative position bias (T5's bidirectional buckets of key - query, `relative_attention_num_buckets` and
`relative_attention_max_distance` as config.json says) that the first block owns and every block adds
to its attention scores, attention without the 1/sqrt(d) scale, and a ReLU (`feed_forward_proj: relu`,
T5 v1.0) or gated-GELU (`gated-gelu`, T5 v1.1: GTR) feed-forward; the final layer norm closes it.

The bias needs a backend that adds one (`score_bias`, as MPNet's: ROSE's Triton attention on CUDA,
captured in graphs; `padded` without Triton; `sdpa` elsewhere). Queries are pre-scaled by sqrt(d_kv),
so every backend's d_kv**-0.5 gives T5's unscaled scores (exact: a power of two at the published
d_kv of 64). Hugging Face names (`shared`, `encoder.block.N.layer.0.SelfAttention.q`, ...); q/k/v are
stacked into one `qkv` GEMM; a whole T5's decoder and LM head are not loaded."""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from torch import nn

from rose.layers.activation import get_activation
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.norm import RMSNorm
from rose.layers.pooling import keep_rows
from rose.layers.relative import bucket_bias
from rose.models.base import Family, last_only


def feed_forward_proj(config: dict) -> tuple[str, bool]:
    """config.json's `feed_forward_proj` as transformers reads it: ("relu", False), ("gelu_new", True), ..."""
    parts = str(config.get("feed_forward_proj", "relu")).split("-")
    gated = parts[0] == "gated"
    if len(parts) > 2 or (len(parts) == 2 and not gated):
        raise ValueError(f"feed_forward_proj {config['feed_forward_proj']!r} is not '{{act}}' or 'gated-{{act}}'")
    act = parts[-1]
    return ("gelu_new" if act == "gelu" and gated else act), gated


class T5SelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.h, self.d = cfg["num_heads"], cfg["d_kv"]
        self.qkv = nn.Linear(cfg["d_model"], 3 * self.h * self.d, bias=False)
        self.o = nn.Linear(self.h * self.d, cfg["d_model"], bias=False)
        self.q_scale = math.sqrt(self.d)

    def forward(self, x, meta, attn):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.h, self.d).unbind(1)
        return self.o(attn(q * self.q_scale, k, v, meta).reshape(x.shape[0], -1))


class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.SelfAttention = T5SelfAttention(cfg)
        self.layer_norm = RMSNorm(cfg["d_model"], cfg.get("layer_norm_epsilon", 1e-6))


class T5DenseActDense(nn.Module):
    """`wo(act(wi(x)))`, or gated `wo(act(wi_0(x)) * wi_1(x))`."""

    def __init__(self, cfg: dict):
        super().__init__()
        act, self.gated = feed_forward_proj(cfg)
        self.act = get_activation(act)
        if self.gated:
            self.wi_0 = nn.Linear(cfg["d_model"], cfg["d_ff"], bias=False)
            self.wi_1 = nn.Linear(cfg["d_model"], cfg["d_ff"], bias=False)
        else:
            self.wi = nn.Linear(cfg["d_model"], cfg["d_ff"], bias=False)
        self.wo = nn.Linear(cfg["d_ff"], cfg["d_model"], bias=False)

    def forward(self, x):
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x)))


class T5LayerFF(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.DenseReluDense = T5DenseActDense(cfg)
        self.layer_norm = RMSNorm(cfg["d_model"], cfg.get("layer_norm_epsilon", 1e-6))


class T5Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(cfg), T5LayerFF(cfg)])

    def forward(self, x, meta, attn, rows=None):
        sa = self.layer[0]
        return self.feed_forward(*keep_rows(rows, sa.SelfAttention(sa.layer_norm(x), meta, attn), x))

    def feed_forward(self, a, x):
        """Residual, layer norm, feed-forward, residual: fused by `Engine(compile=True)`."""
        x = x + a
        ff = self.layer[1]
        return x + ff.DenseReluDense(ff.layer_norm(x))


class T5Stack(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.block = nn.ModuleList(T5Block(cfg) for _ in range(cfg["num_layers"]))
        self.block[0].layer[0].SelfAttention.relative_attention_bias = nn.Embedding(
            cfg.get("relative_attention_num_buckets", 32), cfg["num_heads"])
        self.buckets = int(cfg.get("relative_attention_num_buckets", 32))
        self.max_distance = int(cfg.get("relative_attention_max_distance", 128))
        self.final_layer_norm = RMSNorm(cfg["d_model"], cfg.get("layer_norm_epsilon", 1e-6))

    def position_bias(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """[heads, length, length], contiguous: the bias of key j for query i, by T5's bucket of j - i.
        Once per step, shared by every block."""
        return bucket_bias(self.block[0].layer[0].SelfAttention.relative_attention_bias, length, dtype, self.buckets,
                           self.max_distance)


class T5EncoderModel(Family):
    ignored = re.compile(r"^encoder\.embed_tokens\.|^decoder\.|^lm_head\.")  # the tied copy of `shared`; a T5's rest
    stacked_params = {
        ".SelfAttention.q.": (".SelfAttention.qkv.", 0),
        ".SelfAttention.k.": (".SelfAttention.qkv.", 1),
        ".SelfAttention.v.": (".SelfAttention.qkv.", 2),
    }
    score_bias = True

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        return {**config, "hidden_size": config["d_model"], "num_attention_heads": config["num_heads"],
                "num_hidden_layers": config["num_layers"], "intermediate_size": config["d_ff"],
                "head_dim": config["d_kv"]}

    @classmethod
    def max_positions(cls, config: dict) -> int:
        """Relative positions number any length; T5's configs say 512 (`n_positions`) where they say."""
        return int(config.get("n_positions") or 512)

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Mean, as sentence-t5 and GTR (whose Pooling modules say so, then Dense and Normalize)."""
        return "mean"

    def __init__(self, cfg: dict):
        super().__init__()
        self.shared = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
        self.encoder = T5Stack(cfg)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.block

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.shared(input_ids)
        meta = dataclasses.replace(meta, bias=self.encoder.position_bias(meta.max_seqlen, x.dtype))
        for block, r in zip(self.encoder.block, last_only(self.encoder.block, rows)):
            x = block(x, meta, attn, r)
        return self.encoder.final_layer_norm(x)
