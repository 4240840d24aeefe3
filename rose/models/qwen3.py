"""Qwen3 over a ragged batch: causal (Qwen3-Embedding, last-token pooling) or bidirectional
(mean pooling, selected by `is_causal: false` or `use_bidirectional_attention: true` in config.json;
pplx-embed-v1's published layout is its own model_type: `rose.models.pplx_qwen3`). Parameter names follow Hugging Face's Qwen3Model; the blocks are Llama's
(`rose.models.llama`: q/k/v stacked into one `qkv_proj` GEMM, gate/up into `gate_up_proj`) with
per-head q/k RMSNorm, plus a small-batch step in ROSE's kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rose.layers.attention import AttentionBackend, AttentionMetadata
from rose.layers.fp8 import Fp8Blocks, pre_norm_forward
from rose.layers.norm import RMSNorm
from rose.layers.pooling import keep_rows
from rose.layers.small_step import SmallStepKernels
from rose.models.base import last_only
from rose.models.llama import LlamaDecoderLayer, LlamaModel


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's block with per-head q/k RMSNorm; and its small-batch step."""

    TRITON_OPS = frozenset({"out", "up", "down"})  # the small step's projections in Triton (q/k/v: cuBLAS)

    def __init__(self, cfg: dict, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__(cfg, qkv_bias, o_bias, qk_norm=True)

    def small_step(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, meta,
                   attn: AttentionBackend, next_norm: RMSNorm,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block for small steps, in fewer kernels: x is the residual stream and h its
        `input_layernorm`; returns the new stream and `next_norm` of it (the next block's input
        norm, or the model's final one), each residual add fused with the norm that follows it
        (`rose.kernels.gemm.add_norm`), q/k norm and rotary in one kernel (`rose.kernels.rope`), the
        output and down projections split-K in Triton, the SwiGLU inside the gate/up GEMM's epilogue
        (`TRITON_OPS`; measured on an H200, pplx-embed-1-0.6b step 1x128 in graphs: 1.285 ms with the
        gate/up in Triton, 1.459 with it in cuBLAS then silu * up). After attention only `rows` are
        kept where given (`Family.forward`'s)."""
        from rose.kernels import gemm
        from rose.kernels.rope import qk_norm_rope

        sa, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        T = x.shape[0]
        ops = gemm.triton_ops(self.TRITON_OPS)
        qkv = gemm.linear(h, sa.qkv_proj.weight, sa.qkv_proj.bias) if "qkv" in ops else sa.qkv_proj(h)
        q, k, v = qk_norm_rope(qkv, positions, table, sa.q_norm.weight, sa.k_norm.weight, sa.q_norm.eps,
                               sa.h, sa.hk, sa.d)
        a, x = keep_rows(rows, attn(q, k, v, meta).reshape(T, -1), x)
        x, h = gemm.add_norm(gemm.linear_partials(a, sa.o_proj.weight), sa.o_proj.bias, x, post.weight, None,
                             post.eps, rms=True)
        if "up" in ops:
            m = gemm.linear(h, mlp.gate_up_proj.weight, None, "swiglu")
        else:
            gate, up = mlp.gate_up_proj(h).chunk(2, dim=-1)
            m = F.silu(gate) * up
        return gemm.add_norm(gemm.linear_partials(m, mlp.down_proj.weight), None, x, next_norm.weight, None,
                             next_norm.eps, rms=True)


class Qwen3Model(SmallStepKernels, Fp8Blocks, LlamaModel):
    layer = Qwen3DecoderLayer
    classifier_architectures = frozenset({"Qwen3ForSequenceClassification"})

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        """Last token for causal Qwen3 (Qwen3-Embedding), mean for bidirectional (pplx-embed-1)."""
        return "last" if cls.is_causal(config) else "mean"

    def __init__(self, cfg: dict):
        if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        super().__init__(cfg)

    # The small step's largest token bucket whatever is asked: measured on an H200 (pplx-embed-1-0.6b,
    # graphs), it beat torch's path at 1x128 (1.285 against 1.624 ms) and lost at 1x512 (2.76 against
    # 2.26); 256 is between the two, not measured.
    MAX_KERNEL_TOKENS = 256

    @property
    def ffn_fits(self) -> bool:
        """The small step's SwiGLU epilogue and split-K down projection have no biases (`mlp_bias`)."""
        return self.layers[0].mlp.gate_up_proj.bias is None

    def fp8_linears(self, layer: Qwen3DecoderLayer) -> dict[str, torch.nn.Linear]:
        sa, mlp = layer.self_attn, layer.mlp
        return {"qkv": sa.qkv_proj, "out": sa.o_proj, "up": mlp.gate_up_proj, "down": mlp.down_proj}

    def forward(self, input_ids, positions, meta: AttentionMetadata, attn: AttentionBackend,
                token_type_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[0] > self.kernel_tokens:  # host-side: the ids' rows are the graph's token bucket
            if 0 < self.fp8_tokens <= input_ids.shape[0]:  # --quantization fp8, a large step
                return pre_norm_forward(self, input_ids, positions, meta, attn, rows)
            return super().forward(input_ids, positions, meta, attn, rows=rows)
        x = self.embed_tokens(input_ids)
        h = self.layers[0].input_layernorm(x)
        for i, (layer, r) in enumerate(zip(self.layers, last_only(self.layers, rows))):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer.small_step(x, h, positions, self.rotary.cos_sin, meta, attn, nxt, r)
        return h
