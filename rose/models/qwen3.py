"""Qwen3 over a ragged batch: causal (Qwen3-Embedding, last-token pooling) or bidirectional
(mean pooling, selected by `is_causal: false` or `use_bidirectional_attention: true` in config.json;
pplx-embed-v1's published layout is its own model_type: `rose.models.pplx_qwen3`). Parameter names follow Hugging Face's Qwen3Model; q/k/v are stacked into one
`qkv_proj` GEMM and gate/up into `gate_up_proj`."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.norm import RMSNorm
from rose.layers.rotary import Rotary, apply_rotary, rope_theta
from rose.models.base import Family


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.h, self.hk, self.d = Family.head_shape(cfg)
        bias, eps = cfg.get("attention_bias", False), cfg.get("rms_norm_eps", 1e-6)
        self.qkv_proj = nn.Linear(cfg["hidden_size"], (self.h + 2 * self.hk) * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg["hidden_size"], bias=bias)
        self.q_norm = RMSNorm(self.d, eps)
        self.k_norm = RMSNorm(self.d, eps)

    def qkv(self, x: torch.Tensor, cos_sin: torch.Tensor):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q = self.q_norm(q.view(T, self.h, self.d))
        k = self.k_norm(k.view(T, self.hk, self.d))
        q, k = apply_rotary(q, k, cos_sin)
        return q, k, v.view(T, self.hk, self.d)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for qwen3 (silu)")
        self.gate_up_proj = nn.Linear(cfg["hidden_size"], 2 * cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    TRITON_OPS = frozenset({"out", "up", "down"})  # the small step's projections in Triton (q/k/v: cuBLAS)

    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, cos_sin, meta, attn):
        q, k, v = self.pre_attention(x, cos_sin)
        return self.feed_forward(attn(q, k, v, meta).reshape(x.shape[0], -1), x)

    def small_step(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, meta,
                   attn: AttentionBackend, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block for small steps, in fewer kernels: x is the residual stream and h its
        `input_layernorm`; returns the new stream and `next_norm` of it (the next block's input
        norm, or the model's final one), each residual add fused with the norm that follows it
        (`rose.kernels.gemm.add_norm`), q/k norm and rotary in one kernel (`rose.kernels.rope`), the
        output and down projections split-K in Triton, the SwiGLU inside the gate/up GEMM's epilogue
        (`TRITON_OPS`; measured on an H200, pplx-embed-1-0.6b step 1x128 in graphs: 1.285 ms with the
        gate/up in Triton, 1.459 with it in cuBLAS then silu * up)."""
        from rose.kernels import gemm
        from rose.kernels.rope import qk_norm_rope

        sa, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        T = x.shape[0]
        ops = gemm.triton_ops(self.TRITON_OPS)
        qkv = gemm.linear(h, sa.qkv_proj.weight, sa.qkv_proj.bias) if "qkv" in ops else sa.qkv_proj(h)
        q, k, v = qk_norm_rope(qkv, positions, table, sa.q_norm.weight, sa.k_norm.weight, sa.q_norm.eps,
                               sa.h, sa.hk, sa.d)
        a = attn(q, k, v, meta).reshape(T, -1)
        x, h = gemm.add_norm(gemm.linear_partials(a, sa.o_proj.weight), sa.o_proj.bias, x, post.weight, None,
                             post.eps, rms=True)
        if "up" in ops:
            m = gemm.linear(h, mlp.gate_up_proj.weight, None, "swiglu")
        else:
            gate, up = mlp.gate_up_proj(h).chunk(2, dim=-1)
            m = F.silu(gate) * up
        return gemm.add_norm(gemm.linear_partials(m, mlp.down_proj.weight), None, x, next_norm.weight, None,
                             next_norm.eps, rms=True)

    def pre_attention(self, x: torch.Tensor, cos_sin: torch.Tensor):
        """RMSNorm, q/k/v projection, q/k RMSNorm, rotary: fused by `Engine(compile=True)`."""
        return self.self_attn.qkv(self.input_layernorm(x), cos_sin)

    def feed_forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, RMSNorm, SwiGLU MLP, residual: fused by `Engine(compile=True)`."""
        x = x + self.self_attn.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(Family):
    strip_prefixes = ("model.",)
    ignored = re.compile(r"^lm_head\.|(^|\.)rotary_emb\.")
    stacked_params = {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
    }

    @classmethod
    def is_causal(cls, config: dict) -> bool:
        return not (config.get("is_causal") is False or config.get("use_bidirectional_attention", False))

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Last token for causal Qwen3 (Qwen3-Embedding), mean for bidirectional (pplx-embed-1)."""
        return "last" if cls.is_causal(config) else "mean"

    def __init__(self, cfg: dict):
        super().__init__()
        if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        self.causal = self.is_causal(cfg)
        h, hk, d = self.head_shape(cfg)
        self._rows = {"qkv_proj": (h * d, hk * d, hk * d),
                      "gate_up_proj": (cfg["intermediate_size"], cfg["intermediate_size"])}
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.rotary = Rotary(d, cfg.get("max_position_embeddings", 32768), rope_theta(cfg))

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def stacked_rows(self, name: str) -> tuple[int, ...]:
        """Row counts of the shards stacked into parameter `name` (unequal for GQA q/k/v)."""
        return self._rows[name.rsplit(".", 2)[-2]]

    def materialize(self, device: torch.device) -> None:
        self.rotary.materialize(device)

    # The small step's largest token bucket whatever is asked: measured on an H200 (pplx-embed-1-0.6b,
    # graphs), it beat torch's path at 1x128 (1.285 against 1.624 ms) and lost at 1x512 (2.76 against
    # 2.26); 256 is between the two, not measured.
    MAX_KERNEL_TOKENS = 256

    def use_kernels(self, max_tokens: int) -> int:
        """Run steps of up to `max_tokens` (at most MAX_KERNEL_TOKENS) tokens through
        `Qwen3DecoderLayer.small_step`; returns that largest token count."""
        self.kernel_tokens = min(max_tokens, self.MAX_KERNEL_TOKENS)
        return self.kernel_tokens

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if x.shape[0] <= self.kernel_tokens:  # host-side: x's rows are the graph's token bucket
            h = self.layers[0].input_layernorm(x)
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                x, h = layer.small_step(x, h, positions, self.rotary.cos_sin, meta, attn, nxt)
            return h
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, meta, attn)
        return self.norm(x)
