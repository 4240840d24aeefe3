"""Real-shape presets with random weights, for benchmarking where weights cannot be downloaded.

Not a contract: trellis.modelref imports this package only when a `preset:NAME` reference is resolved (or a
bare preset name is refused), and the gateway image does not carry it.

`--model preset:bge-m3` (for example; only with the `preset:` prefix, trellis.modelref: the bare name is an
error naming the real model's Hub id, `HUB_IDS`) materialises a model directory under the
cache (config.json, the sentence-transformers files, a stand-in tokenizer and a
RANDOM_WEIGHTS marker) and the engine fills the weights
with seeded random values, logging loudly that it did. A preset has the real
architecture, shapes and cost; its embeddings (or the cross-encoders' scores: `bge-reranker-v2-m3`,
`gte-reranker-modernbert-base`) mean nothing. `bge-m3`'s and `bge-reranker-v2-m3`'s stand-in tokenizer is XLM-R-like
(presets/standin.py: a 250k-piece Unigram vocabulary, so that tokenizing costs what it costs with
the real one, and XLM-R's pair template); the decoder presets' (Qwen3, e5-mistral,
gte-Qwen2, EmbeddingGemma) is byte-level (one token per UTF-8 byte) with the model's special tokens,
as are the encoder presets' (`msmarco-distilbert`, `all-mpnet-base-v2`, `gte-modernbert-base`,
`nomic-embed-text-v1.5`, `splade-cocondenser`: each model's published config.json hyper-parameters,
BERT-style [CLS] ... [SEP] wrapping; `gte-reranker-modernbert-base`'s with BERT's pair template).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trellis import cache_root
from trellis.modeldir import RANDOM_WEIGHTS, hidden_width

__all__ = ["PRESETS", "HUB_IDS", "RANDOM_WEIGHTS", "RERANKER_TEMPLATE", "cache_dir", "fingerprint", "materialize",
           "stand_in_tokenizer"]
FORMAT = 6  # bump when materialize() or a stand-in tokenizer (here or presets/standin.py) writes something different

PRESETS: dict[str, dict] = {
    # BAAI/bge-m3: XLM-RoBERTa large, 8192 positions, CLS pooling, normalised.
    "bge-m3": {
        "config": {
            "model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"], "vocab_size": 250002,
            "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
            "intermediate_size": 4096, "hidden_act": "gelu", "max_position_embeddings": 8194,
            "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0,
            "eos_token_id": 2, "position_embedding_type": "absolute",
        },
        "pooling": "cls", "normalize": True, "max_seq_length": 8192,
        "specials": {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}, "wrap": ("<s>", "</s>"),
        "tokenizer": "xlm-r-unigram",
    },
}
# BAAI/bge-reranker-v2-m3: a cross-encoder, XLMRobertaForSequenceClassification over bge-m3's shapes with
# one label (a relevance logit; CrossEncoder applies Sigmoid); no sentence-transformers files, the
# tokenizer's model_max_length 8192 as published; the stand-in tokenizer pairs as XLM-R does
# (`<s> q </s></s> d </s>`, every token type 0).
PRESETS["bge-reranker-v2-m3"] = {
    "config": {**PRESETS["bge-m3"]["config"], "architectures": ["XLMRobertaForSequenceClassification"],
               "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "classifier_dropout": None},
    "cross_encoder": True, "max_seq_length": 8192, "tokenizer": "xlm-r-unigram",
}

_QWEN3_0_6B = {
    "model_type": "qwen3", "architectures": ["Qwen3Model"], "vocab_size": 151669, "hidden_size": 1024,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": True,
}
_QWEN3_SPECIALS = {"specials": {"<|endoftext|>": 0, "<unk>": 1}, "wrap": (None, "<|endoftext|>")}
# pplx-embed-v1's published config.json names its own model type (a bidirectional Qwen3: rose.models.pplx_qwen3).
_PPLX = {"model_type": "bidirectional_pplx_qwen3", "architectures": ["PPLXQwen3Model"],
         "use_bidirectional_attention": True}
PRESETS.update({
    # perplexity-ai/pplx-embed-v1-0.6b: Qwen3-0.6B blocks, bidirectional, mean pooling, then its int8 /
    # binary quantizer module (st_quantize.FlexibleQuantizer), no Normalize.
    "pplx-embed-1-0.6b": {"config": {**_QWEN3_0_6B, **_PPLX}, "pooling": "mean", "normalize": False,
                          "quantizer": True, "max_seq_length": 32768, **_QWEN3_SPECIALS},
    # perplexity-ai/pplx-embed-v1-4b: Qwen3-4B blocks, otherwise as the 0.6b.
    "pplx-embed-1-4b": {"config": {**_QWEN3_0_6B, "vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36,
                                   "num_attention_heads": 32, "intermediate_size": 9728, **_PPLX},
                        "pooling": "mean", "normalize": False, "quantizer": True, "max_seq_length": 32768,
                        **_QWEN3_SPECIALS},
    # Qwen/Qwen3-Embedding-0.6B: causal, last-token pooling, normalised, instruction prompt for queries.
    "qwen3-embedding-0.6b": {"config": _QWEN3_0_6B, "pooling": "last", "normalize": True, "max_seq_length": 32768,
                             "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages "
                                                  "that answer the query\nQuery:", "document": ""},
                             **_QWEN3_SPECIALS},
})

# Qwen/Qwen3-Reranker-0.6B in the layout sentence-transformers 6 publishes: Qwen3ForCausalLM (the 0.6B's LM
# head tied to its embeddings), Transformer + LogitScore (logit("yes") - logit("no") at the last token),
# pairs rendered by its chat template. The byte-level stand-in has Qwen's chat tokens; LogitScore reads the
# rows of its "y" and "n" bytes (random weights: any two rows cost the same).
RERANKER_TEMPLATE = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: '
    '{{ messages | selectattr("role", "eq", "system") | map(attribute="content") | first'
    ' | default("Given a web search query, retrieve relevant passages that answer the query") }}\n'
    '<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }}\n'
    '<Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") | first }}'
    '<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
PRESETS["qwen3-reranker-0.6b"] = {
    "config": {**_QWEN3_0_6B, "architectures": ["Qwen3ForCausalLM"]}, "logit_score": ("y", "n"),
    "max_seq_length": 32768, "specials": {"<|endoftext|>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3},
    "wrap": (None, "<|endoftext|>"), "chat_template": RERANKER_TEMPLATE,
}

_E5_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
PRESETS.update({
    # intfloat/e5-mistral-7b-instruct: Mistral-7B-v0.1 (sliding window 4096), causal, last-token pooling,
    # normalised; task-named query prompts (config_sentence_transformers.json), none for documents.
    "e5-mistral-7b-instruct": {
        "config": {"model_type": "mistral", "architectures": ["MistralModel"], "vocab_size": 32000,
                   "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "intermediate_size": 14336, "hidden_act": "silu", "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
                   "bos_token_id": 1, "eos_token_id": 2},
        "pooling": "last", "normalize": True, "max_seq_length": 32768,
        "prompts": {"web_search_query": _E5_QUERY,
                    "sts_query": "Instruct: Retrieve semantically similar text.\nQuery: ",
                    "summarization_query": "Instruct: Given a news summary, retrieve other semantically similar "
                                           "summaries\nQuery: "},
        "specials": {"<unk>": 0, "<s>": 1, "</s>": 2}, "wrap": ("<s>", "</s>"),
    },
    # Alibaba-NLP/gte-Qwen2-1.5B-instruct: Qwen2-1.5B, bidirectional (is_causal: false), last-token pooling,
    # normalised, instruction prompt for queries.
    "gte-qwen2-1.5b-instruct": {
        "config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151646,
                   "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                   "intermediate_size": 8960, "hidden_act": "silu", "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
                   "sliding_window": 131072, "max_window_layers": 21, "tie_word_embeddings": False,
                   "is_causal": False},
        "pooling": "last", "normalize": True, "max_seq_length": 32768,
        "prompts": {"query": _E5_QUERY, "document": ""},
        **_QWEN3_SPECIALS,
    },
    # google/embeddinggemma-300m: Gemma3 text, bidirectional, mean pooling, then the published pipeline's
    # two Dense modules (2_Dense 768 -> 3072, 3_Dense 3072 -> 768: no bias, Identity activation; random
    # weights written in their layout), normalised, task prompts.
    "embeddinggemma-300m": {
        "config": {"model_type": "gemma3_text", "architectures": ["Gemma3TextModel"], "vocab_size": 262144,
                   "hidden_size": 768, "num_hidden_layers": 24, "num_attention_heads": 3, "num_key_value_heads": 1,
                   "head_dim": 256, "intermediate_size": 1152, "hidden_activation": "gelu_pytorch_tanh",
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "rope_local_base_freq": 10000.0, "rope_scaling": None, "query_pre_attn_scalar": 256,
                   "sliding_window": 512, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                   "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(24)],
                   "use_bidirectional_attention": True, "attention_bias": False,
                   "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
        "pooling": "mean", "normalize": True, "max_seq_length": 2048, "dense": [[768, 3072], [3072, 768]],
        "prompts": {"query": "task: search result | query: ", "document": "title: none | text: ",
                    "Clustering": "task: clustering | query: ", "Classification": "task: classification | query: ",
                    "STS": "task: sentence similarity | query: "},
        "specials": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}, "wrap": ("<bos>", "<eos>"),
    },
})


_BERT_SPECIALS = {"specials": {"[PAD]": 0, "<unk>": 1, "[CLS]": 2, "[SEP]": 3}, "wrap": ("[CLS]", "[SEP]")}
_BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "pad_token_id": 0, "position_embedding_type": "absolute"}
PRESETS.update({
    # sentence-transformers/msmarco-distilbert-base-v4: DistilBERT base (6 layers), mean pooling, not normalised.
    "msmarco-distilbert": {"config": {"model_type": "distilbert", "architectures": ["DistilBertModel"], "vocab_size": 30522,
                                      "dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "activation": "gelu",
                                      "max_position_embeddings": 512, "sinusoidal_pos_embds": False, "pad_token_id": 0},
                           "pooling": "mean", "normalize": False, "max_seq_length": 512, **_BERT_SPECIALS},
    # sentence-transformers/all-mpnet-base-v2: MPNet base with its relative position bias, mean pooling, normalised.
    "all-mpnet-base-v2": {"config": {**_BERT_BASE, "model_type": "mpnet", "architectures": ["MPNetForMaskedLM"],
                                     "vocab_size": 30527, "max_position_embeddings": 514, "layer_norm_eps": 1e-5,
                                     "relative_attention_num_buckets": 32, "pad_token_id": 1, "bos_token_id": 0,
                                     "eos_token_id": 2},
                          "pooling": "mean", "normalize": True, "max_seq_length": 384, **_BERT_SPECIALS},
    # Alibaba-NLP/gte-modernbert-base: ModernBERT base (22 layers, every third global, 128-token local
    # window, rotary bases of ModernBERT-base), CLS pooling, normalised.
    "gte-modernbert-base": {"config": {"model_type": "modernbert", "architectures": ["ModernBertModel"],
                                       "vocab_size": 50368, "hidden_size": 768, "num_hidden_layers": 22,
                                       "num_attention_heads": 12, "intermediate_size": 1152, "hidden_activation": "gelu",
                                       "max_position_embeddings": 8192, "global_attn_every_n_layers": 3,
                                       "local_attention": 128, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
                                       "norm_eps": 1e-5, "norm_bias": False, "attention_bias": False, "mlp_bias": False,
                                       "pad_token_id": 50283, "cls_token_id": 50281, "sep_token_id": 50282,
                                       "classifier_pooling": "cls"},
                            "pooling": "cls", "normalize": True, "max_seq_length": 8192, **_BERT_SPECIALS},
    # sentence-transformers/sentence-t5-base: T5-base's encoder (v1.0: ReLU), mean pooling, its Dense module
    # (768 -> 768, no bias, Identity), normalised; the byte-level stand-in ends a text with </s> as T5's does.
    "sentence-t5-base": {"config": {"model_type": "t5", "architectures": ["T5EncoderModel"], "vocab_size": 32128,
                                    "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12, "num_heads": 12,
                                    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                                    "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "n_positions": 512,
                                    "pad_token_id": 0, "eos_token_id": 1},
                         "pooling": "mean", "normalize": True, "max_seq_length": 256, "dense": [[768, 768]],
                         "specials": {"<pad>": 0, "</s>": 1, "<unk>": 2}, "wrap": (None, "</s>")},
    # nomic-ai/nomic-embed-text-v1.5: NomicBERT (its published GPT-2 style config), mean pooling, normalised,
    # search_query / search_document prompts.
    "nomic-embed-text-v1.5": {"config": {"model_type": "nomic_bert", "architectures": ["NomicBertModel"],
                                         "vocab_size": 30528, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_inner": 3072,
                                         "n_positions": 8192, "max_trained_positions": 2048, "rotary_emb_base": 1000,
                                         "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                                         "rotary_scaling_factor": None, "activation_function": "swiglu",
                                         "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
                                         "prenorm": False, "layer_norm_epsilon": 1e-12, "type_vocab_size": 2},
                              "pooling": "mean", "normalize": True, "max_seq_length": 8192,
                              "prompts": {"query": "search_query: ", "document": "search_document: "}, **_BERT_SPECIALS},
    # naver/splade-cocondenser-ensembledistil: BertForMaskedLM (BERT base), SPLADE max pooling over the vocabulary.
    "splade-cocondenser": {"config": {**_BERT_BASE, "model_type": "bert", "architectures": ["BertForMaskedLM"]},
                           "pooling": "splade", "normalize": False, "max_seq_length": 512, **_BERT_SPECIALS},
})


# Alibaba-NLP/gte-reranker-modernbert-base: a cross-encoder, ModernBertForSequenceClassification over
# gte-modernbert-base's shapes, one label (CrossEncoder applies Sigmoid); the head as transformers
# defaults it (gelu, no bias) on the mean of the tokens (`classifier_pooling`, as ModernBERT-base's
# config.json; not checked against the reranker's own); no sentence-transformers files; the
# stand-in tokenizer pairs as BERT does (`[CLS] q [SEP] d [SEP]`, the document typed 1).
PRESETS["gte-reranker-modernbert-base"] = {
    "config": {**PRESETS["gte-modernbert-base"]["config"], "architectures": ["ModernBertForSequenceClassification"],
               "classifier_pooling": "mean", "classifier_activation": "gelu", "classifier_bias": False,
               "classifier_dropout": 0.0, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}},
    "cross_encoder": True, "max_seq_length": 8192, **_BERT_SPECIALS}

# mixedbread-ai/mxbai-rerank-base-v1: DeBERTa-v3-base as DebertaV2ForSequenceClassification, one label
# (CrossEncoder's Sigmoid): relative attention with 256 log buckets, shared position keys, normalised
# relative embeddings, no absolute positions or token types, the pooler's GELU; 512 tokens. The stand-in
# pairs as BERT's template does.
PRESETS["mxbai-rerank-base-v1"] = {
    "config": {"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"],
               "vocab_size": 128100, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512,
               "relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 256,
               "max_relative_positions": -1, "norm_rel_ebd": "layer_norm", "share_att_key": True,
               "position_biased_input": False, "type_vocab_size": 0, "layer_norm_eps": 1e-7,
               "pooler_hidden_size": 768, "pooler_hidden_act": "gelu", "pooler_dropout": 0,
               "pad_token_id": 0, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}},
    "cross_encoder": True, "max_seq_length": 512, **_BERT_SPECIALS}


# Two-tower image-text models in the transformers layout as published (config.json, preprocessor_config.json, the
# tokenizer's limit; no sentence-transformers files): text through the text step, pixels through
# `Engine.step_images` (normalised as preprocessor_config.json says). The stand-in tokenizer is byte-level.
# openai/clip-vit-base-patch16: ViT-B/16 at 224 x 224 (196 patches + the class token), a 12-layer causal text tower
# of width 512, both projected to 512; its config's eos_token_id 2 (pooling at each text's highest id, as
# transformers does for such configs).
PRESETS["clip-vit-base-patch16"] = {
    "config": {"model_type": "clip", "architectures": ["CLIPModel"], "projection_dim": 512,
               "logit_scale_init_value": 2.6592, "initializer_factor": 1.0,
               "text_config": {"model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 512,
                               "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8,
                               "max_position_embeddings": 77, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
                               "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "projection_dim": 512},
               "vision_config": {"model_type": "clip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
                                 "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3,
                                 "image_size": 224, "patch_size": 16, "hidden_act": "quick_gelu",
                                 "layer_norm_eps": 1e-5, "projection_dim": 512}},
    "image_processor": {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                        "feature_extractor_type": "CLIPFeatureExtractor",
                        "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224},
    "max_seq_length": 77, "specials": {"<|startoftext|>": 0, "<|endoftext|>": 1, "<unk>": 2},
    "wrap": ("<|startoftext|>", "<|endoftext|>"),
}
# google/siglip-base-patch16-224: ViT-B/16 at 224 x 224 (196 patches, no class token, the attention-pooling head),
# a 12-layer bidirectional text tower of width 768 pooled at its last token (64 positions) through its head.
PRESETS["siglip-base-patch16-224"] = {
    "config": {"model_type": "siglip", "architectures": ["SiglipModel"], "initializer_factor": 1.0,
               "text_config": {"model_type": "siglip_text_model", "vocab_size": 32000, "hidden_size": 768,
                               "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                               "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                               "layer_norm_eps": 1e-6, "pad_token_id": 1},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
                                 "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3,
                                 "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                                 "layer_norm_eps": 1e-6}},
    "image_processor": {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                        "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5],
                        "processor_class": "SiglipProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
                        "size": {"height": 224, "width": 224}},
    "max_seq_length": 64, "specials": {"<pad>": 0, "</s>": 1, "<unk>": 2}, "wrap": (None, "</s>"),
}


def cache_dir() -> Path:
    return cache_root() / "presets"


# The real model each preset has the shapes of, by its Hugging Face Hub id (the bare preset name's error
# offers it beside `preset:NAME`; from the comments above).
HUB_IDS = {
    "bge-m3": "BAAI/bge-m3", "bge-reranker-v2-m3": "BAAI/bge-reranker-v2-m3",
    "pplx-embed-1-0.6b": "perplexity-ai/pplx-embed-v1-0.6b", "pplx-embed-1-4b": "perplexity-ai/pplx-embed-v1-4b",
    "qwen3-embedding-0.6b": "Qwen/Qwen3-Embedding-0.6B", "qwen3-reranker-0.6b": "Qwen/Qwen3-Reranker-0.6B",
    "e5-mistral-7b-instruct": "intfloat/e5-mistral-7b-instruct",
    "gte-qwen2-1.5b-instruct": "Alibaba-NLP/gte-Qwen2-1.5B-instruct",
    "embeddinggemma-300m": "google/embeddinggemma-300m",
    "msmarco-distilbert": "sentence-transformers/msmarco-distilbert-base-v4",
    "all-mpnet-base-v2": "sentence-transformers/all-mpnet-base-v2",
    "gte-modernbert-base": "Alibaba-NLP/gte-modernbert-base",
    "sentence-t5-base": "sentence-transformers/sentence-t5-base",
    "nomic-embed-text-v1.5": "nomic-ai/nomic-embed-text-v1.5",
    "splade-cocondenser": "naver/splade-cocondenser-ensembledistil",
    "gte-reranker-modernbert-base": "Alibaba-NLP/gte-reranker-modernbert-base",
    "mxbai-rerank-base-v1": "mixedbread-ai/mxbai-rerank-base-v1",
    "clip-vit-base-patch16": "openai/clip-vit-base-patch16", "siglip-base-patch16-224": "google/siglip-base-patch16-224",
}


def stand_in_tokenizer(specials: dict[str, int], wrap: tuple[str | None, str], path: Path, pair: bool = False) -> None:
    """A byte-level tokenizer (one token per UTF-8 byte) wrapped in `wrap` (first may be None); with
    `pair` (a cross-encoder's), pairs as BERT's template builds them: `first $A last $B:1 last:1`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = dict(specials)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(specials))  # listed as special in tokenizer.json, as real tokenizers do
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    first, last = wrap
    single = f"{first} $A {last}" if first else f"$A {last}"
    pairs = {"pair": f"{single} $B:1 {last}:1"} if pair else {}
    tok.post_processor = processors.TemplateProcessing(
        single=single, **pairs, special_tokens=[(t, specials[t]) for t in (first, last) if t])
    tok.save(str(path))


