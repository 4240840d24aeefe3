"""Tiny random encoder checkpoints (DistilBERT, RoBERTa, CamemBERT, DeBERTa-v2 / v3, T5's encoder, MPNet, ModernBERT, NomicBERT, SPLADE) saved by
transformers in their published layouts, each with a small WordPiece tokenizer and the
sentence-transformers files their published models carry; the builders return the
sentence-transformers model (SentenceTransformer, or SparseEncoder for SPLADE) as the reference."""

import string

import torch

# BERT-style specials; id 1 is never a real token (MPNet's transformers reference numbers positions
# by treating id 1 as padding), [UNK] sits after the specials.
SPECIALS = ["[PAD]", "[unused1]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]
WORDS = ["the", "of", "and", "is", "to", "in", "what", "how", "search", "query", "document", "capital"]
PROMPTS = {"query": "search_query: ", "document": "search_document: "}
VOCAB = 500


def save_tokenizer(path) -> None:
    """A lower-casing WordPiece tokenizer whose vocabulary covers every ASCII character (so the
    test texts rarely hit [UNK]), wrapping [CLS] ... [SEP]; saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation + "äöüßéèàç"))
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + chars + ["##" + c for c in chars])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=256)
    fast.save_pretrained(str(path))


def _sentence_transformer(path, pooling: str, normalize: bool, prompts: dict | None = None):
    from sentence_transformers import SentenceTransformer, models

    t = models.Transformer(str(path), max_seq_length=256)
    mods = [t, models.Pooling(t.get_word_embedding_dimension(), pooling)]
    if normalize:
        mods.append(models.Normalize())
    st = SentenceTransformer(modules=mods, device="cpu", prompts=prompts or {})
    st.save(str(path))
    return st.eval()


def _spread(model, std: float = 0.15) -> None:
    """Weights large enough that attention is peaked and texts get distinct vectors (transformers'
    init, std 0.02, leaves a tiny model's outputs nearly equal for every input, where a parity test
    would pass whatever the attention did); norm scales stay 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            elif name.endswith("bias") and "norm" not in name.lower():
                p.normal_(0.0, 0.05)


def _save(model, path):
    _spread(model)
    model.eval().save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return path


def save_distilbert(path, seed: int = 0):
    """msmarco-distilbert-base-v4's layout: DistilBertModel, mean pooling, not normalised."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                        max_position_embeddings=256, pad_token_id=0)
    _save(transformers.DistilBertModel(cfg), path)
    return _sentence_transformer(path, "mean", False)


def save_roberta(path, seed: int = 0, family: str = "roberta"):
    """all-distilroberta-v1's layout: RobertaModel (or CamembertModel: `family` "camembert"), positions
    from pad_token_id + 1 = 2, mean pooling, normalised."""
    import transformers

    torch.manual_seed(seed)
    prefix = {"roberta": "Roberta", "camembert": "Camembert"}[family]
    cfg = getattr(transformers, f"{prefix}Config")(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=128,
                                                   max_position_embeddings=258, pad_token_id=1, type_vocab_size=1)
    _save(getattr(transformers, f"{prefix}Model")(cfg, add_pooling_layer=False), path)
    return _sentence_transformer(path, "mean", True)


def save_t5(path, seed: int = 0, gated: bool = False):
    """sentence-t5-base's layout (T5EncoderModel with ReLU, T5 v1.0) or, `gated`, gtr-t5-base's (gated-GELU,
    T5 v1.1): mean pooling, a Dense module (no bias, Identity; 768 -> 768 published, 64 -> 48 here),
    Normalize, saved by sentence-transformers. Relative position buckets over 8 distances so the test texts
    reach the logarithmic ones."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=16, relative_attention_max_distance=24,
                                feed_forward_proj="gated-gelu" if gated else "relu")
    _save(transformers.T5EncoderModel(cfg), path)
    t = models.Transformer(str(path), max_seq_length=256)
    mods = [t, models.Pooling(64, "mean"), models.Dense(64, 48, bias=False, activation_function=torch.nn.Identity()),
            models.Normalize()]
    st = SentenceTransformer(modules=mods, device="cpu")
    st.save(str(path))
    return st.eval()


def save_deberta_v2(path, seed: int = 0, v3: bool = True):
    """DeBERTa-v3's layout (deberta-v3-base: relative attention p2c|c2p with shared keys, log buckets,
    normalised relative embeddings, no absolute positions or token types), or with `v3` false v2's
    (own position projections, absolute positions too, token types); mean pooling, normalised. 16
    buckets so the test texts reach the logarithmic ones."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=-1,
              norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False, type_vocab_size=0) if v3 else \
        dict(relative_attention=True, pos_att_type="p2c|c2p", position_buckets=-1, max_relative_positions=32,
             share_att_key=False, position_biased_input=True, type_vocab_size=2)
    cfg = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=256, pad_token_id=0, **kw)
    _save(transformers.DebertaV2Model(cfg), path)
    return _sentence_transformer(path, "mean", True)


def save_mpnet(path, seed: int = 0):
    """all-mpnet-base-v2's layout: MPNetModel, mean pooling, normalised."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=258, pad_token_id=1)
    model = transformers.MPNetModel(cfg)
    _save(model, path)  # the relative position bias (buckets x heads) gets std 0.15 like every matrix
    return _sentence_transformer(path, "mean", True)


def save_modernbert(path, seed: int = 0, pooling: str = "cls", prompts: dict | None = None):
    """gte-modernbert-base's layout (CLS, normalised) or, with pooling "mean" and prompts,
    modernbert-embed-base's. Three layers (global, local, global), a 16-token window (|i - j| <= 8)
    so the test texts are longer than it."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=256, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, global_rope_theta=160000.0,
        local_rope_theta=10000.0, classifier_pooling=pooling)
    _save(transformers.ModernBertModel(cfg), path)
    return _sentence_transformer(path, pooling, True, prompts)


def save_nomic_bert(path, seed: int = 0):
    """nomic-embed-text-v1.5's layout: NomicBertModel (the published parameter names), mean pooling,
    normalised, "search_query: " / "search_document: " prompts."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NomicBertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=256)
    _save(transformers.NomicBertModel(cfg), path)
    return _sentence_transformer(path, "mean", True, PROMPTS)


def save_splade(path, seed: int = 0, distilbert: bool = False):
    """naver/splade-cocondenser-ensembledistil's architecture (BertForMaskedLM), or with `distilbert`
    naver/splade_v2_distil's (DistilBertForMaskedLM), in sentence-transformers' SparseEncoder layout
    (MLMTransformer + SpladePooling max / relu)."""
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    torch.manual_seed(seed)
    if distilbert:
        model = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=256, pad_token_id=0))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=256))
    _save(model, path)
    enc = SparseEncoder(modules=[MLMTransformer(str(path), max_seq_length=256), SpladePooling("max")], device="cpu")
    enc.save(str(path))
    return enc.eval()
