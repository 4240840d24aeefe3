"""CLIP (CLIPModel: openai/clip-vit-base-patch32, -base-patch16, -large-patch14, LAION's conversions) over a
ragged batch: the text tower served by the text step, the vision tower by `Engine.step_images`.

Text: token + position embeddings, pre-LN blocks with causal attention, `final_layer_norm`, the state of each
sequence's end-of-text token (found as transformers finds it: `pool_rows`), `text_projection`. Vision: patch
convolution (no bias) after a class token, position table, `pre_layrnorm`, pre-LN blocks, the class token's
state through `post_layernorm`, `visual_projection`. Both towers' vectors are L2-normalised by the engine
(`serving`: cosine is what they are compared by; CLIPModel's own logits normalise both). Hugging Face names;
q/k/v stacked into one `qkv` GEMM; `logit_scale` is not loaded (nothing served reads it).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.vit import STACKED_QKV, Encoder, PatchEmbeddings, TextEmbeddings, head_shape, two_towers
from rose.models.base import Family
from trellis.modeldir import ModelSpec

# transformers' CLIPTextConfig / CLIPVisionConfig defaults (tests/test_models_clip.py checks them against it)
TEXT_DEFAULTS = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                 "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 49406, "eos_token_id": 49407}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                   "layer_norm_eps": 1e-5}
# CLIPImageProcessor's defaults (OpenAI's mean and std), where preprocessor_config.json is silent
OPENAI_CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
               "rescale_factor": 1 / 255}


def eos_rows(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Each sequence's pooled row, as CLIPTextModel picks it on a padded batch: where `eos_token_id` is 2 (the
    configs before transformers' PR #24773) the first position of the sequence's highest id (the end-of-text
    token is the vocabulary's last), else the first position of `eos_token_id`, or the sequence's first token
    where it has none (argmax of all False). On the device, no host read; padding tokens (seq_id == N) reduce
    into a row that is dropped; an empty dummy sequence's row is clamped into range."""
    t, n = input_ids.shape[0], cu_seqlens.shape[0] - 1
    if eos_token_id == 2:
        best = input_ids.new_full((n + 1,), -1).scatter_reduce_(0, seq_ids, input_ids, reduce="amax")
        hit = input_ids == best.index_select(0, seq_ids)
    else:
        hit = input_ids == eos_token_id
    at = torch.arange(t, device=input_ids.device)
    first = torch.full((n + 1,), t, dtype=torch.int64, device=input_ids.device)
    first.scatter_reduce_(0, seq_ids, torch.where(hit, at, t), reduce="amin")
    first = first[:n]
    return torch.where(first < t, first, cu_seqlens[:-1].long()).clamp_(max=max(t - 1, 0))


class CLIPTextTransformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = Encoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, input_ids, positions, meta, attn, rows=None):
        return self.final_layer_norm(self.encoder(self.embeddings(input_ids, positions), meta, attn, rows))


class CLIPVisionTransformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.embeddings = PatchEmbeddings(cfg, class_token=True, patch_bias=False)
        self.pre_layrnorm = nn.LayerNorm(h, eps=eps)  # (sic: transformers' name)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(h, eps=eps)

    def forward(self, pixels: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """pixels [N, C, S, S] -> the class tokens' states [N, hidden] (the last block computes those rows alone)."""
        tokens = self.embeddings.tokens
        cls_rows = torch.arange(pixels.shape[0], device=pixels.device) * tokens
        x = self.encoder(self.pre_layrnorm(self.embeddings(pixels)), meta, attn, cls_rows)
        return self.post_layernorm(x)


class CLIPModel(Family):
    ignored = re.compile(r"(^|\.)position_ids$|^logit_scale$")
    stacked_params = STACKED_QKV
    image_processor = OPENAI_CLIP

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        return two_towers(config, TEXT_DEFAULTS, VISION_DEFAULTS)

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "eos"  # `pool_rows`: the end-of-text token's state

    @classmethod
    def is_causal(cls, config: dict) -> bool:
        return True

    @classmethod
    def output_dim(cls, config: dict) -> int:
        return int(config.get("projection_dim", 512))

    @classmethod
    def serving(cls, spec: ModelSpec) -> ModelSpec:
        return dataclasses.replace(super().serving(spec), normalize=True)

    @classmethod
    def image_size(cls, config: dict) -> int:
        return int(cls.standard_config(config)["vision_config"]["image_size"])

    @classmethod
    def image_tokens(cls, config: dict) -> int:
        v = cls.standard_config(config)["vision_config"]
        return (v["image_size"] // v["patch_size"]) ** 2 + 1

    @classmethod
    def image_head_shape(cls, config: dict) -> tuple[int, int, int]:
        return head_shape(cls.standard_config(config)["vision_config"])

    def __init__(self, cfg: dict):
        super().__init__()
        cfg = self.standard_config(cfg)
        text, vision = cfg["text_config"], cfg["vision_config"]
        self.causal = True
        self.eos_token_id = int(text["eos_token_id"])
        dim = self.output_dim(cfg)
        self.text_model = CLIPTextTransformer(text)
        self.vision_model = CLIPVisionTransformer(vision)
        self.text_projection = nn.Linear(text["hidden_size"], dim, bias=False)
        self.visual_projection = nn.Linear(vision["hidden_size"], dim, bias=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.text_model.encoder.layers

    def pool_rows(self, input_ids, cu_seqlens, seq_ids) -> torch.Tensor:
        return eos_rows(input_ids, cu_seqlens, seq_ids, self.eos_token_id)

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.text_projection(pooled)

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.text_model(input_ids, positions, meta, attn, rows)

    def embed_images(self, pixels: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        return self.visual_projection(self.vision_model(pixels, meta, attn))
