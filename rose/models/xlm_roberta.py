"""XLM-RoBERTa (XLMRobertaModel, as in BGE-M3): BERT with positions numbered from
pad_token_id + 1 and one token type. Everything else is `BertModel`; as a cross-encoder
(`XLMRobertaForSequenceClassification`, e.g. bge-reranker-v2-m3) its head is
`XLMRobertaClassificationHead` instead of BERT's pooler + classifier."""

from __future__ import annotations

import torch
from torch import nn

from rose.models.bert import BertModel


class XLMRobertaClassificationHead(nn.Module):
    """`dense`, tanh, then `out_proj` on each sequence's first token (<s>); dropout is inference's identity."""

    def __init__(self, cfg: dict, n: int):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])
        self.out_proj = nn.Linear(cfg["hidden_size"], n)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class XLMRobertaModel(BertModel):
    strip_prefixes = ("roberta.", "model.")
    classifier_architectures = frozenset({"XLMRobertaForSequenceClassification"})

    @classmethod
    def position_offset(cls, config: dict) -> int:
        """Hugging Face numbers unpadded positions from padding_idx + 1."""
        return int(config.get("pad_token_id", 1)) + 1

    def add_classifier(self, cfg: dict, n: int) -> None:
        """XLMRobertaForSequenceClassification's head (it has no pooler: `pooler.` stays ignored)."""
        self.classifier = XLMRobertaClassificationHead(cfg, n)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(first)
