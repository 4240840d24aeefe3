"""SigLIP and SigLIP 2 at a fixed resolution (SiglipModel: google/siglip-base-patch16-224, google/siglip2-*-patch16-224
and the other fixed-size SigLIP 2 checkpoints, which transformers loads as SiglipModel) over a ragged batch: the
text tower served by the text step, the vision tower by `Engine.step_images`.

Text: token + position embeddings, pre-LN blocks with bidirectional attention, `final_layer_norm`, the last
token's state (transformers takes position -1 of the padded batch: Ivy pads a text as the model was trained,
to `max_length`, where the model asks for it), `text_model.head`. Vision: patch convolution (with bias) and
position table, no class token, pre-LN blocks, `post_layernorm`, the attention-pooling head (a learned probe
attending over the image's tokens, then its MLP). Both vectors are L2-normalised by the engine (`serving`).
Hugging Face names; q/k/v stacked into one `qkv` GEMM; `logit_scale` / `logit_bias` are not loaded.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.vit import STACKED_QKV, AttentionPoolingHead, Encoder, PatchEmbeddings, TextEmbeddings, head_shape, \
    two_towers
from rose.models.base import Family
from trellis.modeldir import ModelSpec

# transformers' SiglipTextConfig / SiglipVisionConfig defaults (tests/test_models_clip.py checks them against it)
TEXT_DEFAULTS = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                 "layer_norm_eps": 1e-6, "pad_token_id": 1, "bos_token_id": 49406, "eos_token_id": 49407}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6, "vision_use_head": True}
# SiglipImageProcessor's defaults (IMAGENET_STANDARD_MEAN / _STD), where preprocessor_config.json is silent
SIGLIP_IMAGES = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}


class SiglipTextTransformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = Encoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.head = nn.Linear(cfg["hidden_size"], cfg.get("projection_size") or cfg["hidden_size"])

    def forward(self, input_ids, positions, meta, attn, rows=None):
        return self.final_layer_norm(self.encoder(self.embeddings(input_ids, positions), meta, attn, rows))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = PatchEmbeddings(cfg, class_token=False, patch_bias=True)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.head = AttentionPoolingHead(cfg)

    def forward(self, pixels: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """pixels [N, C, S, S] -> the pooled image states [N, hidden]."""
        x = self.post_layernorm(self.encoder(self.embeddings(pixels), meta, attn))
        return self.head(x.view(pixels.shape[0], self.embeddings.tokens, -1))


class SiglipModel(Family):
    ignored = re.compile(r"(^|\.)position_ids$|^logit_(scale|bias)$")
    stacked_params = STACKED_QKV
    image_processor = SIGLIP_IMAGES

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        cfg = two_towers(config, TEXT_DEFAULTS, VISION_DEFAULTS)
        if not cfg["vision_config"]["vision_use_head"]:
            raise ValueError("vision_config.vision_use_head is false: this SigLIP vision tower has no pooling head, "
                             "so it has no image features to serve")
        return cfg

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "last"

    @classmethod
    def output_dim(cls, config: dict) -> int:
        text = cls.standard_config(config)["text_config"]
        return int(text.get("projection_size") or text["hidden_size"])

    @classmethod
    def serving(cls, spec: ModelSpec) -> ModelSpec:
        spec = dataclasses.replace(super().serving(spec), normalize=True)
        text, image = cls.output_dim(spec.config), spec.config["vision_config"]["hidden_size"]
        if text != image:
            raise ValueError(f"the text head's width {text} differs from the vision tower's {image}: text and image "
                             "vectors would not share a space")
        return spec

    @classmethod
    def image_size(cls, config: dict) -> int:
        return int(cls.standard_config(config)["vision_config"]["image_size"])

    @classmethod
    def image_tokens(cls, config: dict) -> int:
        v = cls.standard_config(config)["vision_config"]
        return (v["image_size"] // v["patch_size"]) ** 2

    @classmethod
    def image_head_shape(cls, config: dict) -> tuple[int, int, int]:
        return head_shape(cls.standard_config(config)["vision_config"])

    def __init__(self, cfg: dict):
        super().__init__()
        cfg = self.standard_config(cfg)
        self.text_model = SiglipTextTransformer(cfg["text_config"])
        self.vision_model = SiglipVisionTransformer(cfg["vision_config"])

    @property
    def blocks(self) -> nn.ModuleList:
        return self.text_model.encoder.layers

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.text_model.head(pooled)

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.text_model(input_ids, positions, meta, attn, rows)

    def embed_images(self, pixels: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        return self.vision_model(pixels, meta, attn)
