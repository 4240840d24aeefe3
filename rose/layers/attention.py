"""Ragged attention backends behind one interface.

Every backend takes q, k, v of shape [T, heads, head_dim] for a whole ragged
batch plus `AttentionMetadata`, and attends only within each sequence (no
padding, no cross-sequence attention). Backends:

- `sdpa`:   torch's scaled_dot_product_attention, one call per sequence. Runs
            everywhere (the CPU path and the reference for the others).
- `varlen`: FlashAttention varlen through `torch.nn.attention.varlen`
            (CUDA, fp16/bf16).
- `fa4`:    FlashAttention 4 varlen (`flash_attn.cute`, CuTe DSL kernels; needs
            the `flash-attn-4` package), GQA without repeating kv heads.
- `flashinfer-fa2`, `flashinfer-fa3`: FlashInfer ragged prefill, planned per step.
- `triton`: ROSE's own kernel (`rose.kernels.attention`): one program per query block, sequence
            and head; GQA without repeating kv heads. Made for short sequences, it also won every
            cell of the 2026-12-02 H200 sweep to 8,192 tokens (`benchmarks/results/2026-12-02_h200_attention-sweep/`).

Two per-layer extras some families need: an additive score bias (`AttentionMetadata.bias`, MPNet's
relative position bias: `sdpa`, `padded` and `triton` take one, `takes_bias`) and sliding windows (Mistral, Gemma3,
ModernBERT's local layers set `AttentionMetadata.window`). A backend with `windowed` honours it (sdpa
with a band mask, varlen / fa4 with their `window_size`, triton in its kernel); `WindowFallback` sends
the windowed calls whose sequences may exceed the window past one that does not (flashinfer) to one that does,
so a windowed model never silently gets full attention.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rose.backends import BACKENDS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs to know about a ragged batch.

    cu_seqlens: int32 [N+1] on the compute device.
    max_seqlen: longest sequence (host int; a launch parameter, never read from the device;
                inside a CUDA graph, the token bucket).
    seq_lens:   the N lengths on the host (None inside a graph: capturable backends ignore it).
    causal:     causal (decoder-style) rather than bidirectional attention.
    window:     sliding-window layers: a query sees only keys at distance < window (before it, and
                after it unless causal); 0: no limit. Set per layer by the model (`with_window`).
    bias:       an additive score bias [heads, L, L] by position within a sequence (L >= the longest
                sequence; each sequence takes its top-left [n, n]), or one per sequence [N, heads, L, L]
                (DeBERTa's; `sdpa` and `padded` take it), or None; set by the family.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: tuple[int, ...] | None
    causal: bool = False
    window: int = 0
    bias: torch.Tensor | None = None

    def with_window(self, window: int) -> AttentionMetadata:
        return self if window == self.window else dataclasses.replace(self, window=window)

    def windowed(self) -> bool:
        """Whether the window can bind here (a sequence may be longer than it)."""
        return 0 < self.window < self.max_seqlen

    def window_size(self, unlimited: int | None = -1) -> tuple:
        """FlashAttention's (left, right) for this call: keys [i - left, i + right] (`unlimited`: none)."""
        left = self.window - 1 if self.window else unlimited
        return left, 0 if self.causal else left


def band_mask(n: int, window: int, causal: bool, device) -> torch.Tensor:
    """[n, n] bool, True where query i may attend key j: |i - j| < window (and j <= i if causal)."""
    d = torch.arange(n, device=device)
    d = d.unsqueeze(1) - d.unsqueeze(0)
    return (d < window) & (d >= 0 if causal else d > -window)


