"""MPNet (MPNetModel, as in all-mpnet-base-v2) over a ragged batch: BERT's post-norm layers plus a
relative position bias, shared by every layer, added to the attention scores.

The bias is `encoder.relative_attention_bias` (buckets x heads) looked up by T5-style buckets (`rose.layers.relative`) of
j - i (key minus query position within a sequence); Hugging Face computes the buckets with 32
whatever `relative_attention_num_buckets` says, and so does this. FlashAttention's and FlashInfer's
kernels take no bias: the family declares `score_bias`, so the engine runs it on a backend that adds
one: on CUDA ROSE's Triton kernel (`triton`: the bias read beside each block of scores, captured in
CUDA graphs), or `padded` without Triton (every sequence padded to the step's length bucket, one SDPA
call with the bias and a key-padding mask); elsewhere `sdpa` per sequence.

Positions are numbered from padding_idx + 1 = 2, as XLM-RoBERTa's. Hugging Face parameter names;
q/k/v are stacked into one `qkv` GEMM.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.pooling import keep_rows
from rose.layers.relative import bucket_bias
from rose.layers.small_step import SmallStepKernels, post_norm_block
from rose.models.base import Family, last_only
from rose.models.bert import BertDenseLayerNorm, BertIntermediate

class MPNetSelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.qkv = nn.Linear(h, 3 * h)
        self.o = nn.Linear(h, h)

    def forward(self, x, meta, attn):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        return self.o(attn(q, k, v, meta).reshape(x.shape[0], -1))


class MPNetAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.attn = MPNetSelfAttention(cfg)
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))


class MPNetLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.attention = MPNetAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseLayerNorm(cfg["intermediate_size"], cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attention.attn(x, meta, attn), x))

    def feed_forward(self, a, x):
        """Residual + LayerNorm, FFN, residual + LayerNorm: fused by `Engine(compile=True)`."""
        x = self.attention.LayerNorm(a + x)
        return self.output(self.intermediate(x), x)

    def small_step(self, x, meta, attn, rows=None):
        """The same layer for small steps, in fewer kernels (`rose.layers.small_step`; attention with
        the position bias is the step's backend)."""
        sa = self.attention.attn
        return post_norm_block(x, meta, attn, sa.num_heads, sa.qkv, sa.o, self.attention.LayerNorm,
                               self.intermediate.dense, self.output.dense, self.output.LayerNorm, rows=rows)


class MPNetEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, input_ids, positions):
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class MPNetEncoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList(MPNetLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.relative_attention_bias = nn.Embedding(cfg.get("relative_attention_num_buckets", 32),
                                                    cfg["num_attention_heads"])

    def position_bias(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Hugging Face's MPNet buckets with 32 and 128 whatever config.json says (`bucket_bias`)."""
        return bucket_bias(self.relative_attention_bias, length, dtype)


class MPNetModel(SmallStepKernels, Family):
    strip_prefixes = ("mpnet.",)
    ignored = re.compile(r"(^|\.)position_ids$|^pooler\.|^lm_head\.")
    stacked_params = {
        ".attention.attn.q.": (".attention.attn.qkv.", 0),
        ".attention.attn.k.": (".attention.attn.qkv.", 1),
        ".attention.attn.v.": (".attention.attn.qkv.", 2),
    }
    score_bias = True

    @classmethod
    def position_offset(cls, config: dict) -> int:
        return 2  # Hugging Face's MPNetEmbeddings: padding_idx (1, fixed) + 1

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Mean, as all-mpnet-base-v2 (whose Pooling module says so, then Normalize)."""
        return "mean"

    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = MPNetEmbeddings(cfg)
        self.encoder = MPNetEncoder(cfg)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layer

    @property
    def ffn_fits(self) -> bool:
        return self.blocks[0].intermediate.gelu

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions + 2)
        meta = dataclasses.replace(meta, bias=self.encoder.position_bias(meta.max_seqlen, x.dtype))
        small = input_ids.shape[0] <= self.kernel_tokens  # host-side: the ids' rows are the graph's token bucket
        for layer, r in zip(self.encoder.layer, last_only(self.encoder.layer, rows)):
            x = layer.small_step(x, meta, attn, r) if small else layer(x, meta, attn, r)
        return x
