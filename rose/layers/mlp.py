"""The gated MLP of Llama-style decoders: down(act(gate(x)) * up(x)), gate and up stacked into one
`gate_up_proj` GEMM (SwiGLU with silu: Llama, Mistral, Qwen2, Qwen3; GeGLU with tanh GELU: Gemma3)."""

from __future__ import annotations

from torch import nn

from rose.layers.activation import get_activation

# Checkpoint sub-names -> (ours, shard): gate and up stacked along dim 0 (`Family.stacked_params`).
GATE_UP = {".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.act_name = act
        self.act = get_activation(act)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
