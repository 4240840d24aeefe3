"""The attention backends by name, torch-free: what `--attention` chooses among besides "auto", so that
Tulip's config checks a choice without loading torch. The backends themselves, and which of them runs
where, are `rose.layers.attention`'s (`select_backend`)."""

BACKENDS = ("sdpa", "padded", "varlen", "fa4", "flashinfer-fa2", "flashinfer-fa3", "triton")

# `--quantization`'s choices (`EngineConfig.quantization`; the fp8 path is `rose.layers.fp8`'s, "auto" follows the
# checkpoint: fp8 for one published in fp8, `rose.layers.fp8_checkpoint`), torch-free alike
QUANTIZATIONS = ("none", "fp8", "auto")
