"""What CLIP's and SigLIP's towers share (`rose.models.clip`, `rose.models.siglip`), under Hugging Face's names:
the pre-LN encoder block both towers of both families stack, the text embeddings, a ViT's patch embedding
(with CLIP's class token or without, SigLIP's), SigLIP's attention-pooling head, quick GELU.

Token states are flat [T, hidden] as everywhere in ROSE; an image batch is N images of `tokens` rows each, one
after the other, attended within each image by the engine's attention backends (`image_meta`: every
sequence the same length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.activation import ACTIVATIONS
from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.pooling import keep_rows


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's `quick_gelu` (x * sigmoid(1.702 x)), as transformers computes it."""
    return x * torch.sigmoid(1.702 * x)


def activation(name: str):
    if name == "quick_gelu":
        return quick_gelu
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r} (supported: quick_gelu, {', '.join(sorted(ACTIVATIONS))})") \
            from None


# Checkpoint q/k/v projections of every block -> the one `qkv` GEMM (`Family.stacked_params`).
STACKED_QKV = {".self_attn.q_proj.": (".self_attn.qkv.", 0), ".self_attn.k_proj.": (".self_attn.qkv.", 1),
               ".self_attn.v_proj.": (".self_attn.qkv.", 2)}


class SelfAttention(nn.Module):
    """q/k/v (stacked) and `out_proj` (applied by the block, after the rows it keeps)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = h // self.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return attn(q, k, v, meta).reshape(x.shape[0], -1)


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.act = activation(cfg.get("hidden_act", "quick_gelu"))
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PreNormBlock(nn.Module):
    """CLIPEncoderLayer / SiglipEncoderLayer: x + attn(LN1(x)), then x + MLP(LN2(x))."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5)
        self.self_attn = SelfAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(cfg)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps)

    def forward(self, x, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.self_attn(self.layer_norm1(x), meta, attn), x))

    def feed_forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Everything after attention (`Engine(compile=True)` fuses it)."""
        x = x + self.self_attn.out_proj(a)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    """`encoder.layers.N`; `rows` (`Family.forward`'s): the last block computes those rows alone after attention."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = nn.ModuleList(PreNormBlock(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x, meta, attn, rows=None):
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, attn, rows if i == last else None)
        return x


class TextEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.token_embedding = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.position_embedding = nn.Embedding(cfg["max_position_embeddings"], cfg["hidden_size"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class PatchEmbeddings(nn.Module):
    """pixels [N, C, S, S] -> [N * tokens, hidden]: the patches' convolution (a GEMM over each patch), CLIP's
    class token first where it has one (`class_embedding`), plus the position table."""

    def __init__(self, cfg: dict, class_token: bool, patch_bias: bool):
        super().__init__()
        h, p, s = cfg["hidden_size"], cfg["patch_size"], cfg["image_size"]
        self.patch_embedding = nn.Conv2d(cfg.get("num_channels", 3), h, kernel_size=p, stride=p, bias=patch_bias)
        if class_token:
            self.class_embedding = nn.Parameter(torch.empty(h))
        self.class_token = class_token
        self.tokens = (s // p) ** 2 + class_token
        self.position_embedding = nn.Embedding(self.tokens, h)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        n = pixels.shape[0]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, patches, hidden]
        if self.class_token:
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)
        return (x + self.position_embedding.weight).reshape(n * self.tokens, -1)


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention's parameters under its names (stacked `in_proj_*`, `out_proj`), for
    SigLIP's pooling head: one query (the probe) per image, computed with SDPA on the dense [N, L] batch."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, query: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """query [1, hidden], x [N, L, hidden] -> [N, hidden]."""
        n, length, h = x.shape
        w, b, heads = self.in_proj_weight, self.in_proj_bias, self.num_heads
        q = F.linear(query, w[:h], b[:h]).view(1, heads, 1, h // heads).expand(n, -1, -1, -1)
        kv = F.linear(x, w[h:], b[h:]).view(n, length, 2, heads, h // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1])  # [N, heads, 1, d]
        return self.out_proj(o.reshape(n, h))


class AttentionPoolingHead(nn.Module):
    """SiglipMultiheadAttentionPoolingHead: the probe attends over an image's tokens, then + MLP(LN(.))."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.probe = nn.Parameter(torch.empty(1, 1, h))
        self.attention = MultiheadAttention(h, cfg["num_attention_heads"])
        self.layernorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-6))
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, hidden] -> [N, hidden]."""
        x = self.attention(self.probe[0], x)
        return x + self.mlp(self.layernorm(x))


def image_meta(cu_seqlens: torch.Tensor, tokens: int, images: int, graph: bool) -> AttentionMetadata:
    """Attention metadata of `images` images of `tokens` rows each (bidirectional; no lengths on the host in a
    graph, where capturable backends read none)."""
    return AttentionMetadata(cu_seqlens, tokens, None if graph else (tokens,) * images, causal=False)


# config.json keys the rest of the stack reads at the top level (`Family.standard_config`): the text tower's.
TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id")


def two_towers(config: dict, text_defaults: dict, vision_defaults: dict) -> dict:
    """config.json of a two-tower model with each tower's config completed by transformers' defaults (published
    configs leave defaults out: SigLIP's name little more than the model types) and the text tower's sizes copied
    to the top level, where the engine and the rest of the stack read `hidden_size`, `vocab_size`, ..."""
    text = {**text_defaults, **{k: v for k, v in (config.get("text_config") or {}).items() if v is not None}}
    vision = {**vision_defaults, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
    for name, tower in (("text", text), ("vision", vision)):
        if tower["hidden_size"] % tower["num_attention_heads"]:
            raise ValueError(f"{name}_config: hidden_size {tower['hidden_size']} is not a multiple of "
                             f"num_attention_heads {tower['num_attention_heads']}")
    if vision["image_size"] % vision["patch_size"]:
        raise ValueError(f"vision_config: image_size {vision['image_size']} is not a multiple of patch_size "
                         f"{vision['patch_size']}")
    return {**config, "text_config": text, "vision_config": vision, **{k: text[k] for k in TEXT_KEYS if k in text}}


def head_shape(tower: dict) -> tuple[int, int, int]:
    h = tower["num_attention_heads"]
    return h, h, tower["hidden_size"] // h
