"""SPLADE (a BertForMaskedLM checkpoint, as naver/splade-cocondenser-ensembledistil) over a ragged
batch: BERT, then its masked-LM head over every token, then per sequence and vocabulary id the
max over tokens of log(1 + relu(logit)).

The output is that vocabulary-sized vector (`output_dim`: vocab_size, the Info's embedding_dim);
its nonzero entries are the sparse output (`vocab_output`: Tulip takes them from the rows, the
same `sparse` reply as BGE-M3's lexical weights, special tokens included as SPLADE scores them).
The [tokens, vocab] logits never leave the device: they are reduced there, in chunks of tokens, so
their memory stays bounded at any batch size.

The head is Hugging Face's `cls.predictions`: `transform.dense`, the activation, `transform.LayerNorm`,
then the decoder tied to the word embeddings plus `cls.predictions.bias`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.activation import get_activation
from rose.models.bert import BertModel

CHUNK_TOKENS = 2048  # logits are made and reduced this many tokens at a time ([2048, 30522] float32: 250 MB)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])
        self.act = get_activation(cfg.get("hidden_act", "gelu"))
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg["vocab_size"]))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg)


class SpladeModel(BertModel):
    # the decoder is tied to the word embeddings: its weight (and its copy of the bias) are not read
    ignored = re.compile(r"(^|\.)position_ids$|^pooler\.|^cls\.predictions\.decoder\.")

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "splade"

    @classmethod
    def output_dim(cls, config: dict) -> int:
        return int(config["vocab_size"])

    @classmethod
    def vocab_output(cls, config: dict) -> bool:
        return True

    def __init__(self, cfg: dict):
        if cfg.get("tie_word_embeddings", True) is False:
            raise ValueError("SPLADE: a masked-LM head untied from the word embeddings is not supported")
        super().__init__(cfg)
        self.cls = BertOnlyMLMHead(cfg)

    def pool(self, hidden, cu_seqlens, seq_ids):
        """[T, H] -> float32 [N, vocab]: max over each sequence's tokens of log(1 + relu(MLM logits))."""
        n = cu_seqlens.shape[0] - 1
        head = self.cls.predictions
        out = torch.zeros(n + 1, head.bias.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], CHUNK_TOKENS):  # host-side: hidden's rows are the step's tokens
            logits = F.linear(head.transform(hidden[s:s + CHUNK_TOKENS]), self.embeddings.word_embeddings.weight,
                              head.bias)
            w = torch.log1p(torch.relu(logits.float()))
            out.scatter_reduce_(0, seq_ids[s:s + CHUNK_TOKENS, None].expand_as(w), w, "amax")
        return out[:n]  # the last row took padding tokens (and any left out of pooling)
