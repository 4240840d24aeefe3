"""Checkpoints published in fp8 (issue 52), read as they are: config.json's `quantization_config` names the
layout, the loader (`rose.loader.load_weights`) reads each float8 e4m3 weight through `Fp8Reader`.

Layouts read (each learnt from its writer; the tests write the first with compressed-tensors itself):
- `compressed-tensors` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes), format "float-quantized" or
  "naive-quantized", quantization_status "compressed": `X.weight` e4m3 and `X.weight_scale` in the model's
  dtype (bf16 as a rule), [N, 1] for strategy "channel", [1] for "tensor", [N/bn, K/bk] for "block" (the weight
  padded to whole blocks where `X.weight_shape_original` says so); `X.input_scale` [1] for static activations;
  symmetric zero points are not stored (an all-zero one is accepted); `ignore`d modules stay in bf16.
- `fbgemm_fp8` (transformers' FbgemmFp8Config, Meta's Llama 3.1 FP8): `X.weight` e4m3, `X.weight_scale` float32
  [N, 1]; `modules_to_not_convert` stay in bf16.
- `fp8` (transformers' FineGrainedFP8Config, DeepSeek-V3 style): `X.weight` e4m3, `X.weight_scale_inv` float32
  (or UE8M0) [ceil(N/bn), ceil(K/bk)] for `weight_block_size` [bn, bk], a scalar without one; value = q * scale.

What the engine makes of them (`Engine`: `resolve` picks the quantization, `Fp8Reader.given` feeds
`Fp8Blocks.use_fp8`): every fp8 weight is dequantised once at load (q * scale in float32, one rounding to the
engine's dtype) into the bf16 parameter that small steps and the bf16 blocks read; the fp8 path's GEMMs take the
checkpoint's e4m3 codes and scales AS THEY ARE where the scales are per channel or per tensor (a tensor's scale
broadcast to its channels, which also stacks q/k/v with three different per-tensor scales exactly). Not used as is:
block-wise scales (ROSE's GEMM takes one scale per channel: such weights are requantised per channel from their
dequantised bf16, as `--quantization fp8` quantises a bf16 checkpoint), a stacked GEMM whose parts the checkpoint
quantised only in part, and the fp8 path's projections the checkpoint left in bf16 (`ignore`,
`modules_to_not_convert`): ROSE quantises those per channel, logged. Activations always get ROSE's own dynamic
per-row scales: a static `input_scale` and FBGEMM's `activation_scale_ub` are read past, not applied.
Anything else (int8 / int4 compressed-tensors, AWQ, GPTQ, bitsandbytes, e5m2, transforms, sparsity, a KV-cache
scheme) is refused at load naming the quant_method and the setting, never read into garbage.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
# a quantised weight's companions: read with it (or checked, or read past), never loaded as parameters
COMPANIONS = frozenset({"weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape_original",
                        "input_scale", "input_zero_point", "activation_scale"})
SCALES = ("weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class Fp8Format:
    """An fp8 checkpoint's layout, from config.json's `quantization_config`.

    method: its quant_method ("compressed-tensors", "fbgemm_fp8", "fp8").
    scheme: what its weights and activations are, in words (the engine's log line).
    block:  block-wise weight scales' block (rows, columns); None: per channel or per tensor.
    """

    method: str
    scheme: str
    block: tuple[int, int] | None = None


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"checkpoint quantization_config (quant_method {method!r}): {what} is not supported; ROSE reads "
                      "fp8 e4m3 checkpoints (compressed-tensors float-quantized 8-bit float weights per channel, "
                      "per tensor or block-wise; fbgemm_fp8; transformers' fp8): serve the bf16 model instead")


def _compressed_tensors(qc: dict) -> Fp8Format:
    m = "compressed-tensors"
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(m, f"quantization_status {qc.get('quantization_status')!r} (weights not stored compressed)")
    for key in ("transform_config", "sparsity_config", "kv_cache_scheme"):
        if qc.get(key):  # rotations change the weights; sparse layouts and KV-cache scales are other formats
            raise _refuse(m, f"{key} {qc[key]!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(m, "no config_groups")
    strategies, blocks = set(), set()
    for name, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(m, f"config group {name!r}: format {fmt!r}")
        w = g.get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        if (bits, kind) != (8, "float"):
            raise _refuse(m, f"config group {name!r}: {bits}-bit {kind} weights")
        if strategy not in ("channel", "tensor", "block") or not w.get("symmetric", True):
            raise _refuse(m, f"config group {name!r}: weights of strategy {strategy!r}"
                             f"{'' if w.get('symmetric', True) else ', asymmetric'}")
        if strategy == "block":
            blocks.add(tuple(w.get("block_structure") or ()))
        a = g.get("input_activations")
        if a and (a.get("num_bits"), a.get("type")) != (8, "float"):
            raise _refuse(m, f"config group {name!r}: {a.get('num_bits')}-bit {a.get('type')} activations")
        if g.get("output_activations"):
            raise _refuse(m, f"config group {name!r}: quantised output activations")
        strategies.add(strategy if strategy != "block" else f"block {'x'.join(map(str, w.get('block_structure')))}")
        acts = "none (weight-only)" if not a else \
            f"{'dynamic' if a.get('dynamic') else 'static'} per {a.get('strategy')}"
    if len(blocks) > 1 or any(len(b) != 2 for b in blocks):
        raise _refuse(m, f"block structures {sorted(blocks)}")
    return Fp8Format(m, f"weights per {' / '.join(sorted(strategies))}, activations {acts} (ROSE: dynamic per row)",
                     next(iter(blocks)) if blocks else None)


def read_format(config: dict) -> Fp8Format | None:
    """config.json's fp8 layout; None for a checkpoint without `quantization_config`. ValueError naming the
    quant_method for any other quantisation."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        return Fp8Format(method, "weights per channel, activations dynamic per row (activation_scale_ub not applied)")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if qc.get("scale_fmt", "float") not in ("float", "ue8m0") or (block is not None and len(block) != 2):
            raise _refuse(method, f"scale_fmt {qc.get('scale_fmt')!r}, weight_block_size {block!r}")
        return Fp8Format(method, f"weights per {'block ' + 'x'.join(map(str, block)) if block else 'tensor'}, "
                                 f"activations {qc.get('activation_scheme', 'dynamic')} (ROSE: dynamic per row)",
                         tuple(block) if block else None)
    raise _refuse(method, f"quant_method {method!r}")


def resolve(quantization: str, dtype: str, fmt: Fp8Format | None, family, device: torch.device) -> str:
    """The engine's quantization: "auto" is "fp8" for an fp8 checkpoint where its fp8 path runs (a family with
    one, bf16, a GPU of compute capability 8.9+ or a CPU), else "none" (an fp8 checkpoint then dequantised, with
    a warning saying why); "none" and "fp8" as asked (explicit "none" dequantises an fp8 checkpoint)."""
    if quantization != "auto":
        if fmt is not None and quantization == "none":
            log.info("engine: %s fp8 checkpoint dequantised (quantization none)", fmt.method)
        return quantization
    if fmt is None:
        return "none"
    why = "" if hasattr(family, "use_fp8") else "the family has no fp8 path (BERT / XLM-RoBERTa blocks and Qwen3 have)"
    if not why and dtype not in ("auto", "bfloat16"):
        why = f"the fp8 path runs in bfloat16, dtype {dtype!r} was asked"
    if not why and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        why = f"{torch.cuda.get_device_name(device)} has no float8 GEMMs (compute capability 8.9+)"
    if why:
        log.warning("engine: %s fp8 checkpoint dequantised: %s", fmt.method, why)
        return "none"
    return "fp8"


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, key: str) -> torch.Tensor:
    """q [N, K] e4m3 times its scale (one per tensor, per output channel, or per block) in float32."""
    N, K = q.shape
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    if s.shape in ((N,), (N, 1)):
        return q.float() * s.reshape(N, 1)
    if block is None or s.shape != (math.ceil(N / block[0]), math.ceil(K / block[1])):
        raise ValueError(f"{key}: scale of shape {tuple(s.shape)} fits neither a tensor, a channel nor "
                         f"{block or 'a'} block scale of a {N} x {K} weight")
    return q.float() * s.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]


