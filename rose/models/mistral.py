"""Mistral (MistralModel, as in intfloat/e5-mistral-7b-instruct): Llama with a sliding window on
every layer (`sliding_window`; null: none). A query sees the `sliding_window` keys up to itself,
as transformers' mask does; where the served length fits in the window it never binds."""

from __future__ import annotations

from rose.models.llama import LlamaModel


class MistralModel(LlamaModel):
    classifier_architectures = frozenset({"MistralForSequenceClassification"})

    @classmethod
    def layer_windows(cls, config: dict) -> tuple[int, ...]:
        return (int(config.get("sliding_window") or 0),) * config["num_hidden_layers"]