def fingerprint(name: str) -> str:
    """Identifies what `materialize(name)` writes: the preset's definition and FORMAT."""
    return hashlib.sha256(json.dumps([FORMAT, PRESETS[name]], sort_keys=True).encode()).hexdigest()[:16]


def _dense_module(d: Path, index: int, in_features: int, out_features: int) -> dict:
    """`{index}_Dense/` as sentence-transformers saves a Dense module without bias and with the Identity
    activation (config.json, model.safetensors: `linear.weight` [out, in], float32), its weights
    seeded random ~ N(0, 1 / in_features); its modules.json entry."""
    import numpy as np
    from safetensors.numpy import save_file

    mdir = d / f"{index}_Dense"
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "config.json").write_text(json.dumps(
        {"in_features": in_features, "out_features": out_features, "bias": False,
         "activation_function": "torch.nn.modules.linear.Identity"}, indent=2))
    rng = np.random.default_rng(index)
    w = rng.standard_normal((out_features, in_features), dtype=np.float32) / np.float32(np.sqrt(in_features))
    save_file({"linear.weight": w}, str(mdir / "model.safetensors"), metadata={"format": "pt"})
    return {"idx": index, "name": str(index), "path": mdir.name, "type": "sentence_transformers.models.Dense"}


def _sentence_transformers_files(p: dict, d: Path) -> None:
    """modules.json, the pooling (and Dense / Normalize / quantizer) modules, sentence_bert_config.json, prompts."""
    splade = p["pooling"] == "splade"  # sentence-transformers' SparseEncoder layout
    pool_dir = d / ("1_SpladePooling" if splade else "1_Pooling")
    pool_dir.mkdir(parents=True, exist_ok=True)
    kinds = ("sparse_encoder.models.MLMTransformer", "sparse_encoder.models.SpladePooling") if splade else \
        ("models.Transformer", "models.Pooling")
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"sentence_transformers.{kinds[0]}"},
               {"idx": 1, "name": "1", "path": pool_dir.name, "type": f"sentence_transformers.{kinds[1]}"}]
    for shape in p.get("dense", ()):
        modules.append(_dense_module(d, len(modules), *shape))
    if p["normalize"]:
        i = len(modules)
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    if p.get("quantizer"):  # as pplx-embed-v1's modules.json lists it (its code is the repo's st_quantize.py)
        modules.append({"idx": 2, "name": "2", "path": "", "type": "st_quantize.FlexibleQuantizer",
                        "kwargs": ["quantization"]})
    (d / "modules.json").write_text(json.dumps(modules, indent=2))
    mode = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    (pool_dir / "config.json").write_text(json.dumps(
        {"pooling_strategy": "max", "activation_function": "relu"} if splade else
        {"word_embedding_dimension": hidden_width(p["config"]), mode[p["pooling"]]: True}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": p["max_seq_length"]}))
    if p.get("prompts"):
        (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": p["prompts"]}, indent=2))


def _logit_score_files(p: dict, d: Path) -> None:
    """A causal-LM reranker's sentence-transformers 6 files: modules.json (Transformer, LogitScore), the
    Transformer's text-generation task taking messages, the LogitScore ids (of the stand-in's bytes
    `p["logit_score"]`), Sigmoid, the chat template, and the tokenizer's limit and end token."""
    from tokenizers import pre_tokenizers

    ids = {ch: len(p["specials"]) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    true, false = (ids[c] for c in p["logit_score"])
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore",
         "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}], indent=2))
    forward = {"method": "forward", "method_output_name": "logits"}
    (d / "sentence_bert_config.json").write_text(json.dumps(
        {"transformer_task": "text-generation", "modality_config": {"text": forward, "message": {**forward, "format": "flat"}},
         "module_output_name": "causal_logits"}, indent=2))
    (d / "1_LogitScore").mkdir(exist_ok=True)
    (d / "1_LogitScore" / "config.json").write_text(json.dumps(
        {"true_token_id": true, "false_token_id": false, "module_input_name": "causal_logits"}, indent=2))
    (d / "config_sentence_transformers.json").write_text(json.dumps(
        {"activation_fn": "torch.nn.modules.activation.Sigmoid", "model_type": "CrossEncoder", "prompts": {},
         "default_prompt_name": None}, indent=2))
    (d / "chat_template.jinja").write_text(p["chat_template"])
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": p["max_seq_length"],
         "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "padding_side": "left"}, indent=2))


def materialize(name: str) -> Path:
    """Write (once per definition: a cache written by an older definition is rewritten) and return
    the directory of preset `name`."""
    p = PRESETS[name]
    d = cache_dir() / name
    marker = d / RANDOM_WEIGHTS
    fp = fingerprint(name)
    if marker.is_file() and fp in marker.read_text():
        return d
    d.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(d) + ".lock"):  # processes sharing a cache (test workers, Tulips) write it once
        if marker.is_file() and fp in marker.read_text():
            return d
        marker.unlink(missing_ok=True)
        _write(name, p, d)
        marker.write_text(f"preset {name} ({fp}): random weights, stand-in tokenizer; its outputs are meaningless\n")
    return d


def _write(name: str, p: dict, d: Path) -> None:
    """The preset's files but its marker."""
    (d / "config.json").write_text(json.dumps(p["config"], indent=2))
    if p.get("cross_encoder") and p.get("tokenizer") == "xlm-r-unigram":
        # a transformers classifier as published: the tokenizer's limit, no pipeline
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": p["max_seq_length"], "bos_token": "<s>",
             "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
             "mask_token": "<mask>"}, indent=2))
    elif p.get("logit_score"):
        _logit_score_files(p, d)
    elif p.get("image_processor"):  # a two-tower image-text model: the transformers layout, no pipeline
        (d / "preprocessor_config.json").write_text(json.dumps(p["image_processor"], indent=2))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": p["max_seq_length"]}, indent=2))
    elif p.get("cross_encoder"):  # the byte-level stand-in (BERT specials); no token type ids, as ModernBERT's
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": p["max_seq_length"],
             "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "<unk>",
             "model_input_names": ["input_ids", "attention_mask"]}, indent=2))
    else:
        _sentence_transformers_files(p, d)
    if p.get("tokenizer") == "xlm-r-unigram":
        from presets import standin

        standin.build(d)
    else:
        stand_in_tokenizer(p["specials"], p["wrap"], d / "tokenizer.json", pair=bool(p.get("cross_encoder")))
