"""The contract every model family implements.

A family is one `nn.Module` subclass in its own file (Hugging Face names), registered by its
config.json `model_type` in `rose.models`. Everything that differs between families lives on
it: the loader's name map, the default pooling, where positions start, the head shape, causal
or bidirectional attention, its small-batch path. `rose.loader` and `rose.engine` read these
and nothing else; adding a family is one model file, one registry line and its tests.

Class-level rules (read before the model is built, from config.json alone):
    strip_prefixes   checkpoint key prefixes removed before matching ("bert.", "model.").
    ignored          keys matching this pattern are skipped (position_ids buffers, poolers, lm heads).
    stacked_params   checkpoint sub-name -> (our sub-name, shard index): tensors stacked along dim 0
                     into one parameter (q/k/v into qkv); shards are equal unless `stacked_rows` says.
    default_pooling(config)   pooling without a Pooling module ("cls", "mean" or "last").
    position_offset(config)   added to 0-based positions (XLM-RoBERTa numbers from pad_token_id + 1).
    max_positions(config)     the longest sequence the architecture numbers.
    head_shape(config)        (query heads, key/value heads, head dim) for the attention backend.
    is_causal(config)         causal attention (decoders used as such) or bidirectional.
    serving(spec)             the directory's `ModelSpec` completed with the above.
    classifier_architectures  config.json `architectures` this family serves as a cross-encoder (a
                     `*ForSequenceClassification` head: one score per query-document pair, or num_labels);
                     empty: embeddings only. (A causal LM scored through sentence-transformers' LogitScore
                     needs none: `rose.layers.scores.LogitScore` reads its LM head.)
    num_labels(config)        the head's outputs per sequence for such a directory; 0 for an embedding model.
    classifier_pooling(config)  which state of each sequence the head reads: "cls" (the first token, the
                     default), "mean" (every token of the sequence; ModernBERT's `classifier_pooling`) or
                     "last" (decoders' `*ForSequenceClassification`).
    standard_config(config)   config.json with Hugging Face's usual key names added where the family's
                     config uses its own (DistilBERT's `dim`, NomicBERT's GPT-2 style `n_embd`), so
                     the rest of the stack reads `hidden_size`, `vocab_size`, ... alike.
    output_dim(config)        width of a sequence's output vector (hidden size; SPLADE: the vocabulary).
    vocab_output(config)      the output's coordinates are vocabulary ids (SPLADE): its nonzero entries
                     are the model's sparse output (`rose.extras.vocab_weights`).
    score_bias       the family adds a bias to the attention scores (MPNet's relative position bias,
                     `AttentionMetadata.bias`): only backends that take one (`takes_bias`: sdpa, padded, triton) can
                     run it; "auto" picks one and any other backend is a ValueError.
    sequence_bias    the family's score bias differs per sequence ([N, heads, L, L]: DeBERTa's disentangled
                     attention, which depends on each sequence's content): only `sdpa` and `padded` take it;
                     "auto" picks `padded` on CUDA (capturable), `sdpa` elsewhere.
    sliding_window(config)    the widest window of its sliding-window layers (a query sees keys at
                     distance < w, `AttentionMetadata.window`; 0: none): where sequences can exceed it,
                     backends without a window (`windowed`) hand those layers to one that has one.

Instance side:
    blocks           the repeated layers (compiled one by one with `Engine(compile=True)`).
    forward(input_ids, positions, meta, attn, token_type_ids=None, rows=None) -> hidden [T, hidden]:
                     positions are 0-based; the family adds its offset. `rows` (int64 [N] on the device,
                     `rose.layers.pooling.kept_rows`: the one state per sequence that CLS or last-token
                     pooling reads) makes the last block compute those rows alone after its attention
                     (which still reads every token): hidden [N, hidden] then (`last_only`, `keep_rows`). `token_type_ids` (int64 [T], on the device)
                     come only for cross-encoders whose batch has a second segment (`rose.batch.Batch`'s
                     `segment_starts`; `rose.layers.scores.token_types`); None means every token is type 0.
    classify(pooled) -> logits [N, num_labels]: families with `classifier_architectures` define it (built when
                     num_labels > 0): the classification head on each sequence's state pooled by
                     `classifier_pooling` [N, hidden], in the model's dtype (BERT:
                     pooler dense + tanh, then `classifier`); checkpoint names as Hugging Face's. A head
                     that uses tensors the embedding model skips (BERT's pooler) sets `ignored` on the
                     instance (the loader reads the instance's).
    pool(hidden, cu_seqlens, seq_ids) -> [N, output_dim] or None   a family whose output is not a pooled
                     hidden state (SPLADE) computes it here, on the device; None: the engine pools.
    use_kernels(max_tokens) -> int   route steps of up to that many tokens through the family's
                     small-batch path in `rose.kernels`; returns the cap it took (0: none).
    stacked_rows(name), materialize(device)   see below.
    pool_rows(input_ids, cu_seqlens, seq_ids) -> int64 [N]   optional: the one row per sequence its pooling
                     reads, found on the device from the ids (CLIP: the end-of-text token, as transformers finds
                     it); the engine then passes them as `rows` instead of its pooling mode's `kept_rows`.
    project(pooled) -> [N, output_dim]   optional: the text tower's head after pooling, before any Dense
                     module and Normalize (CLIP's `text_projection`, SigLIP's `text_model.head`).

Image towers (CLIP, SigLIP: a text tower served by the text step beside a vision tower; read from config.json):
    image_size(config)        the square side S in pixels the vision tower takes (0: no image tower).
    image_tokens(config)      rows of token states per image (patches, plus a class token where it has one):
                     what an image costs the scheduler's token budget.
    image_head_shape(config)  the vision tower's (heads, kv heads, head dim), for its attention backend.
    image_processor           ClassVar: the image processor's defaults (image_mean, image_std, rescale_factor),
                     where preprocessor_config.json leaves them out (`rose.images.ImageProcessing`).
    embed_images(pixels, meta, attn) -> [N, output_dim]   normalised pixels [N, C, S, S] in the model's dtype
                     (flat [N * image_tokens] token states inside, `meta` every image its own sequence) ->
                     the image features as `get_image_features` computes them (not L2-normalised).
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import ClassVar

import torch
from torch import nn

from trellis.modeldir import ModelSpec


def last_only(blocks, rows: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The rows each of `blocks` keeps, in order: every row (None) but in the last, `rows`
    (`Family.forward`'s)."""
    return [None] * (len(blocks) - 1) + [rows]


