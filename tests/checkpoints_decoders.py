"""Small random decoder checkpoints (Llama, Mistral, Qwen2, Gemma3 text) saved by transformers, in
the sentence-transformers layouts their published embedding models use (pooling, Normalize,
prompts, a byte-level tokenizer; EmbeddingGemma's whole pipeline, its two Dense modules, saved by
sentence-transformers; Qwen3 / Llama rerankers in sentence-transformers 6's layout, `save_chat_reranker`), so
that the engine, sentence-transformers and Ivy read real files."""

from __future__ import annotations

import json

import torch

from presets import RERANKER_TEMPLATE as _PUBLISHED_TEMPLATE

# The published models' pooling and prompts (config_sentence_transformers.json), per family.
E5_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
LAYOUTS = {
    # intfloat/e5-mistral-7b-instruct (and Llama-based e5 / LLM2Vec-style models): last token, normalised.
    "llama": {"pooling": "lasttoken", "prompts": {"query": E5_QUERY}},
    "mistral": {"pooling": "lasttoken", "prompts": {"web_search_query": E5_QUERY,
                                                    "sts_query": "Instruct: Retrieve semantically similar text.\nQuery: "}},
    # Alibaba-NLP/gte-Qwen2-*-instruct: bidirectional (is_causal: false), last token, normalised.
    "qwen2": {"pooling": "lasttoken", "prompts": {"query": E5_QUERY, "document": ""}},
    # google/embeddinggemma-300m: bidirectional, mean, (two Dense layers,) normalised.
    "gemma3_text": {"pooling": "mean", "prompts": {"query": "task: search result | query: ",
                                                   "document": "title: none | text: "}},
}
SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}


def _config(family: str, bidirectional: bool, overrides: dict):
    import transformers

    kw = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
              pad_token_id=3, bos_token_id=1, eos_token_id=2)
    if family == "mistral":
        kw["sliding_window"] = 16  # shorter than test sequences, so the window binds
    if family == "gemma3_text":
        kw.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                  use_bidirectional_attention=bidirectional,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    kw.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "gemma3_text": transformers.Gemma3TextConfig}[family]
    cfg = cls(**kw)
    if bidirectional and family != "gemma3_text":
        cfg.is_causal = False  # gte-Qwen2's marker (transformers' masks honour it too)
    return cfg


