"""Reading a Hugging Face model directory: where it is and what it says.

A model directory holds config.json, *.safetensors, tokenizer.json and, for
sentence-transformers models, modules.json, 1_Pooling/config.json,
sentence_bert_config.json, config_sentence_transformers.json and the modules after
pooling (N_Dense/, N_Normalize/, a quantizer). This module turns those files into one
frozen `ModelSpec`; it loads no weights and imports nothing of the engine or torch (the
gateway reads model directories too). A module it does not know is an error naming it.

Which directory a `--model` reference names (default, preset:NAME, a directory, a Hugging Face Hub id) is
trellis.modelref's to say.

What a directory leaves to the model family (the default pooling without a Pooling
module, how many positions the architecture numbers) is the family's to say:
`rose.models.base.Family.serving(spec)` completes the spec the engine serves.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from trellis import spiece


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers Dense module after pooling: y = activation(x W^T + b).

    path:         the module's directory (its weights: model.safetensors, or pytorch_model.bin from
                  older releases; tensors `linear.weight` [out, in] and, with a bias, `linear.bias`).
    in_features:  the width it takes (the pooled vector's, or the previous Dense's out_features).
    out_features: the width it gives.
    bias:         whether the linear layer has a bias.
    activation:   `activation_function` as written, e.g. "torch.nn.modules.linear.Identity",
                  "torch.nn.modules.activation.Tanh" (the engine maps it: `rose.layers.dense`).
    """

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


# A model directory holding this file has random weights (a preset: presets.materialize writes it); the engine
# fills the weights with seeded random values, and every place that names the model says so.
RANDOM_WEIGHTS = "RANDOM_WEIGHTS"
# sentence-transformers' Dense without an activation_function key uses its constructor's default.
DEFAULT_DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"
# Custom modules read as they are published (modules.json "type" -> what it adds): perplexity-ai's
# pplx-embed-v1 quantizer (its repo's st_quantize.py): int8 = round(tanh(x) * 127), packed sign bits.
QUANTIZER_MODULES = ("st_quantize.FlexibleQuantizer",)
# The pipeline's stages in the order they must come (Dense may repeat). LogitScore: a CrossEncoder over a
# causal LM (sentence-transformers 6: Qwen3-Reranker), the score read from the LM head at the last token.
_STAGES = ("Transformer", "LogitScore", "Pooling", "Dense", "Normalize", "Quantizer")
# sentence-transformers' SparseEncoder (SPLADE) modules and its CLIPModel (a CLIP's two towers, as transformers
# saved them), read as the stage they hold.
_ALIASES = {"MLMTransformer": "Transformer", "SpladePooling": "Pooling", "CLIPModel": "Transformer"}
# Model types whose text tower reads every position of its input with no attention mask and pools the last one
# (transformers' SiglipTextTransformer: `last_hidden_state[:, -1]`; the fixed-resolution SigLIP 2 checkpoints are
# saved as "siglip" too), trained on texts padded to the full width: their texts are padded as their processor
# pads them with padding="max_length", as the model cards call it and as transformers' zero-shot-image-
# classification pipeline pads every model whose model_type holds "siglip". The value: transformers' default
# text positions (SiglipTextConfig.max_position_embeddings), where config.json's text_config names none.
PADDED_TEXT = {"siglip": 64}
# transformers' tokenizer classes whose class default `padding_side` is "left" (what a tokenizer_config.json naming
# no padding_side gets); every other class pads on the right (PreTrainedTokenizerBase's default)
LEFT_PADDING_CLASSES = frozenset(f"{c}Tokenizer{fast}" for c in ("Gemma", "Llama", "CodeLlama", "Cohere", "Siglip2",
                                                                "XLNet") for fast in ("", "Fast"))