class Family(nn.Module, metaclass=abc.ABCMeta):
    strip_prefixes: ClassVar[tuple[str, ...]] = ()
    ignored: ClassVar[re.Pattern | None] = None
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {}
    classifier_architectures: ClassVar[frozenset[str]] = frozenset()

    score_bias: ClassVar[bool] = False
    sequence_bias: ClassVar[bool] = False

    causal = False  # set from is_causal(config) by families that can be causal
    kernel_tokens = 0  # steps of up to this many tokens take the small path (set by use_kernels)

    @classmethod
    def default_pooling(cls, config: dict) -> str:
        return "cls"

    @classmethod
    def position_offset(cls, config: dict) -> int:
        return 0

    @classmethod
    def max_positions(cls, config: dict) -> int:
        return int(config.get("max_position_embeddings", 512)) - cls.position_offset(config)

    @classmethod
    def head_shape(cls, config: dict) -> tuple[int, int, int]:
        h = int(config["num_attention_heads"])
        return h, int(config.get("num_key_value_heads") or h), int(config.get("head_dim") or config["hidden_size"] // h)

    @classmethod
    def is_causal(cls, config: dict) -> bool:
        return False

    @classmethod
    def num_labels(cls, config: dict) -> int:
        """Outputs per sequence of the directory's classification head (`classifier_architectures`),
        as transformers counts them (id2label, else num_labels); 0: not a cross-encoder."""
        if not set(config.get("architectures") or ()) & cls.classifier_architectures:
            return 0
        return len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))

    @classmethod
    def classifier_pooling(cls, config: dict) -> str:
        return "cls"

    @classmethod
    def sliding_window(cls, config: dict) -> int:
        return 0

    @classmethod
    def standard_config(cls, config: dict) -> dict:
        return config

    @classmethod
    def output_dim(cls, config: dict) -> int:
        return int(config["hidden_size"])

    @classmethod
    def vocab_output(cls, config: dict) -> bool:
        return False

    @classmethod
    def serving(cls, spec: ModelSpec) -> ModelSpec:
        """`spec` with the family's defaults where the directory is silent, and its sequence limit
        capped by the positions the architecture numbers."""
        config = cls.standard_config(spec.config)
        return dataclasses.replace(
            spec, config=config, pooling=spec.pooling or cls.default_pooling(config),
            max_seq_len=min(spec.max_seq_len, cls.max_positions(config)))

    @property
    @abc.abstractmethod
    def blocks(self) -> nn.ModuleList: ...

    def stacked_rows(self, name: str) -> tuple[int, ...]:
        """Row counts of the checkpoint tensors stacked into parameter `name`; equal by default."""
        dsts = [d for d, _ in self.stacked_params.values()]
        dst = next(d for d in dsts if d in name)
        n = dsts.count(dst)
        return (self.get_parameter(name).shape[0] // n,) * n

    def materialize(self, device: torch.device) -> None:
        """Fill non-persistent buffers (e.g. rotary tables), which checkpoints do not hold."""

    def pool(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor | None:
        return None

    def use_kernels(self, max_tokens: int) -> int:
        return 0

    image_processor: ClassVar[dict] = {}

    @classmethod
    def image_size(cls, config: dict) -> int:
        return 0

    @classmethod
    def image_tokens(cls, config: dict) -> int:
        return 0

    @classmethod
    def image_head_shape(cls, config: dict) -> tuple[int, int, int]:
        raise ValueError(f"{cls.__name__} has no image tower")