class AttentionBackend(abc.ABC):
    """q, k, v [T, heads, head_dim] (kv heads may be fewer: GQA) -> [T, heads, head_dim]."""

    name: str
    capturable = False  # safe inside a CUDA graph (no host-side reads, static launch config)
    windowed = False  # honours AttentionMetadata.window
    takes_bias = False  # adds AttentionMetadata.bias to the scores

    def prepare(self, key, cu_host: np.ndarray, num_tokens: int) -> None:
        """Host-side planning before a forward (outside any graph).

        key:        the `rose.graphs.GraphKey` being run or captured (None for an eager step).
        cu_host:    int32 cumulative lengths on the host, padded with empty dummy sequences.
        num_tokens: rows of q/k/v (the token bucket; tokens past cu_host[-1] are padding).
        """

    @abc.abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class SdpaBackend(AttentionBackend):
    """One SDPA call per sequence; handles GQA by letting SDPA broadcast kv heads, a local window
    with a band mask and a score bias as SDPA's additive mask."""

    name = "sdpa"
    windowed = True  # a band mask for sequences longer than the window
    takes_bias = True

    def __call__(self, q, k, v, meta):
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(meta.seq_lens):
            s = slice(start, start + n)
            bias = meta.bias if meta.bias is None or meta.bias.dim() == 3 else meta.bias[i]
            mask = None if bias is None else bias[:, :n, :n]
            band = band_mask(n, meta.window, meta.causal, q.device) if 0 < meta.window < n else None
            if band is None and meta.causal and mask is not None:  # causal with a bias: the rule as a mask
                band = band_mask(n, n + 1, True, q.device)
            if band is not None:
                mask = band if mask is None else mask.masked_fill(~band, float("-inf"))
            o = F.scaled_dot_product_attention(
                q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1), attn_mask=mask,
                is_causal=meta.causal and mask is None, enable_gqa=gqa,
            )
            out[s] = o.transpose(0, 1)
            start += n
        return out


class PaddedBackend(AttentionBackend):
    """Every sequence padded to `max_seqlen` for one batched SDPA call, with the score bias
    (`AttentionMetadata.bias`) and a key-padding mask built on the device from `cu_seqlens`: no host
    reads, so it is capturable (MPNet's relative position bias inside CUDA graphs). Memory grows as
    sequences x heads x max_seqlen^2 (the mask); padding rows come out zero."""

    name = "padded"
    capturable = True
    windowed = True
    takes_bias = True

    def __call__(self, q, k, v, meta):
        T, h, d = q.shape
        L, cu = meta.max_seqlen, meta.cu_seqlens
        n = cu.shape[0] - 1
        start, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
        j = torch.arange(L, device=q.device)
        valid = j[None, :] < lens[:, None]  # [n, L]
        idx = torch.where(valid, start[:, None] + j[None, :], T)  # a padded slot reads / writes row T

        def padded(x):  # [T, heads, d] -> [n, heads, L, d], zeros in the padding
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx].transpose(1, 2)

        keep = valid[:, None, None, :]  # keys in the sequence
        rule = band_mask(L, meta.window if meta.window else L + 1, meta.causal, q.device) \
            if meta.window or meta.causal else None
        if rule is not None:
            keep = keep & rule
        mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        if meta.bias is not None:  # one for every sequence, or each its own
            mask = mask + (meta.bias[None, :, :L, :L] if meta.bias.dim() == 3 else meta.bias[:, :, :L, :L])
        o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out = q.new_zeros(T + 1, h, d)
        out[idx.flatten()] = o.transpose(1, 2).reshape(n * L, h, d)  # padded slots land in row T
        return out[:T]


class VarlenBackend(AttentionBackend):
    """FlashAttention varlen from torch.nn.attention.varlen (CUDA only)."""

    name = "varlen"
    capturable = True

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        # torch 2.10/2.11 take is_causal; later releases take window_size.
        self._causal_kw = "is_causal" if "is_causal" in params else "window_size"
        self._gqa = "enable_gqa" in params
        self.windowed = "window_size" in params

    def __call__(self, q, k, v, meta):
        kw = {}
        if self.windowed:
            kw["window_size"] = meta.window_size()
        elif meta.causal:
            kw[self._causal_kw] = True
        if q.shape[1] != k.shape[1]:
            if self._gqa:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        cu = meta.cu_seqlens
        return self._fn(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, **kw)