def save_decoder(family: str, path, seed: int = 0, bidirectional: bool = False, st: bool = True, **overrides):
    """Save a random `family` model (every norm weight and bias random too, so loading each is
    tested) to `path`, with the published layout's sentence-transformers files when `st`; return
    (path, transformers model in eager attention)."""
    import transformers

    torch.manual_seed(seed)
    cfg = _config(family, bidirectional, overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModel.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_((0.0 if family == "gemma3_text" or name.endswith("bias") else 1.0) + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    if st:
        write_st_files(path, family)
    return path, model


def write_st_files(path, family: str, max_seq_length: int = 256) -> None:
    """modules.json (Transformer, Pooling, Normalize), the pooling config, prompts and a byte-level
    tokenizer (tokenizer.json, and tokenizer_config.json for transformers' AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    from presets import stand_in_tokenizer

    layout = LAYOUTS[family]
    (path / "1_Pooling").mkdir(exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode": layout["pooling"]}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": layout["prompts"]}))
    stand_in_tokenizer(SPECIALS, ("<s>", "</s>"), path / "tokenizer.json")
    PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(path)


def reference_hidden(model, seq, bidirectional: bool = False) -> torch.Tensor:
    """transformers' last hidden states of one unpadded sequence. Bidirectional Llama-style models
    take a 4D all-visible mask (as tests.checkpoints.qwen3_reference); Gemma3 its own flag (its
    sliding window stays)."""
    ids = torch.tensor([list(seq)])
    with torch.no_grad():
        if bidirectional and model.config.model_type != "gemma3_text":
            mask = torch.zeros(1, 1, len(seq), len(seq))
            return model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
        return model(input_ids=ids).last_hidden_state[0]


def save_embeddinggemma(path, seed: int = 0, width: int = 256):
    """google/embeddinggemma-300m's published pipeline at a tiny size: a random bidirectional Gemma3
    text model (`save_decoder`) saved by sentence-transformers itself as Transformer, mean Pooling,
    two Dense modules (hidden -> `width` -> hidden, no bias, Identity: 768 -> 3072 -> 768 published),
    Normalize, and its query / document prompts. Returns the SentenceTransformer (eager attention)."""
    import tempfile
    from pathlib import Path

    from sentence_transformers import SentenceTransformer, models

    with tempfile.TemporaryDirectory() as src:
        _, hf = save_decoder("gemma3_text", Path(src), seed=seed, bidirectional=True)
        t = models.Transformer(src, model_kwargs={"attn_implementation": "eager"})
        hidden = hf.config.hidden_size
        torch.manual_seed(seed)
        mods = [t, models.Pooling(hidden, pooling_mode="mean"),
                models.Dense(hidden, width, bias=False, activation_function=torch.nn.Identity()),
                models.Dense(width, hidden, bias=False, activation_function=torch.nn.Identity()),
                models.Normalize()]
        st = SentenceTransformer(modules=mods, device="cpu", prompts=LAYOUTS["gemma3_text"]["prompts"])
        st.save(str(path))
    return st.eval()


# Qwen3-Reranker's chat template (the preset's, as published) with a shorter system line that names the
# end token through the tokenizer's `eos_token` (transformers hands a template the special tokens by name).
RERANKER_TEMPLATE = _PUBLISHED_TEMPLATE.replace(
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the '
    'answer can only be "yes" or "no".<|im_end|>', 'Judge: "yes" or "no".{{ eos_token }}')
assert RERANKER_TEMPLATE != _PUBLISHED_TEMPLATE


def _reranker_tokenizer(max_length: int):
    """A byte-level BPE tokenizer with Qwen's chat tokens and the merges that make "yes" and "no" one
    token each, as a transformers tokenizer carrying `RERANKER_TEMPLATE`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("y", "e"), ("ye", "s"), ("n", "o"), ("Ġ", "t"), ("Ġt", "h"), ("e", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ft.chat_template, ft.model_max_length = RERANKER_TEMPLATE, max_length
    return ft


def save_chat_reranker(path, kind: str = "logit", tied: bool = True, max_length: int = 160, seed: int = 0,
                       family: str = "qwen3"):
    """A tiny random Qwen3 (or `family` "llama", "qwen2": mxbai-rerank-v2's base) reranker saved by sentence-transformers (6) as it
    publishes one: `kind` "logit" is Qwen3-Reranker's layout (*ForCausalLM, Transformer "text-generation"
    + LogitScore on the "yes" / "no" logits, `tied` or an own lm_head), "seq-cls" its conversion to
    *ForSequenceClassification (one label); both with the chat template that renders each pair.
    Returns (path, the CrossEncoder loaded back from it)."""
    import tempfile
    from pathlib import Path

    import transformers
    from sentence_transformers import CrossEncoder

    tok = _reranker_tokenizer(max_length)
    n = len(tok)
    torch.manual_seed(seed)
    prefix = {"qwen3": "Qwen3", "llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, f"{prefix}Config")(
        vocab_size=n, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=tied, pad_token_id=0,
        eos_token_id=tok.eos_token_id, num_labels=1)
    cls = getattr(transformers, f"{prefix}ForCausalLM" if kind == "logit" else f"{prefix}ForSequenceClassification")
    model = cls(cfg).eval()
    with torch.no_grad():  # random norms (each loaded one shows) and heads that spread the scores
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        head = model.lm_head if kind == "logit" and not tied else model.model.embed_tokens if kind == "logit" \
            else model.score
        head.weight.normal_(0.0, 0.5)
    with tempfile.TemporaryDirectory() as src:
        model.save_pretrained(src)
        tok.save_pretrained(src)
        CrossEncoder(src, device="cpu").save(str(path))
    return path, CrossEncoder(str(path), device="cpu")
