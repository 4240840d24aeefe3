"""Qwen2 (Qwen2Model, as in Alibaba-NLP/gte-Qwen2-1.5B-instruct / 7B-instruct): Llama with biases
on q/k/v (none on o_proj). gte-Qwen2's config.json says `is_causal: false`: bidirectional attention,
last-token pooling. Sliding windows only with `use_sliding_window: true`, on the layers
`layer_types` (or `max_window_layers`) marks, as transformers does."""

from __future__ import annotations

from rose.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    classifier_architectures = frozenset({"Qwen2ForSequenceClassification"})

    @classmethod
    def layer_kwargs(cls, config: dict) -> dict:
        return {"qkv_bias": True, "o_bias": False}

    @classmethod
    def layer_windows(cls, config: dict) -> tuple[int, ...]:
        n = config["num_hidden_layers"]
        if not (config.get("use_sliding_window") and config.get("sliding_window")):
            return (0,) * n
        types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention" for i in range(n)]
        return tuple(int(config["sliding_window"]) if t == "sliding_attention" else 0 for t in types)
