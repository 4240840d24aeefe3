"""pplx-embed-v1 (perplexity-ai/pplx-embed-v1-0.6b / -4b) as published: config.json says
`model_type: "bidirectional_pplx_qwen3"`, `architectures: ["PPLXQwen3Model"]` (the repo's remote
code: transformers' Qwen3Model with every layer's attention made bidirectional). The weights are
Qwen3's, under Qwen3's names; the one rule of its own is that attention is always bidirectional,
whatever the config's flags say, so pooling defaults to mean."""

from __future__ import annotations

from rose.models.qwen3 import Qwen3Model


class PPLXQwen3Model(Qwen3Model):
    @classmethod
    def is_causal(cls, config: dict) -> bool:
        return False
