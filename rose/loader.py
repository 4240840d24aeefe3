"""Strict weight loading from safetensors into a model built on the meta device.

Every checkpoint tensor must land in exactly one parameter (after the model's
name map) with the right shape, and every parameter must be filled: unknown
or missing keys are errors, not warnings.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from rose.models.base import Family


def _map_name(model: Family, key: str) -> tuple[str, int | None] | None:
    """Checkpoint key -> (our parameter name, shard index or None); None = ignored."""
    for prefix in model.strip_prefixes:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    if model.ignored is not None and model.ignored.search(key):
        return None
    for src, (dst, shard) in model.stacked_params.items():
        if src in key:
            return key.replace(src, dst), shard
    return key, None


def _stacked_dst(model: Family, name: str) -> bool:
    return any(d in name for d, _ in model.stacked_params.values())


def _finish(model: Family, device: torch.device) -> Family:
    model.materialize(device)
    return model.eval().requires_grad_(False)


def random_weights(model: Family, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Family:
    """Materialise `model` with seeded random weights (presets only: real shapes, meaningless outputs)."""
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("LayerNorm.weight", "norm.weight", "norm1.weight", "norm2.weight", "emb_ln.weight")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    return _finish(model, device)


def load_weights(model: Family, path: Path, device: torch.device, dtype: torch.dtype, fp8=None) -> Family:
    """Materialise `model` (built on meta) on `device` in `dtype` from path/*.safetensors. `fp8`: an fp8
    checkpoint's `rose.layers.fp8_checkpoint.Fp8Reader` (its weights dequantised, their scales read past)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    filled: dict[str, set[int | None]] = {}
    unknown: list[str] = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if fp8 is not None and fp8.skip(key):
                        continue
                    mapped = _map_name(model, key)
                    if mapped is None:
                        continue
                    name, shard = mapped
                    param = params.get(name)
                    if param is None:
                        unknown.append(key)
                        continue
                    target = param
                    if shard is not None:
                        rows = model.stacked_rows(name)
                        start = sum(rows[:shard])
                        target = param[start:start + rows[shard]]
                    tensor = f.get_tensor(key)
                    if fp8 is not None:
                        tensor = fp8.tensor(key, tensor, name, shard)
                    elif tensor.dtype.is_floating_point and tensor.element_size() == 1:  # never read codes as values
                        raise ValueError(f"{file.name}: {key} is {tensor.dtype} but config.json has no quantization_config")
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(target.shape)} for {name}"
                        )
                    if shard in filled.get(name, set()):
                        raise ValueError(f"{file.name}: {key} loaded twice")
                    target.copy_(tensor.to(dtype))
                    filled.setdefault(name, set()).add(shard)
    if unknown:
        raise ValueError(f"checkpoint {path} has unexpected tensors: {sorted(unknown)[:20]}")
    missing = []
    for name, param in params.items():
        got = filled.get(name, set())
        want = len(model.stacked_rows(name)) if _stacked_dst(model, name) else None
        if (want is None and not got) or (want is not None and len(got) != want):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensors for: {missing[:20]}")
    return _finish(model, device)
