"""Gemma3 text (Gemma3TextModel, as in google/embeddinggemma-300m) over a ragged batch.

Gemma's quirks, as transformers computes them: token embeddings scaled by sqrt(hidden_size) in the
compute dtype; RMSNorm by (1 + weight) in float32; four norms per block (around attention and around
the MLP); a GeGLU MLP (`hidden_activation`, gelu_pytorch_tanh); per-head q/k norm; scores scaled by
`query_pre_attn_scalar`**-0.5 (q is pre-scaled, so every backend's head_dim**-0.5 gives it);
sliding-window layers and full ones (`layer_types`, or every `sliding_window_pattern`-th layer full)
with rotary bases of their own (`rope_local_base_freq` / `rope_theta`, or `rope_parameters` per
layer type). `use_bidirectional_attention: true` (EmbeddingGemma) makes attention bidirectional and
the window symmetric: |i - j| <= sliding_window // 2, as transformers' mask. Attention logit
softcapping (Gemma 2's; Gemma3 checkpoints set it null) is refused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.mlp import GatedMLP
from rose.layers.pooling import keep_rows
from rose.layers.rotary import Rotary, rope_params
from rose.layers.small_step import SmallStepKernels
from rose.models.base import last_only
from rose.models.llama import LlamaAttention, LlamaModel


class Gemma3RMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32, then back to the input dtype. `scale`: that
    (1 + weight) in float32, for the small step's kernels (set by `materialize`, after loading)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None

    def materialize(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    # The small step's projections in Triton (`gemm.triton_ops`), as Qwen3's; only q/k/v's place is read
    # here (out, gate/up and down are always Triton's: the GeGLU and the split-K sums need them).
    TRITON_OPS = frozenset({"out", "up", "down"})

    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        self.self_attn = LlamaAttention(cfg, bias, bias, Gemma3RMSNorm)
        d = self.self_attn.d
        self.q_scale = (d ** 0.5) * float(cfg.get("query_pre_attn_scalar", d)) ** -0.5
        self.mlp = GatedMLP(h, cfg["intermediate_size"], cfg.get("hidden_activation") or "gelu_pytorch_tanh")
        self.input_layernorm = Gemma3RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(h, eps)

    def forward(self, x, cos_sin, meta, attn, rows=None):
        q, k, v = self.pre_attention(x, cos_sin)
        return self.feed_forward(*keep_rows(rows, attn(q, k, v, meta).reshape(x.shape[0], -1), x))

    def pre_attention(self, x: torch.Tensor, cos_sin: torch.Tensor):
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos_sin)
        return (q * self.q_scale if self.q_scale != 1.0 else q), k, v

    def feed_forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(a))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def small_step(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, meta,
                   attn: AttentionBackend, next_norm: Gemma3RMSNorm,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block for small steps, in ROSE's kernels (as Qwen3's): x is the residual stream
        and h its `input_layernorm`; returns the new stream and `next_norm` of it. Each projection's
        own norm, the residual add and the next norm are one kernel (`gemm.add_norm`'s `post`),
        q/k norm and rotary one kernel, the GeGLU (tanh) inside the gate/up GEMM's epilogue."""
        from rose.kernels import gemm
        from rose.kernels.rope import qk_norm_rope

        sa, mlp = self.self_attn, self.mlp
        T = x.shape[0]
        qkv = gemm.linear(h, sa.qkv_proj.weight, sa.qkv_proj.bias) if "qkv" in gemm.triton_ops(self.TRITON_OPS) \
            else sa.qkv_proj(h)
        q, k, v = qk_norm_rope(qkv, positions, table, sa.q_norm.scale, sa.k_norm.scale, sa.q_norm.eps, sa.h, sa.hk,
                               sa.d)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        a, x = keep_rows(rows, attn(q, k, v, meta).reshape(T, -1), x)
        pre, post = self.pre_feedforward_layernorm, self.post_attention_layernorm
        x, h = gemm.add_norm(gemm.linear_partials(a, sa.o_proj.weight), sa.o_proj.bias, x, pre.scale, None, pre.eps,
                             rms=True, post=post.scale)
        m = gemm.linear(h, mlp.gate_up_proj.weight, None, "geglu_tanh")
        return gemm.add_norm(gemm.linear_partials(m, mlp.down_proj.weight), None, x, next_norm.scale, None,
                             next_norm.eps, rms=True, post=self.post_feedforward_layernorm.scale)


def layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    pattern = int(config.get("sliding_window_pattern") or 6)
    return list(config.get("layer_types") or
                ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])


class Gemma3TextModel(SmallStepKernels, LlamaModel):
    layer = Gemma3DecoderLayer
    classifier_architectures = frozenset()  # an embedding model only
    norm_class = Gemma3RMSNorm
    bidirectional_windows = True

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Mean for bidirectional Gemma3 (EmbeddingGemma), last token for causal."""
        return "last" if cls.is_causal(config) else "mean"

    @classmethod
    def layer_windows(cls, config: dict) -> tuple[int, ...]:
        w = int(config.get("sliding_window") or 0)
        if w and not cls.is_causal(config):
            w = w // 2 + 1  # transformers: |i - j| < sliding_window // 2 + 1
        return tuple(w if t == "sliding_attention" else 0 for t in layer_types(config))

    @classmethod
    def layer_kwargs(cls, config: dict) -> dict:
        return {}

    @classmethod
    def rope(cls, config: dict, layer_type: str) -> dict:
        """The rotary parameters of one layer type: `rope_parameters[layer_type]` (newer configs) or
        rope_theta and rope_scaling (full layers) / rope_local_base_freq (sliding ones)."""
        nested = config.get("rope_parameters") or {}
        if isinstance(nested.get(layer_type), dict):
            return rope_params({"rope_parameters": nested[layer_type]}, f"rope_parameters.{layer_type}")
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": float(config.get("rope_local_base_freq") or 10000.0)}
        return rope_params({**config, "rope_theta": config.get("rope_theta") or 1_000_000.0})

    def __init__(self, cfg: dict):
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(f"attn_logit_softcapping {cfg['attn_logit_softcapping']} is not supported "
                             "(Gemma3 checkpoints set it null)")
        self.types = layer_types(cfg)
        super().__init__(cfg)
        self.embed_scale = cfg["hidden_size"] ** 0.5

    def make_rotary(self, cfg: dict, head_dim: int) -> nn.Module:
        """One table per layer type (their bases differ)."""
        n = cfg.get("max_position_embeddings", 131072)
        return nn.ModuleDict({t: Rotary.from_params(head_dim, n, self.rope(cfg, t)) for t in sorted(set(self.types))})

    def materialize(self, device: torch.device) -> None:
        for r in self.rotary.values():
            r.materialize(device)
        for m in self.modules():
            if isinstance(m, Gemma3RMSNorm):
                m.materialize()

    @property
    def ffn_fits(self) -> bool:
        """The small step's GeGLU epilogue is the tanh GELU's, without biases."""
        mlp = self.layers[0].mlp
        return mlp.act_name in ("gelu_pytorch_tanh", "gelu_new") and mlp.gate_up_proj.bias is None

    MAX_KERNEL_TOKENS = 512

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the compute dtype first, as transformers does (27.75 for 768 in bfloat16)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        kept = last_only(self.layers, rows)
        if input_ids.shape[0] <= self.kernel_tokens:  # host-side: the ids' rows are the graph's token bucket
            h = self.layers[0].input_layernorm(x)
            for i, (layer, t, w, r) in enumerate(zip(self.layers, self.types, self.windows, kept)):
                nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                x, h = layer.small_step(x, h, positions, self.rotary[t].cos_sin, meta.with_window(w), attn, nxt, r)
            return h
        cos_sin = {t: rot.lookup(positions, x.dtype) for t, rot in self.rotary.items()}
        for layer, t, w, r in zip(self.layers, self.types, self.windows, kept):
            x = layer(x, cos_sin[t], meta.with_window(w), attn, r)
        return self.norm(x)