class Fp8Reader:
    """One fp8 checkpoint's companions (scales, zero points, original shapes: small) read from every file up
    front, so a weight finds its scale whatever file holds it; each e4m3 weight dequantised for its bf16
    parameter (`tensor`) and kept, by the model's parameter name and stacked shard, for the fp8 path (`given`)."""

    def __init__(self, fmt: Fp8Format, path: Path, keep: bool = True):
        self.fmt, self.keep = fmt, keep  # keep: the e4m3 codes kept for the fp8 path (False: dequantised only)
        self.companions: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.companions.update({k: f.get_tensor(k) for k in f.keys() if self.skip(k)})
        for key, t in self.companions.items():
            if key.endswith("zero_point") and t.any():
                raise _refuse(fmt.method, f"{key}: nonzero zero points (asymmetric)")
        self.parts: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor] | None]] = {}

    @staticmethod
    def skip(key: str) -> bool:
        """A companion tensor, not a parameter (the loader reads past it)."""
        return key.rsplit(".", 1)[-1] in COMPANIONS

    def tensor(self, key: str, t: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The tensor the parameter `name` (shard `shard`) gets for checkpoint tensor `key`: an e4m3 weight
        dequantised (float32; its e4m3 codes and per-channel scales kept), anything else as it is."""
        prefix = key[:-len("weight")] if key.endswith("weight") else None
        scale = next((self.companions[prefix + s] for s in SCALES if prefix and prefix + s in self.companions), None)
        if t.dtype != E4M3:
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise _refuse(self.fmt.method, f"{key}: {t.dtype} weights (e4m3fn only)")
            if scale is not None:
                raise ValueError(f"{key} has a scale but is stored in {t.dtype}, not float8_e4m3fn")
            return t
        if scale is None:
            raise ValueError(f"{key} is float8_e4m3fn but the checkpoint has no {prefix}weight_scale / weight_scale_inv")
        if not (torch.isfinite(scale.float()).all() and (scale.float() >= 0).all()):
            raise ValueError(f"{key}: its scale has negative or non-finite values")
        w = dequantize(t, scale, self.fmt.block, key)
        original = self.companions.get(prefix + "weight_shape_original")
        if original is not None:  # compressed-tensors pads a block-wise weight to whole blocks
            w = w[:int(original[0]), :int(original[1])]
        per_channel = scale.numel() == 1 or scale.numel() == t.shape[0]
        kept = (t, scale.float().reshape(-1, 1).expand(t.shape[0], 1)) if per_channel and original is None else None
        if self.keep:
            self.parts.setdefault(name, {})[shard] = kept
        return w

    def given(self, model, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Parameter name -> (e4m3 [N, K], float32 scales [N, 1]) on `device` for `Fp8Blocks.use_fp8`: each
        weight the checkpoint holds whole in e4m3 with scales per channel or per tensor (a stacked one's shards
        in order); the fp8 path's other projections are quantised by ROSE (`log_coverage`)."""
        out = {}
        for name, shards in self.parts.items():
            want = list(range(len(model.stacked_rows(name)))) if None not in shards else [None]
            if sorted(shards, key=lambda s: -1 if s is None else s) != want or any(v is None for v in shards.values()):
                continue
            q = torch.cat([shards[s][0] for s in want]).to(device)
            out[name] = (q, torch.cat([shards[s][1] for s in want]).to(device))
        self.parts = {}  # the e4m3 copies on the host are no longer needed
        return out

    def log_coverage(self, model, given: dict) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        linears = [names[id(lin.weight)] for b in model.blocks for lin in model.fp8_linears(b).values()]
        own = [n for n in linears if n not in given]
        log.info("engine: %s fp8 checkpoint (%s): %d of %d fp8 GEMM weights used as published%s", self.fmt.method,
                 self.fmt.scheme, len(linears) - len(own), len(linears),
                 f"; quantised per channel by ROSE (block-wise, partly quantised or left bf16 by the checkpoint): "
                 f"{own[:4]}{' ...' if len(own) > 4 else ''}" if own else "")
