"""Cross-encoder outputs: token types from per-sequence segment starts, and the activation on the
classification head's logits by sentence-transformers' `CrossEncoder` rules."""

from __future__ import annotations

import logging

import numpy as np
import torch

from trellis.modeldir import ModelSpec

log = logging.getLogger(__name__)


def token_types(positions: torch.Tensor, seq_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """int64 [T]: 1 from each sequence's second-segment start on, else 0 (BERT's pair template
    `[CLS] $A [SEP] $B:1 [SEP]:1`). `starts` int64 [N + 1], per sequence, 0 for one segment; the
    last entry (0) is the row of tokens that belong to no sequence (padding). On the device, graph-safe."""
    s = starts.index_select(0, seq_ids)
    return ((positions >= s) & (s > 0)).long()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


# torch.nn modules sentence-transformers saves by path (e.g. "torch.nn.modules.activation.Sigmoid"),
# as numpy functions on float32 [N, num_labels] (Softmax() without dim: over the labels, as torch's legacy rule)
ACTIVATIONS = {"Identity": lambda x: x, "Sigmoid": _sigmoid, "Tanh": np.tanh, "Softmax": _softmax}


def activation_name(spec: ModelSpec, num_labels: int) -> str:
    """The activation `CrossEncoder(path).predict` applies (sentence-transformers 6): the one saved in
    config_sentence_transformers.json (`activation_fn`), else config.json's `sentence_transformers`
    entry (or the older `sbert_ce_default_activation_function`), else Sigmoid for one label and
    Identity for more. A saved path outside `torch.` is not trusted (it would need
    trust_remote_code): the default applies, as there."""
    default = "Sigmoid" if num_labels == 1 else "Identity"
    cfg = spec.config
    saved = [spec.activation_fn] if spec.activation_fn else []
    st = cfg.get("sentence_transformers")
    if isinstance(st, dict) and "activation_fn" in st:
        saved.append(st["activation_fn"])
    elif cfg.get("sbert_ce_default_activation_function"):
        saved.append(cfg["sbert_ce_default_activation_function"])
    for path in saved[:2]:  # the second only where the first is not trusted (sentence-transformers' order)
        if not isinstance(path, str) or not path.startswith("torch."):
            log.warning("engine: activation %r is not a torch module; using %s (as sentence-transformers "
                        "without trust_remote_code)", path, default)
            continue
        name = path.rsplit(".", 1)[-1]
        if name not in ACTIVATIONS:
            raise ValueError(f"{spec.path}: cross-encoder activation {path!r} is not supported "
                             f"(supported: torch.nn {', '.join(ACTIVATIONS)})")
        return name
    return default
