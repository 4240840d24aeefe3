"""Small random checkpoints saved by transformers itself, so that our loader reads real files."""

import torch


def save_checkpoint(family: str, path, seed: int = 0, **overrides):
    """Save a random `family` ("bert" | "xlm-roberta") model to `path`; return (path, hf_model).

    No sentence-transformers files are written, so the engine uses CLS pooling, unnormalised.
    """
    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    kw.update(overrides)
    if family == "bert":
        kw.setdefault("max_position_embeddings", 96)
        model = transformers.BertModel(transformers.BertConfig(**kw))
    elif family == "xlm-roberta":
        # XLM-RoBERTa numbers positions from pad_token_id + 1 = 2: 98 positions serve 96 tokens.
        kw.setdefault("max_position_embeddings", 98)
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(type_vocab_size=1, pad_token_id=1, **kw))
    else:
        raise ValueError(family)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model


def save_qwen3(path, seed: int = 0, bidirectional: bool = False, **overrides):
    """A small random Qwen3 (GQA, head_dim 32) saved by transformers; `bidirectional` marks it
    `is_causal: false` in config.json, as pplx-embed style models are read."""
    import json

    import transformers

    torch.manual_seed(seed)
    kw = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)
    kw.update(overrides)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**kw)).eval()
    model.save_pretrained(path, safe_serialization=True)
    if bidirectional:
        cfg = json.loads((path / "config.json").read_text())
        cfg["is_causal"] = False
        (path / "config.json").write_text(json.dumps(cfg))
    return path, model


def qwen3_reference(model, seq, bidirectional: bool) -> torch.Tensor:
    """Hidden states of one unpadded sequence from transformers; bidirectional via a 4D all-visible mask."""
    ids = torch.tensor([list(seq)])
    with torch.no_grad():
        if bidirectional:
            mask = torch.zeros(1, 1, len(seq), len(seq))
            return model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
        return model(input_ids=ids).last_hidden_state[0]


PPLX_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "", "type": "st_quantize.FlexibleQuantizer", "kwargs": ["quantization"]},
]


