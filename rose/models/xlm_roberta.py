"""XLM-RoBERTa (XLMRobertaModel, as in BGE-M3): BERT with positions numbered from
pad_token_id + 1 and one token type. Everything else is `BertModel`."""

from __future__ import annotations

from rose.models.bert import BertModel


class XLMRobertaModel(BertModel):
    strip_prefixes = ("roberta.", "model.")

    @classmethod
    def position_offset(cls, config: dict) -> int:
        """Hugging Face numbers unpadded positions from padding_idx + 1."""
        return int(config.get("pad_token_id", 1)) + 1
