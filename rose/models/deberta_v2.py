"""DeBERTa-v2 / v3 (DebertaV2Model: microsoft/deberta-v3-*, mixedbread-ai/mxbai-rerank-*-v1,
cross-encoder/nli-deberta-v3-*) over a ragged batch: BERT's post-norm layers under DeBERTa's names
(`attention.self.query_proj` ...) with disentangled attention. Each layer's scores are content to
content (q.k), plus content to position (q against the relative-position keys of bucket(i - j)) and
position to content (k against the relative-position queries of bucket(j - i)), each scaled by
1 / sqrt(d x 3) (`pos_att_type` p2c|c2p); the relative embeddings are `encoder.rel_embeddings` after
`encoder.LayerNorm` (`norm_rel_ebd: layer_norm`), projected by each layer's own query / key projections
(`share_att_key`) or by `pos_query_proj` / `pos_key_proj`; DeBERTa's log buckets (`position_buckets`,
`max_relative_positions`). v3 has no absolute positions (`position_biased_input: false`) and no token
types; v2's absolute positions, token types and narrower embeddings (`embed_proj`) are read where set.

The two position terms depend on each sequence's content, so they are a per-sequence score bias
([N, heads, L, L], `sequence_bias`): `padded` (one SDPA call over the batch padded to its length
bucket; capturable) on CUDA, `sdpa` per sequence elsewhere; q is pre-scaled by 1 / sqrt(3) so the
backend's d**-0.5 gives DeBERTa's scale. As a cross-encoder (`DebertaV2ForSequenceClassification`)
the head is `pooler.dense` and its activation (`pooler_hidden_act`, GELU) on the first token, then
`classifier`. The convolution of DeBERTa-v2-xlarge's first layer (`conv_kernel_size`) is refused."""

from __future__ import annotations

import dataclasses
import math
import re

import torch
from torch import nn

from rose.layers.activation import get_activation
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.pooling import keep_rows
from rose.models.base import Family, last_only
from rose.models.bert import BertDenseLayerNorm, BertIntermediate


def pos_att_types(config: dict) -> frozenset[str]:
    """`pos_att_type` as a set: a list (["p2c", "c2p"]) or v2's "p2c|c2p" string."""
    t = config.get("pos_att_type") or ()
    return frozenset(x.strip().lower() for x in (t.split("|") if isinstance(t, str) else t) if x.strip())


def log_span(buckets: int, max_position: int) -> float:
    """log((max_position - 1) / (buckets / 2)) in float32, as transformers takes it: computed once when the
    model is built, so that no host tensor is made inside a step (a CPU tensor cannot be copied to the device
    during CUDA graph capture)."""
    return torch.log(torch.tensor((max_position - 1) / (buckets // 2), device="cpu")).item()


def log_buckets(rel: torch.Tensor, buckets: int, span: float) -> torch.Tensor:
    """DeBERTa's relative positions i - j: exact within buckets / 2 either way, logarithmic beyond (to the
    max_position whose `log_span` is `span`), as transformers' make_log_bucket_position computes them."""
    sign = torch.sign(rel)
    mid = buckets // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), mid - 1, rel.abs())
    log_pos = torch.ceil(torch.log(abs_pos / mid) / span * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, rel.type_as(log_pos), log_pos * sign).long()


class DebertaV2Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        e = int(cfg.get("embedding_size") or h)
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], e)
        if cfg.get("position_biased_input", True):
            self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], e)
        if int(cfg.get("type_vocab_size", 0)) > 0:
            self.token_type_embeddings = nn.Embedding(cfg["type_vocab_size"], e)
        if e != h:
            self.embed_proj = nn.Linear(e, h, bias=False)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-7))

    def forward(self, input_ids, positions, token_type_ids=None):
        x = self.word_embeddings(input_ids)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(positions)
        if hasattr(self, "token_type_embeddings"):
            types = self.token_type_embeddings
            x = x + (types.weight[0] if token_type_ids is None else types(token_type_ids))
        if hasattr(self, "embed_proj"):
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, cfg: dict, types: frozenset[str], span: int):
        super().__init__()
        h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.query_proj = nn.Linear(h, h)
        self.key_proj = nn.Linear(h, h)
        self.value_proj = nn.Linear(h, h)
        self.types, self.span = types, span
        self.share = bool(cfg.get("share_att_key", False))
        if not self.share:
            if "c2p" in types:
                self.pos_key_proj = nn.Linear(h, h)
            if "p2c" in types:
                self.pos_query_proj = nn.Linear(h, h)
        self.factor = 1 + len(types & {"c2p", "p2c"})

    def bias(self, q, k, rel, index, meta) -> torch.Tensor | None:
        """The content-position and position-content scores, per sequence [N, heads, L, L], or None."""
        if rel is None or not self.types & {"c2p", "p2c"}:
            return None
        T, H, d = q.shape
        L, cu = meta.max_seqlen, meta.cu_seqlens
        start, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
        j = torch.arange(L, device=q.device)
        rows = torch.where(j[None, :] < lens[:, None], start[:, None] + j[None, :], T)  # [N, L]; T: padding
        rel = rel[: 2 * self.span]
        scale = 1.0 / math.sqrt(d * self.factor)
        out = 0
        if "c2p" in self.types:  # query i against the position keys of bucket(i - j)
            pk = (self.key_proj if self.share else self.pos_key_proj)(rel).view(-1, H, d)
            c = torch.einsum("thd,shd->ths", q, pk) * scale  # [T, H, 2S]
            c = torch.cat([c, c.new_zeros(1, *c.shape[1:])])[rows].permute(0, 2, 1, 3)  # [N, H, L, 2S]
            idx = (index[:L, :L] + self.span).clamp(0, 2 * self.span - 1)
            out = out + c.gather(-1, idx.expand(*c.shape[:2], L, L))
        if "p2c" in self.types:  # key j against the position queries of bucket(j - i)
            pq = (self.query_proj if self.share else self.pos_query_proj)(rel).view(-1, H, d)
            p = torch.einsum("thd,shd->ths", k, pq) * scale
            p = torch.cat([p, p.new_zeros(1, *p.shape[1:])])[rows].permute(0, 2, 1, 3)  # [N, H, L(key), 2S]
            idx = (self.span - index[:L, :L]).clamp(0, 2 * self.span - 1)
            out = out + p.gather(-1, idx.expand(*p.shape[:2], L, L)).transpose(-1, -2)
        return out.to(q.dtype)

    def forward(self, x, meta, attn, rel, index):
        T = x.shape[0]
        q, k, v = (p(x).view(T, self.heads, -1) for p in (self.query_proj, self.key_proj, self.value_proj))
        meta = dataclasses.replace(meta, bias=self.bias(q, k, rel, index, meta))
        return attn(q * (1.0 / math.sqrt(self.factor)), k, v, meta).reshape(T, -1)


