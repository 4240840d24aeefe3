"""Llama (LlamaModel) over a ragged batch, and the decoder the other Llama-style families share
(Mistral, Qwen2, Qwen3): RMSNorm pre-norm blocks, rotary positions, GQA attention with q/k/v stacked
into one `qkv_proj` GEMM, a gated SiLU MLP with gate/up stacked into `gate_up_proj`. Parameter
names follow Hugging Face's.

Causal by default (last-token pooling, as decoder embedders are published); `is_causal: false` or
`use_bidirectional_attention: true` in config.json makes attention bidirectional. Rotary scaling:
default, linear and llama3 (`rose.layers.rotary`); others are refused naming the field.
Families with sliding-window layers say which in `layer_windows`.

As a cross-encoder (`*ForSequenceClassification`: Qwen3-Reranker converted to a classifier) the head is
`score` (no bias) on each sequence's last token, as transformers reads the last non-padding token; a
causal LM scored by sentence-transformers' LogitScore (Qwen3-Reranker as published) has its head in
`rose.layers.scores.LogitScore`, not here."""

from __future__ import annotations

import re

import torch
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.mlp import GATE_UP, GatedMLP
from rose.layers.norm import RMSNorm
from rose.layers.rotary import Rotary, apply_rotary, rope_params
from rose.layers.pooling import keep_rows
from rose.models.base import Family, last_only

QKV = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
}


class LlamaAttention(nn.Module):
    """q/k/v (one GEMM), optional per-head q/k norm (`norm`: Qwen3, Gemma3), rotary, `o_proj`."""

    def __init__(self, cfg: dict, qkv_bias: bool, o_bias: bool, norm: type | None = None):
        super().__init__()
        self.h, self.hk, self.d = Family.head_shape(cfg)
        self.qkv_proj = nn.Linear(cfg["hidden_size"], (self.h + 2 * self.hk) * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg["hidden_size"], bias=o_bias)
        if norm is not None:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = norm(self.d, eps), norm(self.d, eps)
        self.qk_norm = norm is not None

    def qkv(self, x: torch.Tensor, cos_sin: torch.Tensor):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, k = q.view(T, self.h, self.d), k.view(T, self.hk, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        return q, k, v.view(T, self.hk, self.d)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        act = cfg.get("hidden_act") or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} for {cfg.get('model_type')} (silu)")
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, qkv_bias, o_bias, RMSNorm if qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], "silu", bool(cfg.get("mlp_bias", False)))

    def forward(self, x, cos_sin, meta, attn, rows=None):
        q, k, v = self.pre_attention(x, cos_sin)
        return self.feed_forward(*keep_rows(rows, attn(q, k, v, meta).reshape(x.shape[0], -1), x))

    def pre_attention(self, x: torch.Tensor, cos_sin: torch.Tensor):
        """RMSNorm, q/k/v projection, q/k RMSNorm, rotary: fused by `Engine(compile=True)`."""
        return self.self_attn.qkv(self.input_layernorm(x), cos_sin)

    def feed_forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, RMSNorm, SwiGLU MLP, residual: fused by `Engine(compile=True)`."""
        x = x + self.self_attn.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x))


def bidirectional(config: dict) -> bool:
    """config.json marks a decoder bidirectional: `is_causal: false` (gte-Qwen2, pplx-embed-1) or
    `use_bidirectional_attention: true` (EmbeddingGemma)."""
    return config.get("is_causal") is False or bool(config.get("use_bidirectional_attention", False))


class LlamaModel(Family):
    strip_prefixes = ("model.",)
    ignored = re.compile(r"^lm_head\.|(^|\.)rotary_emb\.")
    stacked_params = {**QKV, **GATE_UP}
    classifier_architectures = frozenset({"LlamaForSequenceClassification"})
    layer = LlamaDecoderLayer
    norm_class = RMSNorm

    @classmethod
    def is_causal(cls, config: dict) -> bool:
        return not bidirectional(config)

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "last"

    @classmethod
    def classifier_pooling(cls, config: dict) -> str:
        """A decoder's classifier reads the last token (the one that has seen the whole pair when causal)."""
        return "last"

    @classmethod
    def layer_windows(cls, config: dict) -> tuple[int, ...]:
        """Each layer's sliding window (`AttentionMetadata.window`; 0: full attention)."""
        return (0,) * config["num_hidden_layers"]

    @classmethod
    def sliding_window(cls, config: dict) -> int:
        return max(cls.layer_windows(config), default=0)

    @classmethod
    def layer_kwargs(cls, config: dict) -> dict:
        """Bias and q/k norm of the family's blocks (Llama: `attention_bias` on q/k/v and o)."""
        bias = bool(config.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def __init__(self, cfg: dict):
        super().__init__()
        self.causal = self.is_causal(cfg)
        self.windows = self.layer_windows(cfg)
        if any(self.windows) and not self.causal and not getattr(self, "bidirectional_windows", False):
            raise ValueError(f"{cfg.get('model_type')}: sliding-window attention with bidirectional attention "
                             "is not defined by transformers for this family")
        h, hk, d = self.head_shape(cfg)
        self._rows = {"qkv_proj": (h * d, hk * d, hk * d),
                      "gate_up_proj": (cfg["intermediate_size"], cfg["intermediate_size"])}
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        kw = self.layer_kwargs(cfg)
        self.layers = nn.ModuleList(self.layer(cfg, **kw) for _ in range(cfg["num_hidden_layers"]))
        self.norm = self.norm_class(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.rotary = self.make_rotary(cfg, d)
        if n := self.num_labels(cfg):
            self.score = nn.Linear(cfg["hidden_size"], n, bias=False)

    def classify(self, last: torch.Tensor) -> torch.Tensor:
        return self.score(last)

    def make_rotary(self, cfg: dict, head_dim: int) -> nn.Module:
        return Rotary.from_params(head_dim, cfg.get("max_position_embeddings", 32768), rope_params(cfg))

    @property
    def window(self) -> int:
        """The largest sliding window of any layer (0: none)."""
        return max(self.windows)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def stacked_rows(self, name: str) -> tuple[int, ...]:
        """Row counts of the shards stacked into parameter `name` (unequal for GQA q/k/v)."""
        return self._rows[name.rsplit(".", 2)[-2]]

    def materialize(self, device: torch.device) -> None:
        self.rotary.materialize(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`token_type_ids` is ignored: a decoder has no segment embeddings (a pair is one text to it)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, w, r in zip(self.layers, self.windows, last_only(self.layers, rows)):
            x = layer(x, cos_sin, meta.with_window(w), attn, r)
        return self.norm(x)
