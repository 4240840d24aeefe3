"""NomicBERT (nomic-embed-text-v1 / v1.5) over a ragged batch: BERT's post-norm layers with rotary
positions instead of learned ones, a fused q/k/v projection, a SwiGLU MLP and no biases.

Parameter names are the published checkpoint's (`embeddings.word_embeddings`, `emb_ln`,
`encoder.layers.N.attn.Wqkv` / `attn.out_proj`, `mlp.fc11` (up), `mlp.fc12` (gate: the SiLU is
applied to it), `mlp.fc2`, `norm1`, `norm2`), which transformers' own NomicBertModel also writes
and reads; fc12 and fc11 are stacked into one `mlp.gate_up` GEMM (gate rows first). Steps of up to
`kernel_tokens` take BERT's small step (`rose.layers.small_step`: q/k rotated in one kernel, the
SwiGLU in the gate/up GEMM's epilogue). config.json is the published remote-code one (GPT-2 style `n_embd`, `n_head`, `n_layer`,
`n_inner`, `n_positions`, `rotary_emb_base`, ...) or transformers' (`hidden_size`, ...,
`rope_parameters`); `standard_config` reads either. Supported as published: full rotary fraction,
non-interleaved ("rotate half"), no rotary scaling, post-norm; other settings are a clear error.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.rotary import Rotary, apply_rotary, rope_theta
from rose.layers.pooling import keep_rows
from rose.layers.small_step import SmallStepKernels, post_norm_block
from rose.models.base import Family, last_only

_GPT2_KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
              "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
              "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta"}


class NomicBertEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), cfg["hidden_size"])


class NomicBertAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.Wqkv = nn.Linear(h, 3 * h, bias=cfg.get("qkv_proj_bias", False))
        self.out_proj = nn.Linear(h, h, bias=cfg.get("qkv_proj_bias", False))

    def forward(self, x, cos_sin, meta, attn):
        q, k, v = self.Wqkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary(q, k, cos_sin)
        return self.out_proj(attn(q, k, v, meta).reshape(x.shape[0], -1))


class NomicBertMLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up = nn.Linear(h, 2 * f, bias=cfg.get("mlp_fc1_bias", False))  # [fc12 (gate); fc11 (up)]
        self.fc2 = nn.Linear(f, h, bias=cfg.get("mlp_fc2_bias", False))

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.fc2(up * F.silu(gate))


class NomicBertBlock(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.attn = NomicBertAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg["hidden_size"], eps=eps)
        self.mlp = NomicBertMLP(cfg)
        self.norm2 = nn.LayerNorm(cfg["hidden_size"], eps=eps)

    def forward(self, x, cos_sin, meta, attn, rows=None):
        return self.feed_forward(*keep_rows(rows, self.attn(x, cos_sin, meta, attn), x))

    def small_step(self, x, positions, table, meta, attn, rows=None):
        """The same block for small steps, in fewer kernels (`rose.layers.small_step`)."""
        a = self.attn
        return post_norm_block(x, meta, attn, a.num_heads, a.Wqkv, a.out_proj, self.norm1, self.mlp.gate_up,
                               self.mlp.fc2, self.norm2, act="swiglu", rope=(positions, table), rows=rows)

    def feed_forward(self, a, x):
        """Residual + norm, SwiGLU MLP, residual + norm: fused by `Engine(compile=True)`."""
        x = self.norm1(x + a)
        return self.norm2(x + self.mlp(x))


class NomicBertEncoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = nn.ModuleList(NomicBertBlock(cfg) for _ in range(cfg["num_hidden_layers"]))


class NomicBertModel(SmallStepKernels, Family):
    strip_prefixes = ("nomic_bert.",)
    ignored = re.compile(r"(^|\.)position_ids$|^pooler\.|^cls\.|(^|\.)inv_freq$")
    stacked_params = {".mlp.fc12.": (".mlp.gate_up.", 0), ".mlp.fc11.": (".mlp.gate_up.", 1)}

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        out = dict(config)
        for gpt2, hf in _GPT2_KEYS.items():
            if gpt2 in config and hf not in config:
                out[hf] = config[gpt2]
        out.setdefault("intermediate_size", 4 * out["hidden_size"])
        for key, ok in (("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False), ("rotary_scaling_factor", None),
                        ("prenorm", False), ("use_rms_norm", False), ("parallel_block", False)):
            if config.get(key, ok) != ok:
                raise ValueError(f"nomic_bert: {key}={config[key]!r} is not supported (supported: {ok!r})")
        if config.get("activation_function", "swiglu") != "swiglu" or config.get("hidden_act", "silu") != "silu":
            raise ValueError("nomic_bert: only the SwiGLU MLP (activation_function swiglu, hidden_act silu) is supported")
        return out

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Mean, as nomic-embed-text (its Pooling module says so)."""
        return "mean"

    @classmethod
    def max_positions(cls, config: dict) -> int:
        return int(config.get("max_position_embeddings", 2048))

    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = NomicBertEmbeddings(cfg)
        self.emb_ln = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))
        self.encoder = NomicBertEncoder(cfg)
        theta = rope_theta({"rope_theta": 1000.0, **cfg})  # NomicBERT's default base is 1000
        self.rotary = Rotary(cfg["hidden_size"] // cfg["num_attention_heads"], self.max_positions(cfg), theta)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layers

    @property
    def ffn_fits(self) -> bool:
        """The small step's SwiGLU epilogue has no bias (nomic-embed-text has none)."""
        return self.blocks[0].mlp.gate_up.bias is None

    def materialize(self, device: torch.device) -> None:
        self.rotary.materialize(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        e = self.embeddings
        x = self.emb_ln(e.word_embeddings(input_ids) + e.token_type_embeddings.weight[0])
        kept = last_only(self.encoder.layers, rows)
        if x.shape[0] <= self.kernel_tokens:  # host-side: x's rows are the graph's token bucket
            for layer, r in zip(self.encoder.layers, kept):
                x = layer.small_step(x, positions, self.rotary.cos_sin, meta, attn, r)
            return x
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, r in zip(self.encoder.layers, kept):
            x = layer(x, cos_sin, meta, attn, r)
        return x
