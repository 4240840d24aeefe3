"""Activation functions by their Hugging Face `hidden_act` names."""

from __future__ import annotations

import functools

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
