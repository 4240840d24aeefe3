"""ModernBERT (ModernBertModel, as in gte-modernbert-base and modernbert-embed-base) over a
ragged batch: pre-norm layers without biases, rotary positions, a GeGLU MLP, a final norm, and
attention that alternates global layers with local ones (a sliding window).

Every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) is global; the others see keys at most
`local_attention // 2` positions away (Hugging Face's `sliding_window`, |i - j| <= 64 for 128),
with their own rotary base (`local_rope_theta` 10,000 against `global_rope_theta` 160,000; in
newer config.json files `layer_types` and `rope_parameters` per layer type say the same). The
first layer has no attention norm (Hugging Face's Identity). The window reaches the attention
backend as `AttentionMetadata.window`; a backend without one runs the local layers elsewhere
(`rose.layers.attention.WindowFallback`, chosen by the engine). Hugging Face parameter names.

As a cross-encoder (`ModernBertForSequenceClassification`, e.g. gte-reranker-modernbert-base) the
head is transformers': the final states pooled by config.json's `classifier_pooling` ("cls": the
first token; "mean": every token of the sequence, special tokens included, as transformers' masked
mean over the unpadded tokens), then `head` (dense, `classifier_activation`, norm) and `classifier`;
its dropout is inference's identity. ModernBERT has no token types: a pair's segments change nothing.

Steps of up to `kernel_tokens` tokens take a small step in ROSE's kernels (`small_step`): q/k rotated
in one kernel, each residual add fused with the LayerNorm after it (pre-norm: both the stream and its
norm come out), the output and down projections split-K in Triton, the GeGLU in the up GEMM's
epilogue; the local layers' window stays the attention backend's.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.activation import get_activation
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.pooling import keep_rows
from rose.layers.rotary import Rotary, apply_rotary
from rose.layers.small_step import SmallStepKernels
from rose.models.base import Family, last_only

GLOBAL, LOCAL = "full_attention", "sliding_attention"


def layer_types(cfg: dict) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = int(cfg.get("global_attn_every_n_layers", 3))
    return [LOCAL if i % every else GLOBAL for i in range(cfg["num_hidden_layers"])]


def rope_thetas(cfg: dict) -> dict[str, float]:
    params = cfg.get("rope_parameters") or {}
    out = {}
    for kind, key, default in ((GLOBAL, "global_rope_theta", 160_000.0), (LOCAL, "local_rope_theta", 10_000.0)):
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {p['rope_type']!r} for modernbert (supported: default)")
        out[kind] = float(p.get("rope_theta", cfg.get(key, default)))
    return out


def _norm(cfg: dict) -> nn.LayerNorm:
    return nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.norm = _norm(cfg)

    def forward(self, input_ids):
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.num_heads = cfg["num_attention_heads"]
        self.Wqkv = nn.Linear(h, 3 * h, bias=bias)
        self.Wo = nn.Linear(h, h, bias=bias)

    def forward(self, x, cos_sin, meta, attn):
        q, k, v = self.Wqkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary(q, k, cos_sin)
        return self.Wo(attn(q, k, v, meta).reshape(x.shape[0], -1))


class ModernBertMLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        bias = cfg.get("mlp_bias", False)
        self.Wi = nn.Linear(cfg["hidden_size"], 2 * cfg["intermediate_size"], bias=bias)
        self.Wo = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=bias)
        self.act = get_activation(cfg.get("hidden_activation", "gelu"))

    def forward(self, x):
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, cfg: dict, index: int):
        super().__init__()
        self.attn_norm = _norm(cfg) if index else nn.Identity()
        self.attn = ModernBertAttention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = ModernBertMLP(cfg)
        self.local = layer_types(cfg)[index] == LOCAL

    def forward(self, x, cos_sin, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attn(self.attn_norm(x), cos_sin, meta, attn), x))

    def feed_forward(self, a, x):
        """Residual, norm, GeGLU MLP, residual: fused by `Engine(compile=True)`."""
        x = x + a
        return x + self.mlp(self.mlp_norm(x))

    def small_step(self, x, h, positions, table, meta, attn, next_norm: nn.LayerNorm, rows=None):
        """The same layer for small steps, in fewer kernels: x is the residual stream and h its
        attention norm (the embeddings' output itself for layer 0); returns the new stream and
        `next_norm` of it (the next layer's attention norm, or the final one)."""
        from rose.kernels import gemm
        from rose.kernels.rope import rope

        a, mlp, norm = self.attn, self.mlp, self.mlp_norm
        T, hidden = x.shape
        q, k, v = rope(a.Wqkv(h), positions, table, a.num_heads, hidden // a.num_heads)
        o, x = keep_rows(rows, attn(q, k, v, meta).reshape(T, hidden), x)
        x, h = gemm.add_norm(gemm.linear_partials(o, a.Wo.weight), a.Wo.bias, x, norm.weight, norm.bias, norm.eps,
                             pre=True)
        m = gemm.linear(h, mlp.Wi.weight, None, "geglu")
        return gemm.add_norm(gemm.linear_partials(m, mlp.Wo.weight), mlp.Wo.bias, x, next_norm.weight, next_norm.bias,
                             next_norm.eps, pre=True)


class ModernBertPredictionHead(nn.Module):
    """transformers' `ModernBertPredictionHead`: dense (bias: `classifier_bias`), activation, norm."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.dense = nn.Linear(h, h, bias=cfg.get("classifier_bias", False))
        self.act = get_activation(cfg.get("classifier_activation", "gelu"))
        self.norm = _norm(cfg)

    def forward(self, x):
        return self.norm(self.act(self.dense(x)))


ROTARY = re.compile(r"(^|\.)rotary_emb\.")


class ModernBertModel(SmallStepKernels, Family):
    strip_prefixes = ("model.",)
    ignored = re.compile(r"^(head|decoder|classifier)\.|(^|\.)rotary_emb\.")
    classifier_architectures = frozenset({"ModernBertForSequenceClassification"})

    @classmethod
    def classifier_pooling(cls, config: dict) -> str:
        """transformers' `classifier_pooling`: "cls" or "mean" (over all of a sequence's tokens)."""
        mode = config.get("classifier_pooling", "cls")
        if mode not in ("cls", "mean"):
            raise ValueError(f"unsupported classifier_pooling {mode!r} for modernbert (supported: cls, mean)")
        return mode

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """config.json's `classifier_pooling` ("cls" or "mean") without a Pooling module; gte-modernbert-base
        pools CLS, modernbert-embed-base mean (their Pooling modules say so)."""
        return config.get("classifier_pooling", "cls")

    @classmethod
    def sliding_window(cls, config: dict) -> int:
        """Keys at distance < local_attention // 2 + 1 (|i - j| <= 64 for 128), as transformers' mask."""
        return int(config.get("local_attention", 128)) // 2 + 1

    def __init__(self, cfg: dict):
        super().__init__()
        self.window = self.sliding_window(cfg)
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.final_norm = _norm(cfg)
        d, n, thetas = cfg["hidden_size"] // cfg["num_attention_heads"], cfg.get("max_position_embeddings", 8192), rope_thetas(cfg)
        self.rotary_global = Rotary(d, n, thetas[GLOBAL])
        self.rotary_local = Rotary(d, n, thetas[LOCAL])
        if n_labels := self.num_labels(cfg):
            self.classifier_pooling(cfg)  # refuse an unknown mode at build time
            self.head = ModernBertPredictionHead(cfg)
            self.classifier = nn.Linear(cfg["hidden_size"], n_labels)
            self.ignored = ROTARY  # head and classifier are the cross-encoder's: loaded, not skipped

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled))

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    @property
    def ffn_fits(self) -> bool:
        """The small step's GeGLU epilogue: the exact GELU, no MLP bias (gte-modernbert-base's)."""
        mlp = self.layers[0].mlp
        return mlp.Wi.bias is None and mlp.act is F.gelu

    def materialize(self, device: torch.device) -> None:
        self.rotary_global.materialize(device)
        self.rotary_local.materialize(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids)  # no token types: a pair's second segment is not marked
        if x.shape[0] <= self.kernel_tokens:  # host-side: x's rows are the graph's token bucket
            return self.small_forward(x, positions, meta, attn, rows)
        full = (self.rotary_global.lookup(positions, x.dtype), meta)
        local = (self.rotary_local.lookup(positions, x.dtype), meta.with_window(self.window))
        for layer, r in zip(self.layers, last_only(self.layers, rows)):
            cos_sin, m = local if layer.local else full
            x = layer(x, cos_sin, m, attn, r)
        return self.final_norm(x)

    def small_forward(self, x, positions, meta, attn, rows=None) -> torch.Tensor:
        tables = {False: (self.rotary_global.cos_sin, meta),
                  True: (self.rotary_local.cos_sin, meta.with_window(self.window))}
        h = x  # layer 0 has no attention norm
        for i, (layer, r) in enumerate(zip(self.layers, last_only(self.layers, rows))):
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            table, m = tables[layer.local]
            x, h = layer.small_step(x, h, positions, table, m, attn, nxt, r)
        return h
