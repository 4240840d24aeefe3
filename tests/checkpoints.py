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
