"""Image steps (`Engine.step_images`): uint8 pixels in, image embeddings out.

Ivy decodes, resizes and crops an image as the model's image processor does and sends its pixels as uint8
[S, S, 3] (RGB, S = `image_size`); the rest of the processor's work (rescale by 1/255, normalise by its mean and
std, channels first) is done here on the device, where it costs one elementwise kernel instead of four times the
bytes on the wire. Then the family's vision tower (`Family.embed_images`: the tower, its pooling and projection)
and L2 normalisation, as the text side's: float32 [N, dim].

Every image is `image_tokens` rows long, so an image batch is a ragged batch of equal lengths for the attention
backends (its own backend instance: a vision tower is bidirectional where CLIP's text tower is causal, and may
have another head shape), and on CUDA a batch is keyed by its image count alone: counts round up to a power of
two (`GraphKey(images, images * tokens, tokens, IMAGES)`), up to the most images whose tokens fit the text side's
largest token bucket; each key walks cold -> eager -> captured -> replayed as the text keys do, in the same graph
pool, on the same stream, counted in the same `GraphStats` (`rose.graphs`). Padding images in a bucket are
whatever the static buffer held: each image attends only to its own tokens, and their rows are never copied out.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rose.graphs import GraphKey, GraphRunner, first_sights
from rose.layers.pooling import normalize
from rose.layers.vit import image_meta
from rose.lazy import LazyTensor

log = logging.getLogger(__name__)

IMAGES = frozenset({"image"})  # GraphKey.extras of an image step: keys of their own beside the text ones


def _processor_config(path: Path) -> tuple[dict, str]:
    """The image processor's saved settings and the file they came from: preprocessor_config.json (transformers'
    layout), else processor_config.json's `image_processor` (what transformers 5 and sentence-transformers 6 save
    for a CLIP), else none ({})."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        f = path / name
        if f.is_file():
            cfg = json.loads(f.read_text())
            cfg = cfg.get(key) if key else cfg
            if isinstance(cfg, dict):
                return cfg, str(f)
    return {}, ""


