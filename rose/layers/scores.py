"""Cross-encoder outputs: token types from per-sequence segment starts, the score of a causal LM read
through sentence-transformers' LogitScore, and the activation on the classification head's logits by
its `CrossEncoder` rules."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

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


class ClassificationHead(nn.Module):
    """transformers' XLMRobertaClassificationHead (RoBERTa's, CamemBERT's; ELECTRA's with GELU): `dense`,
    tanh (or `activation`), then `out_proj`, on each sequence's first token (<s>, [CLS]); dropout is
    inference's identity. Parameter names as the checkpoints' `classifier.*`."""

    def __init__(self, cfg: dict, n: int, activation=torch.tanh):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])
        self.out_proj = nn.Linear(cfg["hidden_size"], n)
        self.activation = activation

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.activation(self.dense(first)))


class LogitScore(nn.Module):
    """sentence-transformers' LogitScore over a causal LM (Qwen3-Reranker as published for
    sentence-transformers 6): the LM head's logit of `true_token_id` at each sequence's last token, less
    that of `false_token_id` where there is one; one score per pair. Only those rows of the LM head are
    read (`lm_head.weight`, or the input embeddings where `tie_word_embeddings` ties them), so the
    vocabulary-wide projection is never computed; the logits come in the model's dtype, as transformers'
    lm_head gives them, and are subtracted in float32."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.register_buffer("rows", rows)  # [1 or 2, hidden]

    @classmethod
    def load(cls, spec: ModelSpec, model: nn.Module) -> "LogitScore | None":
        """The head for a directory whose modules.json ends in LogitScore (`spec.logit_tokens`), else None:
        rows of `model`'s loaded input embeddings where `tie_word_embeddings` ties the LM head to them (a
        preset's random ones too), else of the checkpoint's `lm_head.weight`."""
        if not spec.logit_tokens:
            return None
        if not any(a.endswith("ForCausalLM") for a in spec.config.get("architectures") or ()):
            raise ValueError(f"{spec.path}: a LogitScore module reads a causal LM's logits; this checkpoint is "
                             f"{spec.config.get('architectures')} (supported: *ForCausalLM)")
        vocab = spec.vocab_size
        if any(not 0 <= t < vocab for t in spec.logit_tokens):
            raise ValueError(f"{spec.path}: LogitScore token ids {list(spec.logit_tokens)} are outside the "
                             f"vocabulary [0, {vocab})")
        if spec.config.get("final_logit_softcapping"):
            raise ValueError(f"{spec.path}: LogitScore over a causal LM with final_logit_softcapping is not supported")
        embed = getattr(model, "embed_tokens", None)
        if embed is None:
            raise ValueError(f"{spec.path}: LogitScore is served for decoder families (Llama, Mistral, Qwen2, Qwen3), "
                             f"not {spec.model_type}")
        embeddings = embed.weight
        if spec.config.get("tie_word_embeddings", False):
            rows = embeddings[list(spec.logit_tokens)]
        else:
            rows = _lm_head_rows(spec.path, spec.logit_tokens)
        return cls(rows.to(device=embeddings.device, dtype=embeddings.dtype))

    def forward(self, last: torch.Tensor) -> torch.Tensor:
        logits = (last @ self.rows.T).float()  # [N, 1 or 2]
        return logits[:, :1] - logits[:, 1:] if logits.shape[1] == 2 else logits


def _lm_head_rows(path: Path, tokens: tuple[int, ...]) -> torch.Tensor:
    """Rows `tokens` of `lm_head.weight` in path/*.safetensors, read row by row (not the whole matrix)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "lm_head.weight" in f.keys():
                t = f.get_slice("lm_head.weight")
                rows = torch.cat([t[i:i + 1] for i in tokens])
                if rows.dtype.is_floating_point and rows.element_size() == 1:  # fp8 codes are not values
                    raise ValueError(f"{path}: lm_head.weight is {rows.dtype}: LogitScore reads its rows unquantised "
                                     "(a checkpoint that keeps lm_head in bf16, compressed-tensors' usual ignore)")
                return rows
    raise ValueError(f"{path}: no lm_head.weight to read the LogitScore rows from (and tie_word_embeddings is not "
                     "set in config.json)")
