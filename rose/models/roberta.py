"""RoBERTa (RobertaModel: sentence-transformers/all-distilroberta-v1, all-roberta-large-v1) and
CamemBERT (CamembertModel): XLM-RoBERTa's architecture, BERT with positions numbered from
pad_token_id + 1, under their own model types; as cross-encoders `RobertaForSequenceClassification`
(cross-encoder/stsb-roberta-base, SamLowe/roberta-base-go_emotions) and
`CamembertForSequenceClassification`, with XLM-RoBERTa's classification head (`dense`, tanh,
`out_proj` on <s>). Their byte-level BPE (RoBERTa) and SentencePiece (CamemBERT) tokenizers are
Ivy's to run (`tokenizers`)."""

from __future__ import annotations

from rose.models.xlm_roberta import XLMRobertaModel


class RobertaModel(XLMRobertaModel):
    classifier_architectures = frozenset({"RobertaForSequenceClassification"})


class CamembertModel(XLMRobertaModel):
    classifier_architectures = frozenset({"CamembertForSequenceClassification"})
