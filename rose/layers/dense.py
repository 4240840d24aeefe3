"""sentence-transformers' Dense modules after pooling: activation(x W^T + b), one after another.

Weights come from each module's directory (`model.safetensors`, or `pytorch_model.bin` from older
releases: `linear.weight`, `linear.bias`), strictly: a missing, unexpected or misshapen tensor is an
error. The layers run inside the engine's forward, after pooling and before Normalize, so a CUDA
graph captures them with the rest.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

from trellis.modeldir import DenseSpec

# activation_function names sentence-transformers writes (torch's module paths) -> the function.
ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
    "torch.nn.modules.activation.SiLU": nn.SiLU,
}


def _state(spec: DenseSpec) -> dict[str, torch.Tensor]:
    st = spec.path / "model.safetensors"
    if st.is_file():
        return load_file(str(st))
    return torch.load(spec.path / "pytorch_model.bin", map_location="cpu", weights_only=True)


class Dense(nn.Module):
    def __init__(self, spec: DenseSpec, device):
        super().__init__()
        act = ACTIVATIONS.get(spec.activation)
        if act is None:
            raise ValueError(f"{spec.path}: activation_function {spec.activation!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias, device=device,
                                dtype=torch.float32)
        self.activation = act()
        sd = _state(spec)
        want = {"linear.weight": (spec.out_features, spec.in_features)}
        if spec.bias:
            want["linear.bias"] = (spec.out_features,)
        got = {k: tuple(v.shape) for k, v in sd.items()}
        if got != want:
            raise ValueError(f"{spec.path}: Dense weights {got} do not match its config {want}")
        self.linear.load_state_dict({k.removeprefix("linear."): v for k, v in sd.items()})
        self.requires_grad_(False).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x.float()))


class DenseStack(nn.Sequential):
    """The Dense modules of a `ModelSpec`, in order, in float32 whatever the model's dtype (a few
    rows per step: the pooled vectors, which pooling gives in float32)."""

    @classmethod
    def load(cls, specs: tuple[DenseSpec, ...], device) -> "DenseStack | None":
        return cls(*(Dense(s, device) for s in specs)) if specs else None
