"""`GraphRunner`: the one owner of CUDA-graph state, staging buffers and the engine stream.

A step is keyed by a `GraphKey` (sequence bucket, token bucket, length bucket, extras): sequence
counts round up to a power of two, token counts to multiples of `small_step` up
to `small_max`, then of `large_step`, and the longest sequence to a power of two
(at least 64, at most the token bucket; attention sizes its launch from it). Each key walks cold -> eager (first hit: kernels are
selected, workspaces allocated) -> captured (second hit) -> replayed (every later
hit). All graphs share one memory pool and read one set of static input
buffers; the host pads the batch to its bucket in page-locked memory and copies
it in before replay. Padding tokens belong to no sequence (attention never sees
them; pooling reads each sequence's own tokens or sends them to a discarded row), so they cannot change a real
sequence's output. A batch larger than the biggest bucket runs eagerly. A cross-encoder's runner
(`segments`) also stages each sequence's second-segment start (0: none) and hands them to its
forward, whose output is the smaller [N, num_labels] scores. A step that
also wants token-level outputs (BGE-M3's sparse weights, ColBERT vectors) has its own
keys (`GraphKey.extras` not empty) and graphs, through `forward_extras`.

A step runs on the engine's stream, which it makes the calling thread's current stream
(`CudaOps.use_stream`). Results leave through a ring of page-locked output buffers: the device-to-host
copy is queued behind the forward on the engine's stream and an event is
recorded after it (`LazyTensor`). A result's host memory is reused `ring` steps
later, so callers copy what they keep (Tulip does).

Everything CUDA-specific goes through `ops` (`CudaOps`), so the state machine
runs on CPU in tests with a fake.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from rose.batch import Batch
from rose.lazy import LazyTensor

log = logging.getLogger(__name__)

# forward(ids, positions, seq_ids, cu_seqlens, max_seqlen[, segment_starts [num_seqs + 1]]) -> float32 [num_seqs, dim]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# forward_extras(..., max_seqlen, extras) -> (dense [num_seqs, dim], weights [T] or empty, vectors [T, d] or empty)
ForwardExtras = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# prepare(key, cu_seqlens on the host, token rows): the attention backend's host-side plan
Prepare = Callable[[tuple, np.ndarray, int], None]


class GraphKey(NamedTuple):
    """What a captured graph is specialised to; attention backends plan by it (host-side)."""

    seqs: int  # sequence bucket (a power of two): the batch's sequences plus empty dummies
    tokens: int  # token bucket: rows of every activation in the graph
    max_len: int  # length bucket: attention's launch size (a power of two, >= 64, <= tokens)
    extras: frozenset = frozenset()  # token-level outputs computed too ("sparse", "colbert")



@dataclass(frozen=True)
class GraphConfig:
    """CUDA-graph policy.

    mode:       "lazy" (capture a key on its second hit), "eager-all" (capture on the first hit),
                or "off" (never capture; still padded to buckets and staged).
    small_step: token bucket step up to small_max.
    small_max:  where the bucket step grows to large_step.
    large_step: token bucket step above small_max.
    max_tokens: largest token bucket; bigger batches run eagerly.
    max_seqs:   largest sequence bucket; more sequences run eagerly.
    ring:       page-locked staging/output buffers in rotation (steps in flight + results held).
    """

    mode: str = "lazy"
    small_step: int = 64
    small_max: int = 1024
    large_step: int = 256
    max_tokens: int = 16384
    max_seqs: int = 256
    ring: int = 4

    def __post_init__(self):
        if self.mode not in ("lazy", "eager-all", "off"):
            raise ValueError(f"graph mode {self.mode!r} is not one of lazy, eager-all, off")
        for name in ("small_step", "small_max", "large_step", "max_tokens", "max_seqs", "ring"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.small_max % self.small_step or (
                self.max_tokens > self.small_max and (self.max_tokens - self.small_max) % self.large_step):
            raise ValueError(
                f"buckets must tile: small_max {self.small_max} % small_step {self.small_step}, "
                f"(max_tokens {self.max_tokens} - small_max) % large_step {self.large_step}")

    def token_bucket(self, n: int) -> int | None:
        if n <= self.small_max:
            b = -(-n // self.small_step) * self.small_step
        else:
            b = self.small_max + -(-(n - self.small_max) // self.large_step) * self.large_step
        return b if b <= self.max_tokens else None

    def seq_bucket(self, n: int) -> int | None:
        b = 1 << (n - 1).bit_length()
        return b if b <= self.max_seqs else None

    @staticmethod
    def len_bucket(max_seqlen: int, token_bucket: int) -> int:
        return min(token_bucket, max(64, 1 << (max_seqlen - 1).bit_length()))


@dataclass
class GraphStats:
    keys: int = 0
    eager: int = 0
    captures: int = 0
    replays: int = 0
    oversize: int = 0
    capture_ms: float = 0.0
    capture_ms_by_key: dict = field(default_factory=dict)


KEY_CACHE = 4096  # batch shapes whose GraphKey is remembered (a key costs ~2.5 us of host time to build)
_NO_KEY = object()


# torch's C bindings for the current stream and device, resolved once (None in a build without them)
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _current_stream_id(index: int) -> int:
    if _GET_STREAM is None:  # not in this torch build: the public way
        return torch.cuda.current_stream(index).stream_id
    return _GET_STREAM(index)[0]


def _current_device() -> int:
    return torch.cuda.current_device() if _GET_DEVICE is None else _GET_DEVICE()


def _driver():
    """libcuda's cuMemcpyAsync and cuGraphLaunch through ctypes, or None where it cannot be loaded."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        copy, launch = cu.cuMemcpyAsync, cu.cuGraphLaunch
    except (OSError, AttributeError):
        return None
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    copy.restype = launch.restype = ctypes.c_int
    return copy, launch