class FlashAttn4Backend(AttentionBackend):
    """FlashAttention 4 varlen from `flash_attn.cute` (CUDA; kernels compiled on first use, so a
    graph key's eager warm-up run precedes its capture)."""

    name = "fa4"
    capturable = True

    def __init__(self, device: torch.device):
        from flash_attn.cute import flash_attn_varlen_func

        if torch.cuda.get_device_capability(device)[0] < 9:
            raise ValueError("FlashAttention 4 needs a Hopper or Blackwell GPU (compute capability 9.0+), not "
                             + torch.cuda.get_device_name(device))
        self._fn = flash_attn_varlen_func
        self.windowed = "window_size" in inspect.signature(flash_attn_varlen_func).parameters
        # 4.0.0b40 on cutlass-dsl 4.8.1 warns at every kernel compile that an argument it passes itself
        # (`aux_data`) is no JIT argument: noise in a server's log, nothing a caller can act on
        warnings.filterwarnings("ignore", message=r"Argument aux_data \(position \d+\) cannot be converted",
                                category=UserWarning)

    def __call__(self, q, k, v, meta):
        cu, n = meta.cu_seqlens, meta.max_seqlen
        kw = {"window_size": meta.window_size(None)} if meta.window and self.windowed else {}
        out, _ = self._fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                          causal=meta.causal, **kw)
        return out


class FlashInferBackend(AttentionBackend):
    """FlashInfer ragged prefill (`fa2` or `fa3`), planned on the host before each step.

    One wrapper per graph key, in CUDA-graph mode, so a captured graph keeps pointing at its
    wrapper's buffers and `prepare()` re-plans them before every replay. Padding tokens past
    the last real sequence form one extra sequence of their own, so every plan of a key has
    the same number of rows (a CUDA-graph requirement) and padding never meets a real token.
    """

    name = "flashinfer"
    capturable = True

    def __init__(self, backend: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"FlashInfer ragged prefill needs head_dim 64, 128 or 256; this model has {head_dim}")
        import flashinfer

        self._fi = flashinfer
        self.name = f"flashinfer-{backend}"
        self.backend = backend
        self.device = device
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrappers: dict = {}  # graph key (None: eager) -> (wrapper, event after its last plan, workspace)
        self._current = None
        self.causal = False

    def _workspace_for(self, tokens: int, batch: int) -> torch.Tensor:
        """The float workspace for plans over `tokens` rows in `batch` sequences. fa2 may split each
        row's KV range and keep the partial outputs and log-sum-exps in float32 there, about
        (tokens + 128 per sequence of tile padding) x heads x (head_dim + 1) x 4 bytes: 128 MiB did
        not hold 16,384 tokens of 16 x 128 heads (kernel sweep, H200). It grows in powers of two and
        never shrinks; a wrapper keeps the buffer it was made with, so captured graphs keep theirs."""
        h, _, d = self.shape
        need = (tokens + 128 * (batch + 1)) * h * (d + 1) * 4 + (16 << 20)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(1 << (need - 1).bit_length(), dtype=torch.uint8, device=self.device)
        return self._workspace

    def _wrapper(self, key, batch: int, tokens: int):
        """(wrapper, event recorded after its last plan) for graph key `key`; key None: the one eager
        wrapper (re-planned for any batch), made again when the workspace has grown."""
        entry = self._wrappers.get(key)
        workspace = self._workspace_for(tokens, batch)
        if entry is not None and (key is not None or entry[2] is workspace):
            return entry
        if entry is not None and entry[1] is not None:
            entry[1].synchronize()  # the old eager wrapper's last plan copy has run: its buffer may go
        if key is None:
            w = self._fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=self.backend)
        else:
            buf = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
            w = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buf, kv_indptr_buf=buf, backend=self.backend)
        entry = self._wrappers[key] = (w, None, workspace)
        return entry

    def prepare(self, key, cu_host, num_tokens):
        # Always one more sequence holding the padding tokens (maybe none), so a key's batch
        # size and row count never change between plans.
        indptr = torch.from_numpy(np.append(np.asarray(cu_host, dtype=np.int32), np.int32(num_tokens)))
        w, planned, workspace = self._wrapper(key, len(indptr) - 1, num_tokens)
        h, hk, d = self.shape
        # plan() writes the wrapper's page-locked host buffer, then queues its copy to the device on
        # this stream. Planning the same wrapper again before that copy has run (steps still queued
        # ahead of it) would overwrite what the earlier step is about to read: wait for that copy.
        cuda = self.device.type == "cuda"  # (a CPU stand-in for FlashInfer in the tests has no copies)
        if planned is not None:
            planned.synchronize()  # at once unless the device is more than a step behind
        elif cuda:
            planned = torch.cuda.Event()
            self._wrappers[key] = (w, planned, workspace)
        w.plan(indptr, indptr, h, hk, d, causal=self.causal, q_data_type=self.dtype)
        if planned is not None:
            planned.record()
        self._current = w

    def __call__(self, q, k, v, meta):
        return self._current.run(q, k, v)