def _side(value) -> tuple[int, int] | None:
    """A processor's `size` / `crop_size` as (height, width), or None where it is not one fixed size
    (`shortest_edge`: the aspect ratio decides)."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    return None


def _channels(value, name: str, where: str) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3:
        raise ValueError(f"{where}: {name} {value!r} is not one value per RGB channel")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class ImageProcessing:
    """What the engine does to an image's uint8 pixels, as the model's image processor does after resizing and
    cropping (Ivy's part): x * rescale, then (x - mean) / std per channel, channels first.

    size:    S, the square side the pixels come at (vision_config's `image_size`; the processor's final size,
             where it names one, must be the same).
    rescale: `rescale_factor` (1/255) where `do_rescale`, else 1.
    mean:    per RGB channel `image_mean` where `do_normalize`, else 0.
    std:     per RGB channel `image_std` where `do_normalize`, else 1.
    source:  the file the settings were read from ("" : none, the family's processor defaults).
    """

    size: int
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    source: str = ""

    @classmethod
    def read(cls, path: Path, size: int, defaults: dict) -> "ImageProcessing":
        cfg, source = _processor_config(path)
        where = source or str(path)
        final = _side(cfg.get("crop_size")) if cfg.get("do_center_crop", "crop_size" in cfg) else None
        final = final or (_side(cfg.get("size")) if "size" in cfg else None)
        if final is not None and final != (size, size):
            raise ValueError(f"{where}: the image processor makes {final[0]} x {final[1]} pixels; the vision tower "
                             f"takes {size} x {size}")
        if not source:
            log.warning("engine: %s has no preprocessor_config.json; image pixels are normalised with the image "
                        "processor's defaults", path)
        merged = {**defaults, **cfg}
        rescale = float(merged.get("rescale_factor", 1 / 255)) if merged.get("do_rescale", True) else 1.0
        if merged.get("do_normalize", True):
            mean = _channels(merged["image_mean"], "image_mean", where)
            std = _channels(merged["image_std"], "image_std", where)
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if min(std) <= 0:
            raise ValueError(f"{where}: image_std {list(std)} must be positive")
        return cls(size, rescale, mean, std, source)


class ImageTower:
    """One engine's image steps: the checks, the device-side normalisation, the vision tower, eager or graphed."""

    def __init__(self, model, processing: ImageProcessing, tokens: int, dim: int, attention, device: torch.device,
                 dtype: torch.dtype, runner: GraphRunner | None, max_tokens: int, max_seqs: int):
        self.model, self.processing, self.tokens, self.dim = model, processing, tokens, dim
        self.size = processing.size
        self.attention, self.device, self.dtype = attention, device, dtype
        p = processing
        self._mean = torch.tensor(p.mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self._std = torch.tensor(p.std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.graphs = None
        if runner is not None and attention.capturable:
            most = min(max_seqs, max(1, max_tokens // tokens))
            self.graphs = ImageGraphs(self, runner, 1 << (most.bit_length() - 1))

    def forward(self, pixels: torch.Tensor, cu_seqlens: torch.Tensor, graph: bool) -> torch.Tensor:
        """uint8 [N, S, S, 3] on the device -> float32 [N, dim], L2-normalised."""
        x = pixels.permute(0, 3, 1, 2).float()  # a new tensor (from uint8), so normalised in place: the same
        # arithmetic, in one buffer instead of three more of its size (on a CPU, 256 pictures: ~350 -> ~200 ms)
        x = x.mul_(self.processing.rescale).sub_(self._mean).div_(self._std).to(self.dtype)
        meta = image_meta(cu_seqlens, self.tokens, pixels.shape[0], graph)
        return normalize(self.model.embed_images(x, meta, self.attention))

    def check(self, pixels) -> None:
        s = self.size
        if not isinstance(pixels, torch.Tensor):
            raise TypeError(f"pixels must be a torch.Tensor, not {type(pixels).__name__}")
        if pixels.dtype != torch.uint8 or pixels.dim() != 4 or tuple(pixels.shape[1:]) != (s, s, 3) \
                or pixels.shape[0] < 1:
            raise ValueError(f"pixels must be uint8 [N >= 1, {s}, {s}, 3] (RGB at the model's image size), not "
                             f"{str(pixels.dtype).removeprefix('torch.')} {list(pixels.shape)}")

    def cu_seqlens(self, n: int, device) -> torch.Tensor:
        return torch.arange(0, (n + 1) * self.tokens, self.tokens, dtype=torch.int32, device=device)

    def step(self, pixels: torch.Tensor) -> LazyTensor:
        self.check(pixels)
        if self.graphs is not None and pixels.device.type == "cpu":
            lazy = self.graphs.step(pixels)  # (staged by one copy, strided or not)
            if lazy is not None:
                return lazy
        if self.graphs is not None:
            self.graphs.ops.use_stream()  # eager on the main stream, not the online lane's a text step left current
        n = pixels.shape[0]
        cu = self.cu_seqlens(n, "cpu")
        self.attention.prepare(None, cu.numpy(), n * self.tokens)
        x = pixels.to(self.device, non_blocking=True)
        return LazyTensor.from_device(self.forward(x, cu.to(self.device, non_blocking=True), graph=False))


class ImageGraphs:
    """An image tower's CUDA graphs, one per image-count bucket, beside the text runner's (its `ops`: stream,
    pool, driver copies and launches; its `stats`; its ring size), with their own static input buffer and
    page-locked staging and output rings."""

    def __init__(self, tower: ImageTower, runner: GraphRunner, max_images: int):
        s, ring = tower.size, runner.cfg.ring
        self.tower, self.ops, self.stats, self.mode = tower, runner.ops, runner.stats, runner.cfg.mode
        self.max_images, self.ring = max_images, ring
        self._in = torch.zeros((max_images, s, s, 3), dtype=torch.uint8, device=tower.device)
        self._staging = self.ops.pinned((ring, max_images, s, s, 3), torch.uint8)
        self._out = self.ops.pinned((ring, max_images, tower.dim), torch.float32)
        self._events = [self.ops.event() for _ in range(ring)]
        self._used = [False] * ring
        self._slot = 0
        self._cu: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # bucket -> static cu_seqlens (device, host)
        self._hits: dict[GraphKey, int] = {}
        self._graphs: dict[GraphKey, tuple] = {}  # key -> (launch, output)
        if tower.device.type == "cuda":  # the buffers' zero fill (this thread's stream) done before the engine's
            torch.cuda.current_stream(tower.device).synchronize()  # stream reads them

    def key(self, n: int) -> GraphKey | None:
        if n > self.max_images:
            return None
        nb = 1 << (n - 1).bit_length()
        return GraphKey(nb, nb * self.tower.tokens, self.tower.tokens, IMAGES)

    def _next_slot(self) -> int:
        s = self._slot
        self._slot = (s + 1) % self.ring
        if self._used[s] and not self._events[s].query():
            self._events[s].synchronize()  # only when more than `ring` image steps are in flight
        return s

    def _run(self, key: GraphKey) -> torch.Tensor:
        nb = key.seqs
        cu = self._cu[nb][0]

        def fwd():
            return self.tower.forward(self._in[:nb], cu, graph=True)

        graph = self._graphs.get(key)
        if graph is not None:
            graph[0]()
            self.stats.replays += 1
            return graph[1]
        return first_sights(self, key, fwd, self.mode, lambda ms: log.info(
            "graph captured for %d images (%d tokens each) in %.1f ms", nb, key.max_len, ms))

    def step(self, pixels: torch.Tensor) -> LazyTensor | None:
        """uint8 [N, S, S, 3] host pixels through their bucket's graph; None past the largest bucket."""
        n = pixels.shape[0]
        key = self.key(n)
        if key is None:
            self.stats.oversize += 1
            return None
        slot = self._next_slot()
        staged = self._staging[slot, :n]
        staged.copy_(pixels)  # into page-locked memory, so the device copy is asynchronous
        self.ops.use_stream()
        if key.seqs not in self._cu:  # a bucket's static cu_seqlens, made once on the engine's stream
            cu = self.tower.cu_seqlens(key.seqs, "cpu")
            self._cu[key.seqs] = (cu.to(self.tower.device), cu.numpy())
        self.tower.attention.prepare(key, self._cu[key.seqs][1], key.tokens)
        self.ops.copy(self._in[:n], staged)
        out = self._run(key)
        host = self._out[slot, :n]
        self.ops.copy(host, out[:n])
        ev = self._events[slot]
        ev.record(self.ops.stream)
        self._used[slot] = True
        return LazyTensor(host, ev)