def save_pplx(path, seed: int = 0, **overrides):
    """A small random bidirectional Qwen3 saved by transformers, in pplx-embed-v1's published layout:
    config.json rewritten to its model_type / architectures, modules.json = Transformer, mean Pooling
    (the older boolean keys, as published), the quantizer module (no Normalize). Returns (path, hf_model)."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    _, model = save_qwen3(path, seed, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="bidirectional_pplx_qwen3", architectures=["PPLXQwen3Model"],
               use_bidirectional_attention=True)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "modules.json").write_text(json.dumps(PPLX_MODULES))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": cfg["hidden_size"], "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False, "include_prompt": True}))
    return path, model


def _unigram_tokenizer_json(path, texts, vocab_size: int = 400) -> int:
    """An XLM-R-shaped tokenizer.json (Unigram over Metaspace; <s>=0 <pad>=1 </s>=2 <unk>=3; the
    published pair template `<s> $A </s> </s> $B </s>`, token types all 0) trained on `texts`; its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok.train_from_iterator(list(texts) * 4, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                      unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens([AddedToken("<mask>", special=True, lstrip=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def save_cross_encoder(family: str, path, num_labels: int = 1, max_length: int = 64, seed: int = 0, **overrides):
    """A random `BertForSequenceClassification` ("bert", with all-MiniLM-L6-v2's real WordPiece
    tokenizer.json and its `[CLS] $A [SEP] $B:1 [SEP]:1` pair template),
    `DistilBertForSequenceClassification` ("distilbert", MiniLM's tokenizer without token type ids),
    `ElectraForSequenceClassification` ("electra", MiniLM's tokenizer; 32-wide embeddings projected),
    `DebertaV2ForSequenceClassification` ("deberta-v2", DeBERTa-v3's layout, MiniLM's tokenizer),
    `XLMRobertaForSequenceClassification` ("xlm-roberta", a small Unigram tokenizer with XLM-R's
    template), `RobertaForSequenceClassification` ("roberta", the same tokenizer) or `ModernBertForSequenceClassification` ("modernbert", gte-reranker-modernbert-base's
    architecture: MiniLM's tokenizer without token type ids, as ModernBERT's tokenizer_config has it;
    three layers, global / local / global with a 16-token window the pairs exceed; `classifier_pooling`
    "cls" or "mean" through `overrides`) saved by transformers, as a cross-encoder is published; the
    tokenizer's model_max_length is `max_length`. Returns (path, hf_model)."""
    import json
    import shutil

    import transformers

    from tests.sentences import SENTENCES
    from trellis.modelref import resolve_model_path

    path.mkdir(parents=True, exist_ok=True)
    # initializer_range 0.2 (not 0.02): attention mixes the tokens enough that pairs score apart
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=num_labels,
              initializer_range=0.2)
    if family in ("bert", "modernbert", "distilbert", "electra", "deberta-v2"):
        src = resolve_model_path("default")
        for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(src / name, path / name)
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    if family == "bert":
        kw.update(vocab_size=30522, max_position_embeddings=96)
        kw.update(overrides)
        torch.manual_seed(seed)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**kw))
    elif family == "modernbert":
        tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
        kw.update(vocab_size=30522, num_hidden_layers=3, intermediate_size=96, max_position_embeddings=256,
                  global_attn_every_n_layers=2, local_attention=16, pad_token_id=0, bos_token_id=101,
                  eos_token_id=102, cls_token_id=101, sep_token_id=102)
        kw.update(overrides)
        torch.manual_seed(seed)
        model = transformers.ModernBertForSequenceClassification(transformers.ModernBertConfig(**kw))
    elif family == "deberta-v2":  # DeBERTa-v3's layout (mxbai-rerank-*-v1): relative attention, no token types
        kw.update(vocab_size=30522, max_position_embeddings=96, relative_attention=True, pos_att_type=["p2c", "c2p"],
                  position_buckets=16, max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True,
                  position_biased_input=False, type_vocab_size=0, pooler_hidden_size=64, pooler_hidden_act="gelu")
        kw.update(overrides)
        torch.manual_seed(seed)
        model = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**kw))
    elif family == "electra":  # ELECTRA-small's narrower embeddings, projected to the hidden size
        kw.update(vocab_size=30522, max_position_embeddings=96, embedding_size=32)
        kw.update(overrides)
        torch.manual_seed(seed)
        model = transformers.ElectraForSequenceClassification(transformers.ElectraConfig(**kw))
    elif family == "distilbert":  # MiniLM's WordPiece without token type ids, as DistilBERT's tokenizer
        tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
        kw = dict(vocab_size=30522, dim=64, n_layers=2, n_heads=4, hidden_dim=128, num_labels=num_labels,
                  initializer_range=0.2, max_position_embeddings=96)
        kw.update(overrides)
        torch.manual_seed(seed)
        model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**kw))
    elif family in ("xlm-roberta", "roberta"):
        vocab = _unigram_tokenizer_json(path, SENTENCES)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
                   "mask_token": "<mask>", "model_input_names": ["input_ids", "attention_mask"]}
        kw.update(vocab_size=vocab, max_position_embeddings=max_length + 2, type_vocab_size=1, pad_token_id=1)
        kw.update(overrides)
        torch.manual_seed(seed)
        if family == "roberta":
            model = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**kw))
        else:
            model = transformers.XLMRobertaForSequenceClassification(transformers.XLMRobertaConfig(**kw))
    else:
        raise ValueError(family)
    with torch.no_grad():  # scores spread over (0, 1), not all near sigmoid(0); a second segment that shows
        head = model.classifier.out_proj if family in ("xlm-roberta", "roberta", "electra") else model.classifier
        head.weight.normal_(0.0, 0.5)
        if family in ("bert", "electra"):
            model.base_model.embeddings.token_type_embeddings.weight[1].normal_(0.0, 0.5)
    tok_cfg["model_max_length"] = max_length
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model
