"""XLM-RoBERTa (XLMRobertaModel, as in BGE-M3): BERT with positions numbered from
pad_token_id + 1 and one token type. Everything else is `BertModel`; as a cross-encoder
(`XLMRobertaForSequenceClassification`, e.g. bge-reranker-v2-m3) its head is
`XLMRobertaClassificationHead` (`rose.layers.scores.ClassificationHead`) instead of BERT's pooler + classifier."""

from __future__ import annotations

import torch

from rose.layers.scores import ClassificationHead
from rose.models.bert import BertModel


class XLMRobertaModel(BertModel):
    strip_prefixes = ("roberta.", "model.")
    classifier_architectures = frozenset({"XLMRobertaForSequenceClassification"})

    @classmethod
    def position_offset(cls, config: dict) -> int:
        """Hugging Face numbers unpadded positions from padding_idx + 1."""
        return int(config.get("pad_token_id", 1)) + 1

    def add_classifier(self, cfg: dict, n: int) -> None:
        """XLMRobertaForSequenceClassification's head (it has no pooler: `pooler.` stays ignored)."""
        self.classifier = ClassificationHead(cfg, n)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(first)