@dataclass(frozen=True)
class ModelSpec:
    """What a model directory says about serving it.

    path:        the directory.
    config:      config.json as a dict (the architecture's hyper-parameters).
    model_type:  config["model_type"], e.g. "bert".
    pooling:     "cls" | "mean" | "max" | "weightedmean" | "last" from 1_Pooling/config.json, "splade" from
                 a SpladePooling module (max over tokens of log(1 + relu(MLM logits))); "" without a
                 Pooling module (the family's default applies: `Family.default_pooling`).
    normalize:   whether a Normalize module follows pooling (and any Dense modules) in modules.json.
    max_seq_len: longest sequence served, in tokens: sentence_bert_config.json's max_seq_length
                 (what sentence-transformers truncates to), else tokenizer_config.json's
                 model_max_length, else config.json's max_position_embeddings; the family caps it
                 by the positions its architecture numbers (`Family.max_positions`).
    prompts:     named prompts from config_sentence_transformers.json.
    default_prompt_name: its `default_prompt_name`: the prompt sentence-transformers applies to every
                 input that names none (`encode()` / `predict()` without prompt or prompt_name); "" none.
    special_token_ids: ids tokenizer.json marks special (dropped from sparse lexical weights).
    include_prompt: False when the Pooling config says `include_prompt: false`: pooling then leaves a
                 prompt's tokens out (mean / max / weighted mean over the rest, weighted mean keeping
                 the tokens' positions in the sequence as weights; CLS takes the first token after it),
                 as sentence-transformers does.
    dense:       the Dense modules between pooling and Normalize, in order (EmbeddingGemma has two);
                 the served vector is the last one's out_features wide (`embedding_dim`).
    quantized_outputs: int8 / binary outputs offered (Info lists them): modules.json ends with a
                 quantizer module the model is trained for (`QUANTIZER_MODULES`: pplx-embed-v1's).
    activation_fn: a cross-encoder's activation as sentence-transformers saved it in
                 config_sentence_transformers.json (e.g. "torch.nn.modules.activation.Sigmoid"); ""
                 none (`rose.layers.scores.activation_name` has the whole rule).
    logit_tokens: a LogitScore module's (true_token_id,) or (true_token_id, false_token_id): the
                 directory is a cross-encoder over a causal LM whose one score per pair is the LM head's
                 logit of the first at the sequence's last token, less the second's (`rose.layers.scores`).
    chat_template: the Jinja chat template a cross-encoder's (query, document) pairs are rendered with
                 (`ivy.chat`), where its Transformer module takes messages; "" where pairs go through the
                 tokenizer's pair template. From chat_template.jinja, else tokenizer_config.json.
    message_format: how that template reads a message's content: "flat" (a string) or "structured"
                 (`[{"type": "text", "text": ...}]`), as sentence-transformers saved or infers it.
    pad_to:      a text's tokens are padded to this many (0: never): the model's processor pads to its
                 maximum (`PADDED_TEXT`: SigLIP), and max_seq_len is then at most its text positions.
    pad_id:      the token it pads with: the tokenizer's pad token (tokenizer_config.json, else
                 special_tokens_map.json, else tokenizer.json's padding), else text_config's pad_token_id;
                 -1 where none is named (a gateway serving its texts refuses to start).
    pad_left:    pad before the text (the tokenizer's padding_side "left": tokenizer_config.json, else
                 tokenizer.json's padding, else its class's default, `LEFT_PADDING_CLASSES`) instead of after.
    """

    path: Path
    config: dict
    model_type: str
    pooling: str
    normalize: bool
    max_seq_len: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""
    special_token_ids: tuple[int, ...] = ()
    include_prompt: bool = True
    dense: tuple[DenseSpec, ...] = ()
    quantized_outputs: bool = False
    activation_fn: str = ""
    logit_tokens: tuple[int, ...] = ()
    chat_template: str = ""
    message_format: str = "flat"
    pad_to: int = 0
    pad_id: int = -1
    pad_left: bool = False

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        """The text vocabulary: config.json's vocab_size, or a two-tower model's (CLIP, SigLIP) text_config's."""
        c = self.config
        return int(c["vocab_size"] if "vocab_size" in c else (c.get("text_config") or {})["vocab_size"])

    @property
    def embedding_dim(self) -> int:
        """Width of the served vector: the last Dense module's out_features, else the hidden size."""
        return self.dense[-1].out_features if self.dense else self.hidden_size

    @classmethod
    def read(cls, path: Path) -> "ModelSpec":
        modules = _read_json(path / "modules.json")
        inner = transformer_dir(path, modules)
        if inner is not None:  # the checkpoint in its module's folder: that is the model directory; the pipeline
            spec = cls.read(inner)  # and its prompts are the root's
            st_cfg = _read_json(path / "config_sentence_transformers.json") or {}
            prompts = {"prompts": dict(st_cfg.get("prompts") or {}),
                       "default_prompt_name": str(st_cfg.get("default_prompt_name") or "")} if st_cfg else {}
            return dataclasses.replace(spec, **_read_pipeline(path, modules, hidden_width(spec.config)), **prompts)
        config = _read_json(path / "config.json")
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"{path / 'config.json'} has no model_type")
        pipeline = _read_pipeline(path, modules or [], hidden_width(config))
        st = _read_json(path / "sentence_bert_config.json") or {}
        tok_cfg = _read_json(path / "tokenizer_config.json") or {}
        cross_encoder = bool(pipeline["logit_tokens"]) or any(
            str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())
        chat = _pair_messages(path, modules is not None, st, tok_cfg) if cross_encoder else {}
        limit = tok_cfg.get("model_max_length")
        limit = int(limit) if isinstance(limit, (int, float)) and limit < 1 << 30 else None  # HF's "no limit"
        max_len = int(st.get("max_seq_length") or limit or config.get("max_position_embeddings", 512))
        st_cfg = _read_json(path / "config_sentence_transformers.json") or {}
        prompts = st_cfg.get("prompts") or {}
        default_prompt = st_cfg.get("default_prompt_name") or ""
        if default_prompt and default_prompt not in prompts:
            raise ValueError(f"{path / 'config_sentence_transformers.json'}: default_prompt_name {default_prompt!r} "
                             f"is not one of its prompts ({', '.join(prompts) or 'none'})")
        # SigLIP 1 publishes spiece.model alone: its special tokens and pieces as tokenizer.json would hold them
        tok = _read_json(path / "tokenizer.json") or spiece.tokenizer_dict(path) or {}
        special = tuple(sorted(int(t["id"]) for t in tok.get("added_tokens", []) if t.get("special")))
        padding = {}
        if config["model_type"] in PADDED_TEXT:
            text = config.get("text_config") or {}
            max_len = min(max_len, int(text.get("max_position_embeddings") or PADDED_TEXT[config["model_type"]]))
            padding = _padding(path, tok, tok_cfg, text, max_len)
        return cls(path, config, config["model_type"], max_seq_len=max_len, prompts=dict(prompts),
                   default_prompt_name=str(default_prompt),
                   special_token_ids=special, activation_fn=str(st_cfg.get("activation_fn") or ""), **chat,
                   **pipeline, **padding)