class DebertaV2Attention(nn.Module):
    def __init__(self, cfg: dict, types: frozenset[str], span: int):
        super().__init__()
        self.self = DisentangledSelfAttention(cfg, types, span)
        self.output = BertDenseLayerNorm(cfg["hidden_size"], cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-7))


class DebertaV2Layer(nn.Module):
    def __init__(self, cfg: dict, types: frozenset[str], span: int):
        super().__init__()
        self.attention = DebertaV2Attention(cfg, types, span)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseLayerNorm(cfg["intermediate_size"], cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-7))

    def forward(self, x, meta, attn, rel, index, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attention.self(x, meta, attn, rel, index), x))

    def feed_forward(self, a, x):
        """Output projection + residual + LayerNorm, FFN, residual + LayerNorm: fused by `Engine(compile=True)`."""
        x = self.attention.output(a, x)
        return self.output(self.intermediate(x), x)


class DebertaV2Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.relative_attention = bool(cfg.get("relative_attention", False))
        types = pos_att_types(cfg) if self.relative_attention else frozenset()
        self.max_relative = int(cfg.get("max_relative_positions", -1))
        if self.max_relative < 1:
            self.max_relative = int(cfg["max_position_embeddings"])
        self.buckets = int(cfg.get("position_buckets", -1))
        span = self.buckets if self.buckets > 0 else self.max_relative
        self.log_span = log_span(self.buckets, self.max_relative) if self.buckets > 0 else 0.0
        self.layer = nn.ModuleList(DebertaV2Layer(cfg, types, span) for _ in range(cfg["num_hidden_layers"]))
        if self.relative_attention:
            self.rel_embeddings = nn.Embedding(2 * span, cfg["hidden_size"])
        norms = {x.strip() for x in str(cfg.get("norm_rel_ebd", "none")).lower().split("|")}
        if "layer_norm" in norms:
            self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-7))

    def relative(self, length: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The relative embeddings (normalised where `norm_rel_ebd` says) and the [L, L] relative
        positions bucket(i - j) of a step whose sequences are at most `length` long; None without
        relative attention."""
        if not self.relative_attention:
            return None, None
        rel = self.rel_embeddings.weight
        if hasattr(self, "LayerNorm"):
            rel = self.LayerNorm(rel)
        i = torch.arange(length, device=device)
        index = i[:, None] - i[None, :]
        if self.buckets > 0 and self.max_relative > 0:
            index = log_buckets(index, self.buckets, self.log_span)
        return rel, index


class DebertaV2Model(Family):
    strip_prefixes = ("deberta.",)
    ignored = re.compile(r"(^|\.)position_ids$|^lm_predictions\.|^mask_predictions\.")
    classifier_architectures = frozenset({"DebertaV2ForSequenceClassification"})
    sequence_bias = True

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "mean"

    def __init__(self, cfg: dict):
        super().__init__()
        if int(cfg.get("conv_kernel_size", 0)) > 0:
            raise ValueError("deberta-v2: the first layer's convolution (conv_kernel_size, DeBERTa-v2-xlarge) is "
                             "not supported")
        self.embeddings = DebertaV2Embeddings(cfg)
        self.encoder = DebertaV2Encoder(cfg)
        if n := self.num_labels(cfg):
            width = int(cfg.get("pooler_hidden_size") or cfg["hidden_size"])
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(width, width)
            self.pooler_act = get_activation(cfg.get("pooler_hidden_act", "gelu"))
            self.classifier = nn.Linear(width, n)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler_act(self.pooler.dense(first)))

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layer

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        rel, index = self.encoder.relative(meta.max_seqlen, x.device)
        for layer, r in zip(self.encoder.layer, last_only(self.encoder.layer, rows)):
            x = layer(x, meta, attn, rel, index, r)
        return x