class TritonBackend(AttentionBackend):
    """`rose.kernels.attention`: made for short sequences (the small-batch step), and the fastest
    measured at every length to 8,192 tokens; its grid comes from the sequence count and `max_seqlen`
    (the length bucket inside a graph). Takes a score bias
    (MPNet's), read beside each block of scores, and a sliding window."""

    name = "triton"
    capturable = True
    takes_bias = True
    windowed = True

    def __init__(self, device: torch.device):
        from rose import kernels

        if device.type != "cuda":
            raise ValueError("attention 'triton' needs a CUDA device")
        if not kernels.available():
            raise ImportError("attention 'triton' needs the triton package")
        from rose.kernels.attention import attention

        self._fn = attention

    def __call__(self, q, k, v, meta):
        return self._fn(q, k, v, meta.cu_seqlens, meta.max_seqlen, meta.causal, bias=meta.bias, window=meta.window)


class WindowFallback(AttentionBackend):
    """`inner` for every call but the windowed ones whose sequences may exceed the window
    (`AttentionMetadata.windowed`, decided on the host: fixed per graph key), which `windowed` serves."""

    def __init__(self, inner: AttentionBackend, windowed: AttentionBackend):
        self.inner, self.window_backend = inner, windowed
        self.name = f"{inner.name}+window:{windowed.name}"
        self.capturable = inner.capturable and windowed.capturable
        self.windowed = True

    def prepare(self, key, cu_host, num_tokens):
        self.inner.prepare(key, cu_host, num_tokens)
        self.window_backend.prepare(key, cu_host, num_tokens)

    def __call__(self, q, k, v, meta):
        return (self.window_backend if meta.windowed() else self.inner)(q, k, v, meta)


def with_window_support(backend: AttentionBackend, make_backend) -> AttentionBackend:
    """`backend` where it honours windows, else a `WindowFallback` over it: varlen where torch's
    takes a window, else sdpa (not capturable: such a model then runs without CUDA graphs)."""
    if backend.windowed:
        return backend
    try:
        windowed = make_backend("varlen")
    except (ImportError, ValueError):
        windowed = None
    if windowed is None or not windowed.windowed:
        windowed = SdpaBackend()
    log.warning("attention: %s has no sliding window; windowed layers over sequences longer than the window "
                "use %s", backend.name, windowed.name)
    return WindowFallback(backend, windowed)


def select_backend(name: str, device: torch.device, dtype: torch.dtype, heads: tuple[int, int, int] = (0, 0, 0),
                   causal: bool = False) -> AttentionBackend:
    """`auto` picks varlen on CUDA with half precision where available, else SDPA.

    name: auto or one of BACKENDS; heads: (q heads, kv heads, head dim). Raises ImportError
    when the backend's package is not installed, ValueError when it cannot run here.
    """
    if name == "sdpa":
        return SdpaBackend()
    if name == "padded":
        return PaddedBackend()
    if name == "triton":
        return TritonBackend(device)
    if name in BACKENDS and device.type != "cuda":
        raise ValueError(f"attention {name!r} needs a CUDA device")
    if name == "varlen":
        return VarlenBackend()
    if name == "fa4":
        return FlashAttn4Backend(device)
    if name in ("flashinfer-fa2", "flashinfer-fa3"):
        b = FlashInferBackend(name.split("-")[1], device, *heads, dtype)
        b.causal = causal
        return b
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r} (choose auto, {', '.join(BACKENDS)})")
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            return VarlenBackend()
        except ImportError as e:
            log.info("torch.nn.attention.varlen unavailable (%s); using sdpa", e)
    return SdpaBackend()