def _padding(path: Path, tok: dict, tok_cfg: dict, text_config: dict, length: int) -> dict:
    """ModelSpec's pad_to, pad_id, pad_left for a model whose texts are padded to `length`: the pad token and side
    as transformers' tokenizer takes them (tokenization_utils_tokenizers.TokenizersBackend.__init__: its
    tokenizer_config.json and special_tokens_map.json first, then the padding saved in tokenizer.json, then the
    class's default side; a class's default pad token, e.g. GemmaTokenizer's "<pad>", is not known here: the
    published SigLIP tokenizers name theirs), else config.json's text_config pad_token_id."""
    saved = tok.get("padding") if isinstance(tok.get("padding"), dict) else {}
    token = (tok_cfg.get("pad_token") or (_read_json(path / "special_tokens_map.json") or {}).get("pad_token")
             or saved.get("pad_token"))
    token = token.get("content") if isinstance(token, dict) else token
    pad_id = _token_id(tok, token) if isinstance(token, str) else None
    if pad_id is None:
        pad_id = saved.get("pad_id") if saved else text_config.get("pad_token_id")
    side = tok_cfg.get("padding_side") or str(saved.get("direction", "")).lower() or (
        "left" if tok_cfg.get("tokenizer_class") in LEFT_PADDING_CLASSES else "right")
    return {"pad_to": length, "pad_id": -1 if pad_id is None else int(pad_id), "pad_left": side == "left"}


