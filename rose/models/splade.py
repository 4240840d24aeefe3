"""SPLADE (a BertForMaskedLM checkpoint, as naver/splade-cocondenser-ensembledistil, or a
DistilBertForMaskedLM one, as naver/splade_v2_distil and opensearch-project's neural sparse encoders)
over a ragged batch: the encoder, then its masked-LM head over every token, then per sequence and
vocabulary id the max over tokens of log(1 + relu(logit)).

The output is that vocabulary-sized vector (`output_dim`: vocab_size, the Info's embedding_dim);
its nonzero entries are the sparse output (`vocab_output`: Tulip takes them from the rows, the
same `sparse` reply as BGE-M3's lexical weights, special tokens included as SPLADE scores them).
The [tokens, vocab] logits never leave the device: they are reduced there, in chunks of tokens, so
their memory stays bounded at any batch size.

BERT's head is Hugging Face's `cls.predictions`: `transform.dense`, the activation, `transform.LayerNorm`,
then the decoder tied to the word embeddings plus `cls.predictions.bias`; DistilBERT's is `vocab_transform`,
the activation, `vocab_layer_norm`, then `vocab_projector` tied to the word embeddings, with its bias.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.activation import get_activation
from rose.models.bert import BertModel
from rose.models.distilbert import DistilBertModel

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


def splade_pool(hidden, seq_ids, n: int, transform, weight, bias) -> torch.Tensor:
    """[T, H] -> float32 [n, vocab]: max over each sequence's tokens of log(1 + relu(MLM logits)), the
    logits `transform(hidden) @ weight.T + bias` made and reduced CHUNK_TOKENS tokens at a time."""
    out = torch.zeros(n + 1, bias.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], CHUNK_TOKENS):  # host-side: hidden's rows are the step's tokens
        w = torch.log1p(torch.relu(F.linear(transform(hidden[s:s + CHUNK_TOKENS]), weight, bias).float()))
        out.scatter_reduce_(0, seq_ids[s:s + CHUNK_TOKENS, None].expand_as(w), w, "amax")
    return out[:n]  # the last row took padding tokens (and any left out of pooling)


class _Splade:
    """What both SPLADE families say: SPLADE pooling, a vocabulary-wide output that is the sparse one,
    and a masked-LM decoder tied to the word embeddings."""

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "splade"

    @classmethod
    def output_dim(cls, config: dict) -> int:
        return int(config["vocab_size"])

    @classmethod
    def vocab_output(cls, config: dict) -> bool:
        return True

    @staticmethod
    def check_tied(cfg: dict) -> None:
        if cfg.get("tie_word_embeddings", True) is False:
            raise ValueError("SPLADE: a masked-LM head untied from the word embeddings is not supported")


class SpladeModel(_Splade, BertModel):
    # the decoder is tied to the word embeddings: its weight (and its copy of the bias) are not read
    ignored = re.compile(r"(^|\.)position_ids$|^pooler\.|^cls\.predictions\.decoder\.")

    def __init__(self, cfg: dict):
        self.check_tied(cfg)
        super().__init__(cfg)
        self.cls = BertOnlyMLMHead(cfg)

    def pool(self, hidden, cu_seqlens, seq_ids):
        head = self.cls.predictions
        return splade_pool(hidden, seq_ids, cu_seqlens.shape[0] - 1, head.transform,
                           self.embeddings.word_embeddings.weight, head.bias)


class DistilBertSpladeModel(_Splade, DistilBertModel):
    ignored = re.compile(r"(^|\.)position_ids$|^vocab_projector\.weight$")  # tied to the word embeddings

    def __init__(self, cfg: dict):
        self.check_tied(cfg)
        super().__init__(cfg)
        h = cfg["hidden_size"]
        self.vocab_transform = nn.Linear(h, h)
        self.vocab_act = get_activation(cfg.get("hidden_act", "gelu"))
        self.vocab_layer_norm = nn.LayerNorm(h, eps=1e-12)
        self.vocab_projector = nn.Module()
        self.vocab_projector.bias = nn.Parameter(torch.zeros(cfg["vocab_size"]))

    def pool(self, hidden, cu_seqlens, seq_ids):
        return splade_pool(hidden, seq_ids, cu_seqlens.shape[0] - 1,
                           lambda x: self.vocab_layer_norm(self.vocab_act(self.vocab_transform(x))),
                           self.embeddings.word_embeddings.weight, self.vocab_projector.bias)