class CudaOps:
    """The CUDA calls GraphRunner makes (replaced by a fake in CPU tests).

    A step's two copies and its replay go straight to the driver (`copy`, `launcher`) where it can
    be loaded: through torch they cost ~10-18 us of host time each on H200 hosts (dispatch, and a
    host-allocator event per pinned copy), ~7 for `CUDAGraph.replay`, and the input copy and the
    replay are on the device's critical path. Both are plain stream operations on the engine's
    stream, ordered as torch's would be; the buffers are the runner's own (never freed), and the
    graphs draw no random numbers (which is all `replay` adds to the launch)."""

    def __init__(self, device: torch.device, priority: int = 0):
        self.device = device
        # priority: CUDA's stream priority (lower is more urgent; 0 is the default and least urgent); where
        # two runners' steps are on the device at once, the more urgent stream's blocks are scheduled first
        # as SMs free up (`Engine`'s online lane)
        self.stream = torch.cuda.Stream(device, priority=priority)
        self.pool = torch.cuda.graph_pool_handle()
        drv = _driver()
        self._copy, self._launch = drv or (None, None)
        self._handle = self.stream.cuda_stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src, non_blocking=True)` on the engine's stream, for contiguous tensors of one
        dtype and size (page-locked host memory on one side)."""
        if self._driver_copies(dst, src):
            _checked_copy(self._copy, dst.data_ptr(), src.data_ptr(), dst.nbytes, self._handle, dst, src)
        else:
            dst.copy_(src, non_blocking=True)

    def copier(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """`copy(dst, src)` bound once, for buffers that stay put (a ring slot's input copy: its
        pointers and size are checked and read here, not on every step)."""
        if self._driver_copies(dst, src):
            return functools.partial(_checked_copy, self._copy, dst.data_ptr(), src.data_ptr(), dst.nbytes,
                                     self._handle, dst, src)
        return functools.partial(dst.copy_, src, non_blocking=True)

    def _driver_copies(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether the driver's plain byte copy does what torch's copy_ would: libcuda loaded, one dtype
        and size, both contiguous (else torch's copy_ runs: it converts and strides)."""
        return (self._copy is not None and dst.dtype == src.dtype and dst.nbytes == src.nbytes
                and src.is_contiguous() and dst.is_contiguous())

    def launcher(self, g) -> Callable[[], object]:
        """The call that replays captured graph `g` on the engine's stream."""
        exec_ = getattr(g, "raw_cuda_graph_exec", None)
        if self._launch is None or exec_ is None:
            return g.replay
        return functools.partial(_checked, self._launch, exec_(), self._handle, g.replay)

    def pinned(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def event(self):
        return torch.cuda.Event()

    def use_stream(self) -> None:
        """Make the runner's stream the calling thread's current one (once per thread), so that every
        step's copies, plans and replay are on that one stream without a stream switch per step. The
        thread's own eager work after a step is queued behind it, as before. Measured on an H200 host
        (`benchmarks/results/2026-12-02_h200_small-step-host/`): a `torch.cuda.stream` block cost 17 us per step,
        `torch.cuda.current_stream()` alone 9.5 (it builds a Stream object), so the current stream's
        id is read from torch's C binding where it has one (the call current_stream makes).
        `set_stream` also makes the stream's device current; the check is by stream and device, so
        one thread may step engines of several devices in turn."""
        index = self.stream.device_index
        if _current_stream_id(index) != self.stream.stream_id or _current_device() != index:
            torch.cuda.set_stream(self.stream)

    def capture(self, fn: Callable[[], torch.Tensor]):
        # cuBLAS / cuBLASLt keep one workspace per (handle, stream), made by a stream's first GEMM from
        # torch's ordinary allocator: a graph captured after an eager step would bake that workspace's
        # address in, and whatever clears the workspaces later (torch.compile's CUDA graph trees do, around
        # every recording of theirs) frees it; the next empty_cache unmaps it and the replay faults ("CUDA
        # error: unspecified launch failure", seen on an H100 with transformers compiled in mode
        # "reduce-overhead" beside an engine, 2026-12-06). Cleared first, the capture allocates the
        # workspace from this runner's pool, which stays mapped while its graphs live.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            out = fn()
        return g, out


def _checked_copy(copy, dst_ptr, src_ptr, nbytes, stream, dst, src) -> None:
    if code := copy(dst_ptr, src_ptr, nbytes, stream):  # refused (e.g. no CUDA context on this thread)
        _refused("cuMemcpyAsync", code)
        dst.copy_(src, non_blocking=True)


def _checked(launch, exec_, stream, replay) -> None:
    if code := launch(exec_, stream):  # refused (e.g. no context on this thread): torch's own replay
        _refused("cuGraphLaunch", code)
        replay()


@functools.cache
def _refused(call: str, code: int) -> None:
    """Say once per call and error code that the driver refused and torch's call ran instead."""
    log.warning("graphs: %s returned CUDA error %d; torch's own call runs instead", call, code)


def first_sights(owner, key, fwd: Callable[[], torch.Tensor], mode: str, captured: Callable[[float], None]):
    """A step whose `key` has no graph yet, for a graph owner (GraphRunner, rose.images.ImageGraphs: `_hits`,
    `_graphs`, `stats`, `ops`): run `fwd` eagerly, or capture it and replay the capture, as `mode` says ("lazy":
    capture on the key's second sight; "eager-all": on its first, after one eager run to warm kernel selection
    and workspaces); `captured(ms)` is told the capture's time. Returns the step's output."""
    hits = owner._hits.get(key, 0)
    owner._hits[key] = hits + 1
    stats = owner.stats
    if hits == 0:
        stats.keys += 1
    if not (mode == "eager-all" or (mode == "lazy" and hits >= 1)):
        stats.eager += 1
        return fwd()
    if hits == 0:
        fwd()
    t0 = time.perf_counter()
    g, out = owner.ops.capture(fwd)
    ms = (time.perf_counter() - t0) * 1e3
    stats.captures += 1
    stats.capture_ms += ms
    stats.capture_ms_by_key[key] = ms
    owner._graphs[key] = (owner.ops.launcher(g), out)  # the launcher holds g (its replay), so g lives
    captured(ms)
    g.replay()
    stats.replays += 1
    return out


class GraphRunner:
    def __init__(self, forward: Forward, prepare: Prepare, dim: int, device: torch.device, cfg: GraphConfig,
                 ops=None, forward_extras: ForwardExtras | None = None, segments: bool = False):
        self.forward = forward
        self.forward_extras = forward_extras
        self.prepare = prepare
        self.cfg = cfg
        self.dim = dim
        self.device = device
        self.ops = ops or CudaOps(device)
        self.stats = GraphStats()
        T, N, R = cfg.max_tokens, cfg.max_seqs, cfg.ring
        # Static device inputs, one byte buffer so that a step stages them with one copy: int32
        # cu_seqlens [N + 1], a cross-encoder's int64 second-segment starts [N + 1] (token types are
        # derived on the device), then int64 [ids | positions | seq_ids] packed at the front of
        # each bucket; a step copies the head and its bucket's 3 x tokens.
        self.segments = segments
        cu_bytes = -(-4 * (N + 1) // 8) * 8
        self._head = cu_bytes + (8 * (N + 1) if segments else 0)
        dev = torch.zeros(self._head + 24 * T, dtype=torch.uint8, device=device)
        self._inputs = dev
        self._cu = dev[: 4 * (N + 1)].view(torch.int32)
        self._tokens = dev[self._head:].view(torch.int64)
        # Page-locked rings: staging for inputs (the same layout, a row per slot), landing for outputs.
        self._staging = self.ops.pinned((R, self._head + 24 * T), torch.uint8)
        self._out = self.ops.pinned((R, N, dim), torch.float32)
        st = self._staging.numpy()
        self._in_cu_np = st[:, : 4 * (N + 1)].view(np.int32)
        self._in_tok_np = st[:, self._head:].view(np.int64)
        if segments:
            self._seg = dev[cu_bytes: self._head].view(torch.int64)
            self._in_seg_np = st[:, cu_bytes: self._head].view(np.int64)
        # One event per slot, recorded again each time the slot is used (no event made per step).
        self._events = [self.ops.event() for _ in range(R)]
        self._slot_events = [None] * R
        self._slot = 0
        self._out_tokens: list[torch.Tensor | None] = [None, None]  # rings for weights / vectors, made on first use
        self._hits: dict[GraphKey, int] = {}
        self._keys: dict[tuple, GraphKey | None] = {}  # (seqs, tokens, longest, extras) -> key, up to KEY_CACHE
        self._graphs: dict[GraphKey, tuple[Callable[[], object], torch.Tensor]] = {}  # key -> (replay, output)
        self._in_copies: dict[tuple[int, int], Callable[[], None]] = {}  # (slot, bucket tokens) -> its input copy
        self._staged: list[tuple | None] = [None] * R  # per slot: what its last staging wrote besides the ids
        self._out_views: dict[tuple[int, int], torch.Tensor] = {}  # (slot, sequences)

    def key(self, batch: Batch, extras: frozenset = frozenset()) -> GraphKey | None:
        shape = (batch.num_seqs, batch.num_tokens, batch.max_seqlen,
                 extras if type(extras) is frozenset else frozenset(extras))
        key = self._keys.get(shape, _NO_KEY)
        if key is _NO_KEY:
            n, t = self.cfg.seq_bucket(shape[0]), self.cfg.token_bucket(shape[1])
            key = None if n is None or t is None else GraphKey(n, t, self.cfg.len_bucket(shape[2], t), shape[3])
            if len(self._keys) < KEY_CACHE:
                self._keys[shape] = key
        return key

    def state(self, key: GraphKey) -> str:
        if key in self._graphs:
            return "captured"
        return "warm" if self._hits.get(key) else "cold"

    def _next_slot(self) -> int:
        s = self._slot
        self._slot = (s + 1) % self.cfg.ring
        ev = self._slot_events[s]
        if ev is not None and not ev.query():
            ev.synchronize()  # only when more than `ring` steps are in flight
        return s

    def _stage(self, batch: Batch, slot: int, nb: int, tb: int) -> None:
        """Pad `batch` to (nb sequences, tb tokens) in page-locked slot `slot`."""
        T, N = batch.num_tokens, batch.num_seqs
        ids, pos, sid, cu_in = batch.host or (batch.input_ids.numpy(), batch.positions.numpy(),
                                              batch.seq_ids.numpy(), batch.cu_seqlens.numpy())
        tok = self._in_tok_np[slot]
        tok[0:T] = ids
        last = self._staged[slot]
        # Positions, sequence ids, cu_seqlens and all padding are what the slot's last step left where
        # that step had the same arrays (a one-sequence batch's are shared per length: `rose.batch`) and
        # shapes: then only the ids are new (an online request of a recurring length: 1 write, not 8).
        if last is None or last[0] is not pos or last[1] is not sid or last[2] is not cu_in or last[3] != (T, nb, tb):
            tok[T:tb] = 0
            tok[tb:tb + T] = pos
            tok[tb + T:2 * tb] = 0
            tok[2 * tb:2 * tb + T] = sid
            tok[2 * tb + T:3 * tb] = nb  # padding tokens pool into a discarded row
            cu = self._in_cu_np[slot]
            cu[: N + 1] = cu_in
            cu[N + 1: nb + 1] = T  # empty dummy sequences
            self._staged[slot] = (pos, sid, cu_in, (T, nb, tb))  # (held, so `is` cannot match a reused id)
        if self.segments:
            seg = self._in_seg_np[slot]
            seg[:N] = 0 if batch.segment_starts is None else batch.segment_starts.numpy()
            seg[N: nb + 1] = 0  # dummies and the padding row: one segment

    def _run_key(self, key: GraphKey):
        nb, tb, lb = key.seqs, key.tokens, key.max_len
        tok, cu = self._tokens, self._cu

        def fwd():  # eager and capture steps only: a replay needs none of this
            args = (tok[0:tb], tok[tb:2 * tb], tok[2 * tb:3 * tb], cu[: nb + 1], lb)
            if self.segments:
                args += (self._seg[: nb + 1],)
            if not key.extras:
                return self.forward(*args)
            return self.forward_extras(*args, key.extras)

        graph = self._graphs.get(key)
        if graph is not None:
            launch, out = graph
            launch()
            self.stats.replays += 1
            return out
        return first_sights(self, key, fwd, self.cfg.mode, lambda ms: log.info(
            "graph captured for %d seqs x %d tokens (max length %d)%s in %.1f ms", nb, tb, lb,
            f" with {'+'.join(sorted(key.extras))}" if key.extras else "", ms))

    def _token_host(self, i: int, out: torch.Tensor, slot: int, n: int) -> torch.Tensor:
        """A page-locked landing place for the first `n` rows of token-level output `out` (ring slot)."""
        if out.numel() == 0:
            return torch.empty(0)
        ring = self._out_tokens[i]
        if ring is None or ring.shape[2:] != out.shape[1:]:
            ring = self._out_tokens[i] = self.ops.pinned((self.cfg.ring, self.cfg.max_tokens, *out.shape[1:]), out.dtype)
        host = ring[slot, :n]
        host.copy_(out[:n], non_blocking=True)
        return host

    def step(self, batch: Batch, extras: frozenset = frozenset()) -> LazyTensor | None:
        """Run `batch` through its bucket's graph; None if it is bigger than every bucket (or wants
        `extras` and there is no `forward_extras`). With extras the result is a tuple (dense,
        token weights [T], token vectors [T, d]), empty where not asked, as the eager step gives."""
        if extras and self.forward_extras is None:
            return None
        key = self.key(batch, extras)
        if key is None:
            self.stats.oversize += 1
            return None
        nb, tb = key.seqs, key.tokens
        slot = self._next_slot()
        self._stage(batch, slot, nb, tb)
        self.ops.use_stream()  # the backend's plan copies (FlashInfer) are ordered with the replay: one stream
        self.prepare(key, self._in_cu_np[slot, : nb + 1], tb)
        copy_in = self._in_copies.get((slot, tb))
        if copy_in is None:  # a slot's slices and their copy are made once per size (each costs host time per step)
            n = self._head + 24 * tb
            copy_in = self._in_copies[(slot, tb)] = self.ops.copier(self._inputs[:n], self._staging[slot, :n])
        copy_in()
        host = self._out_views.get((slot, batch.num_seqs))
        if host is None:
            host = self._out_views[(slot, batch.num_seqs)] = self._out[slot, : batch.num_seqs]
        out = self._run_key(key)
        dense = out[0] if extras else out
        self.ops.copy(host, dense[: batch.num_seqs])
        if extras:
            host = (host, *(self._token_host(i, t, slot, batch.num_tokens) for i, t in enumerate(out[1:])))
        ev = self._events[slot]
        ev.record(self.ops.stream)
        self._slot_events[slot] = ev
        return LazyTensor(host, ev)
