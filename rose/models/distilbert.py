"""DistilBERT (DistilBertModel, as in sentence-transformers' msmarco-distilbert-* models) over a
ragged batch: BERT's post-norm layers under other names, no token types, no pooler.

Hugging Face parameter names (`transformer.layer.N.attention.q_lin` ..., `sa_layer_norm`,
`ffn.lin1/lin2`, `output_layer_norm`); q/k/v are stacked into one `qkv` GEMM. config.json uses
DistilBERT's own keys (`dim`, `n_heads`, `n_layers`, `hidden_dim`: the FFN width, `activation`);
`standard_config` adds the usual names. `sinusoidal_pos_embds: true` needs nothing here: transformers
writes the sinusoidal table into `embeddings.position_embeddings.weight`, which is loaded as is.

As a classifier or cross-encoder (`DistilBertForSequenceClassification`: distilbert-base-uncased-finetuned-
sst-2-english) its head is `pre_classifier`, ReLU, `classifier` on the first token ([CLS]); DistilBERT
has no token types, so a pair's second segment is not marked.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rose.layers.activation import GELUS, get_activation
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.pooling import keep_rows
from rose.layers.small_step import SmallStepKernels, post_norm_block
from rose.models.base import Family, last_only


class DistilBertEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=1e-12)

    def forward(self, input_ids, positions):
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class DistilBertAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.qkv = nn.Linear(h, 3 * h)
        self.out_lin = nn.Linear(h, h)

    def forward(self, x, meta, attn):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        return self.out_lin(attn(q, k, v, meta).reshape(x.shape[0], -1))


class DistilBertFFN(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.lin1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.lin2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])
        self.act = get_activation(cfg.get("hidden_act", "gelu"))

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class DistilBertLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.attention = DistilBertAttention(cfg)
        self.sa_layer_norm = nn.LayerNorm(h, eps=1e-12)
        self.ffn = DistilBertFFN(cfg)
        self.output_layer_norm = nn.LayerNorm(h, eps=1e-12)

    def forward(self, x, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attention(x, meta, attn), x))

    def feed_forward(self, a, x):
        """Residual + LayerNorm, FFN, residual + LayerNorm: fused by `Engine(compile=True)`."""
        x = self.sa_layer_norm(a + x)
        return self.output_layer_norm(self.ffn(x) + x)

    def small_step(self, x, meta, attn, rows=None):
        """The same layer for small steps, in fewer kernels (`rose.layers.small_step`)."""
        a, f = self.attention, self.ffn
        return post_norm_block(x, meta, attn, a.num_heads, a.qkv, a.out_lin, self.sa_layer_norm, f.lin1, f.lin2,
                               self.output_layer_norm, rows=rows)


class DistilBertTransformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList(DistilBertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))


class DistilBertModel(SmallStepKernels, Family):
    strip_prefixes = ("distilbert.",)
    classifier_architectures = frozenset({"DistilBertForSequenceClassification"})
    ignored = re.compile(r"(^|\.)position_ids$|^(vocab_transform|vocab_layer_norm|vocab_projector)\.")
    stacked_params = {
        ".attention.q_lin.": (".attention.qkv.", 0),
        ".attention.k_lin.": (".attention.qkv.", 1),
        ".attention.v_lin.": (".attention.qkv.", 2),
    }

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        return {**config, "hidden_size": config["dim"], "num_attention_heads": config["n_heads"],
                "num_hidden_layers": config["n_layers"], "intermediate_size": config["hidden_dim"],
                "hidden_act": config.get("activation", "gelu")}

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Mean, as sentence-transformers' msmarco-distilbert models (a Pooling module says otherwise:
        msmarco-distilbert-base-tas-b's is CLS)."""
        return "mean"

    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = DistilBertEmbeddings(cfg)
        self.transformer = DistilBertTransformer(cfg)
        self.gelu = cfg.get("hidden_act", "gelu") in GELUS
        if n := self.num_labels(cfg):
            self.pre_classifier = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])
            self.classifier = nn.Linear(cfg["hidden_size"], n)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.pre_classifier(first)))

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.layer

    @property
    def ffn_fits(self) -> bool:
        return self.gelu

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`token_type_ids` is ignored: DistilBERT has no token type embeddings."""
        small = input_ids.shape[0] <= self.kernel_tokens  # host-side: the ids' rows are the graph's token bucket
        x = self.embeddings(input_ids, positions)
        for layer, r in zip(self.transformer.layer, last_only(self.transformer.layer, rows)):
            x = layer.small_step(x, meta, attn, r) if small else layer(x, meta, attn, r)
        return x
