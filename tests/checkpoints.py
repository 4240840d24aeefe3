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