def _token_id(tok: dict, token: str) -> int | None:
    """`token`'s id in tokenizer.json: an added token's, else the model's vocabulary's (a dict, or Unigram's
    [piece, score] list); None where it has none."""
    for t in tok.get("added_tokens") or ():
        if t.get("content") == token:
            return int(t["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(token)
    if isinstance(vocab, list):
        return next((i for i, v in enumerate(vocab) if v and v[0] == token), None)
    return None


def transformer_dir(path: Path, modules=None) -> Path | None:
    """The folder of a directory's first module where the transformers checkpoint lives there and not in the
    directory itself (`transformer_subdir`); None for every other layout (the checkpoint in the root).
    `modules`: modules.json as read (read here where not given)."""
    if modules is None and not (path / "config.json").is_file():
        modules = _read_json(path / "modules.json")
    sub = transformer_subdir(modules, lambda rel: (path / rel).is_file())
    return path / sub if sub else None


def transformer_subdir(modules, has) -> str:
    """Where a model's transformers checkpoint (its config.json, weights, tokenizer and processor files) lives
    when not at the top: its first module's folder, as older sentence-transformers saved a CLIP's `CLIPModel`
    module in `0_CLIPModel/` (sentence-transformers/clip-ViT-B-32); "" for every other layout. `modules`:
    modules.json as read; `has(relative path)`: whether the directory, or a Hub repository's file listing
    (trellis.hub), holds that file. The one rule for both."""
    if has("config.json") or not isinstance(modules, list) or not modules:
        return ""
    first = modules[0] if isinstance(modules[0], dict) else {}
    sub = str(first.get("path") or "")
    if not sub or _stage(str(first.get("type", ""))) != "Transformer" or not has(f"{sub}/config.json"):
        return ""
    return sub


def hidden_width(config: dict) -> int:
    """The model's hidden size under its config's name for it (`hidden_size`; T5's `d_model`, DistilBERT's
    `dim`, NomicBERT's GPT-2 style `n_embd`): what a Pooling module's vector is wide."""
    return int(next((config[k] for k in ("hidden_size", "d_model", "dim", "n_embd") if config.get(k)), 0))


def _stage(module_type: str) -> str:
    """modules.json "type" -> its stage in `_STAGES`. sentence-transformers' own modules by class name
    ("sentence_transformers.models.Pooling" in older releases, e.g.
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling" or
    "sentence_transformers.base.modules.dense.Dense" in newer ones); custom modules by full name."""
    kind = module_type.rsplit(".", 1)[-1]
    kind = _ALIASES.get(kind, kind)
    if module_type.startswith("sentence_transformers.") and kind in _STAGES[:5]:
        return kind
    if module_type in QUANTIZER_MODULES:
        return "Quantizer"
    raise ValueError(f"module {module_type!r} is not supported (supported: sentence-transformers' "
                     f"Transformer, LogitScore, Pooling, Dense, Normalize; custom: {', '.join(QUANTIZER_MODULES)})")


def _read_pipeline(path: Path, modules: list, hidden: int) -> dict:
    """modules.json (Transformer, Pooling, Dense..., Normalize, quantizer, in that order, each optional)
    -> the ModelSpec fields it decides."""
    out = dict(pooling="", normalize=False, include_prompt=True, dense=(), quantized_outputs=False, logit_tokens=())
    where = path / "modules.json"
    last, dim = -1, hidden
    for m in modules:
        module_type = m.get("type", "")
        stage = _stage(module_type)
        at = _STAGES.index(stage)
        if at < last or (at == last and stage != "Dense"):
            raise ValueError(f"{where}: module {module_type!r} comes after {_STAGES[last]} (supported order: "
                             f"{' -> '.join(_STAGES)}, Dense repeatable)")
        if stage == "Dense" and not out["pooling"]:
            raise ValueError(f"{where}: Dense module {module_type!r} without a Pooling module before it")
        if out["logit_tokens"]:
            raise ValueError(f"{where}: module {module_type!r} after LogitScore (a cross-encoder's score is its "
                             "last output)")
        last = at
        mdir = path / m.get("path", "")
        cfg = _read_json(mdir / "config.json") or {}
        if stage in ("Dense", "Normalize"):
            for key in ("module_input_name", "module_output_name"):
                if cfg.get(key, "sentence_embedding") != "sentence_embedding":
                    raise ValueError(f"{mdir / 'config.json'}: {key} {cfg[key]!r} is not supported (only modules "
                                     "on the pooled vector, 'sentence_embedding')")
        if stage == "LogitScore":
            out["logit_tokens"] = _logit_score(mdir, cfg)
        elif stage == "Pooling" and module_type.endswith(".SpladePooling"):
            out["pooling"] = _splade_pooling(cfg)
        elif stage == "Pooling":
            out["pooling"], out["include_prompt"] = _pooling_mode(cfg), bool(cfg.get("include_prompt", True))
        elif stage == "Dense":
            d = _dense(mdir, cfg)
            if d.in_features != dim:
                raise ValueError(f"{mdir / 'config.json'}: in_features {d.in_features} does not match the "
                                 f"{dim} values before it")
            out["dense"], dim = (*out["dense"], d), d.out_features
        elif stage == "Normalize":
            out["normalize"] = True
        elif stage == "Quantizer":
            out["quantized_outputs"] = True
    return out


def _logit_score(mdir: Path, cfg: dict) -> tuple[int, ...]:
    """LogitScore's config.json: (true_token_id,) or (true_token_id, false_token_id), read from causal_logits."""
    true, false = cfg.get("true_token_id"), cfg.get("false_token_id")
    if not isinstance(true, int) or not (false is None or isinstance(false, int)):
        raise ValueError(f"{mdir / 'config.json'}: LogitScore needs an integer true_token_id (and false_token_id "
                         f"an integer or null), got {true!r}, {false!r}")
    if cfg.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{mdir / 'config.json'}: LogitScore on {cfg['module_input_name']!r} is not supported "
                         "(only the causal LM's logits, 'causal_logits')")
    return (true,) if false is None else (true, false)


def _chat_template(path: Path, tok_cfg: dict) -> str:
    """The directory's chat template, as transformers finds it: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a string, or named templates: the "default" one)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    t = tok_cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else ""


# A chat template that reads a message's content as a list of typed parts (sentence-transformers' test).
_STRUCTURED = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")


def _pair_messages(path: Path, has_modules: bool, st: dict, tok_cfg: dict) -> dict:
    """ModelSpec's chat_template and message_format, as sentence-transformers (6) decides whether a pair
    becomes messages: its Transformer module's saved `modality_config` has "message"; a directory with
    modules.json but no modality_config was saved text-only; one without modules.json takes messages where
    the tokenizer has a chat template. Format "auto" (or none saved) is inferred from the template."""
    template = _chat_template(path, tok_cfg)
    modality = st.get("modality_config")
    if isinstance(modality, dict):
        message = modality.get("message")
    else:
        message = None if has_modules else ({} if template else None)
    if not isinstance(message, dict) or not template:
        return {"chat_template": "", "message_format": "flat"}
    fmt = message.get("format", "auto")
    if fmt == "auto":
        fmt = "structured" if any(p in template for p in _STRUCTURED) else "flat"
    if fmt not in ("flat", "structured"):
        raise ValueError(f"{path / 'sentence_bert_config.json'}: message format {fmt!r} is not supported "
                         "(flat, structured)")
    return {"chat_template": template, "message_format": fmt}


def _dense(mdir: Path, cfg: dict) -> DenseSpec:
    if not isinstance(cfg.get("in_features"), int) or not isinstance(cfg.get("out_features"), int):
        raise ValueError(f"{mdir / 'config.json'}: a Dense module needs integer in_features and out_features")
    if cfg.get("use_residual"):
        raise ValueError(f"{mdir / 'config.json'}: Dense use_residual is not supported")
    if not ((mdir / "model.safetensors").is_file() or (mdir / "pytorch_model.bin").is_file()):
        raise ValueError(f"{mdir}: a Dense module needs model.safetensors or pytorch_model.bin")
    return DenseSpec(mdir, cfg["in_features"], cfg["out_features"], bool(cfg.get("bias", True)),
                     str(cfg.get("activation_function") or DEFAULT_DENSE_ACTIVATION))


# sentence-transformers' pooling modes -> ours (one mode; combinations concatenate and are not served).
_POOLING = {"cls": "cls", "mean": "mean", "max": "max", "weightedmean": "weightedmean", "lasttoken": "last"}
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _splade_pooling(cfg: dict) -> str:
    """SpladePooling's config: the max / relu SPLADE of the published models is supported."""
    got = (cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu"))
    if got != ("max", "relu"):
        raise ValueError(f"unsupported SpladePooling {cfg!r} (supported: pooling_strategy max, activation_function relu)")
    return "splade"


def _pooling_mode(cfg: dict) -> str:
    """1_Pooling/config.json: "pooling_mode": "mean" | ... (newer sentence-transformers) or the older
    booleans (pooling_mode_mean_tokens, ...); neither means mean, as sentence-transformers reads it."""
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [m for k, m in _LEGACY_POOLING.items() if cfg.get(k)]
        mode = modes[0] if len(modes) == 1 else tuple(modes) if modes else "mean"
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in _POOLING:
        raise ValueError(f"unsupported pooling_mode {mode!r} (supported: one of {', '.join(_POOLING)})")
    return _POOLING[mode]
