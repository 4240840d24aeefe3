"""Activation functions by their Hugging Face `hidden_act` names."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden_act {name!r} (supported: {sorted(ACTIVATIONS)})") from None


GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


@torch.library.custom_op("rose::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x @ weight.T + bias) as one GEMM: cuBLASLt adds the bias and applies GELU in its epilogue,
    on the float32 accumulator, instead of a second pass over the [tokens, intermediate] activations
    (H200, bge-m3 up projection, `benchmarks.gemm`: 5.8 us against 7.1 at 128 tokens, 60 against 77 at 4096). On CUDA the
    GELU is the tanh approximation; for `hidden_act: gelu` (erf) models the tanh form alone moves
    all-MiniLM-L6-v2's embeddings by 1 - cos < 4e-6 (measured in float32 on CPU, where the
    difference is not hidden under bfloat16's rounding). Opaque to torch.compile, which would split it again."""
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


@linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))
