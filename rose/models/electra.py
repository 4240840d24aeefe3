"""ELECTRA (ElectraModel's discriminator, as in cross-encoder/ms-marco-electra-base): BERT's layers
and names under `electra.`, with embeddings `embedding_size` wide and, where that differs from the
hidden size (ELECTRA-small), `embeddings_project` to it. As a cross-encoder
(`ElectraForSequenceClassification`) its head is `classifier.dense`, GELU (not BERT's tanh), then
`classifier.out_proj`, on the first token; there is no pooler. The pre-training heads
(`discriminator_predictions`, the generator's) are not loaded."""

from __future__ import annotations

import re

import torch
from torch import nn

from rose.layers.scores import ClassificationHead
from rose.models.bert import BertEmbeddings, BertModel


class ElectraModel(BertModel):
    strip_prefixes = ("electra.",)
    ignored = re.compile(r"(^|\.)position_ids$|^(discriminator_predictions|generator_predictions|generator_lm_head)\.")
    classifier_architectures = frozenset({"ElectraForSequenceClassification"})

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        e = int(cfg.get("embedding_size") or cfg["hidden_size"])
        if e != cfg["hidden_size"]:
            self.embeddings = BertEmbeddings({**cfg, "hidden_size": e})
            self.embeddings_project = nn.Linear(e, cfg["hidden_size"])

    def add_classifier(self, cfg: dict, n: int) -> None:
        self.classifier = ClassificationHead(cfg, n, torch.nn.functional.gelu)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(first)

    def embed(self, input_ids, positions, token_type_ids, small: bool) -> torch.Tensor:
        x = super().embed(input_ids, positions, token_type_ids, small)
        project = getattr(self, "embeddings_project", None)
        return x if project is None else project(x)
