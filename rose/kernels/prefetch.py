"""Weights into L2 ahead of the kernels that read them, for the small-batch step.

At 128 rows a block's GEMMs are latency-bound: each reads its weights from HBM as it multiplies,
at ~1 TB/s where the H200 streams 3.9 (BGE-M3: 6-8 MB per projection in 5-8 us). Weights never
change, so nothing stops a kernel from asking for the *next* projections' weights long before they
are read: `cp.async.bulk.prefetch.L2` (Hopper's bulk copy engine, one instruction per chunk, no
registers or shared memory held, nothing to wait for) issued by the kernel that runs two or three
operations earlier, so HBM streams them while the GPU does other work.

Where (`plan`): a block's two add + norm kernels (`rose.kernels.gemm.add_norm`), which start early
under programmatic dependent launch and issue their share of the chunks before they wait:
- after the output projection: this block's down projection and the next block's q/k/v;
- after the down projection: the next block's output and up projections.
The first block's q/k/v, output and up are asked for by `prefetch` (one small kernel) before the
embeddings. At most ~22 MB (BGE-M3) is in flight or waiting in the H200's 50 MB L2 at a time.

A `Table` is an int64 [n, 2] device tensor of (address, bytes) chunks, built once on the host.
Tables are not used under Triton's interpreter (no PTX there) or where `enabled()` says no; the
maths never changes, so a step is the same with or without them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from rose.kernels import interpreted, launch

CHUNK = 32 * 1024  # bytes per prefetch instruction (a multiple of 16, as the instruction needs)


@functools.cache
def mode() -> str:
    """"norm" (the add + norm kernels issue the prefetches), "side" (a small kernel per block on a
    side stream, forked from the block's start), or "" (none): ROSE_PREFETCH_L2 (a knob for
    measurements; default "norm"). Only on CUDA with compute capability >= 9 (the bulk prefetch
    is Hopper's), never interpreted."""
    m = os.environ.get("ROSE_PREFETCH_L2", "norm")
    if interpreted() or m in ("", "0") or not torch.cuda.is_available():
        return ""
    if m not in ("norm", "side"):
        raise ValueError(f"ROSE_PREFETCH_L2={m!r}: norm, side or 0")
    return m if torch.cuda.get_device_capability()[0] >= 9 else ""


def table(tensors, device=None, chunk: int = CHUNK) -> torch.Tensor:
    """The (address, bytes) chunks covering `tensors`' storage, int64 [n, 2] on their device (or
    `device`). Each tensor must be contiguous and start 16-byte aligned; its last chunk is rounded
    up to 16 bytes (read past the end, within the allocation's granularity, never written)."""
    rows = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("prefetch: a tensor must be contiguous")
        addr, size = t.data_ptr(), t.numel() * t.element_size()
        if addr % 16:
            raise ValueError(f"prefetch: address {addr:#x} is not 16-byte aligned")
        for off in range(0, size, chunk):
            rows.append((addr + off, -(-min(chunk, size - off) // 16) * 16))
    dev = device if device is not None else (tensors[0].device if tensors else "cpu")
    return torch.tensor(rows, dtype=torch.int64, device=dev).reshape(-1, 2)


@dataclass(frozen=True)
class Plan:
    """The small step's prefetches (`plan`).

    mode: "norm" or "side" (`mode()`).
    first: the table asked for before the embeddings (the first block's q/k/v, out, up in "norm";
           its q/k/v in "side").
    points: "norm": per block, the tables of its two add + norm kernels (after out, after down).
    side: "side": per block, the table its side kernel asks for at the block's start (its out, up,
          down and the next block's q/k/v).
    stream: "side": the side stream.
    programs: "side": programs per side kernel (ROSE_PREFETCH_PROGRAMS, default 32)."""
    mode: str
    first: torch.Tensor
    points: list = field(default_factory=list)
    side: list = field(default_factory=list)
    stream: object = None
    programs: int = 32


def plan(blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> Plan | None:
    """The prefetch `Plan` for blocks' (qkv, out, up, down) weights in order; None without a `mode()`."""
    m = mode()
    if not m or not blocks:
        return None
    n = len(blocks)
    nxt = lambda i: blocks[i + 1] if i + 1 < n else None  # noqa: E731
    if m == "side":
        side = [table([o, u, d] + ([nxt(i)[0]] if nxt(i) else [])) for i, (_, o, u, d) in enumerate(blocks)]
        return Plan(m, table([blocks[0][0]]), side=side, stream=torch.cuda.Stream(blocks[0][0].device),
                    programs=int(os.environ.get("ROSE_PREFETCH_PROGRAMS", "32")))
    points = [(table([d] + ([nxt(i)[0]] if nxt(i) else [])), table([nxt(i)[1], nxt(i)[2]]) if nxt(i) else None)
              for i, (_, _, _, d) in enumerate(blocks)]
    return Plan(m, table(list(blocks[0][:3])), points=points)


@triton.jit
def issue(pf_ptr, pf_n, BLOCK: tl.constexpr):
    """This program's share of table `pf_ptr` ([pf_n, 2] int64): one bulk L2 prefetch per chunk.
    Call it before `gdc_wait`: it depends on nothing. BLOCK: the program's thread count (one chunk
    per thread per round)."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0) + \
        tl.program_id(2) * tl.num_programs(0) * tl.num_programs(1)
    progs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    for c0 in range(0, pf_n, progs * BLOCK):  # chunk c goes to program c % progs
        offs = c0 + tl.arange(0, BLOCK) * progs + pid
        m = offs < pf_n
        addr = tl.load(pf_ptr + 2 * offs, mask=m, other=0)
        size = tl.load(pf_ptr + 2 * offs + 1, mask=m, other=0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n.reg .pred %pf;\nsetp.ne.s32 %pf, $2, 0;\n@%pf cp.async.bulk.prefetch.L2.global [$1], $2;\n"
            "mov.u32 $0, 0;\n}", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(pf_ptr, pf_n, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    issue(pf_ptr, pf_n, BLOCK)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # done only after its predecessor: the chain's order holds


def prefetch(tab: torch.Tensor | None, programs: int = 8, chained: bool = True) -> None:
    """Launch the bulk prefetch of table `tab` (None: nothing) on the current stream; `chained`:
    in the step's PDL chain (else a plain launch, as on a side stream)."""
    if tab is None or not tab.shape[0]:
        return
    if chained:
        launch(_prefetch_kernel, (programs,), tab, tab.shape[0], BLOCK=128, num_warps=4)
    else:
        _prefetch_kernel[(programs,)](tab, tab.shape[0], BLOCK=128, USE_GDC=False, num_warps=4)


def at_block(p: Plan | None, i: int) -> tuple:
    """At block i's start: in "side" mode fork the side stream from here and launch the block's
    side kernel; returns block i's two add + norm tables ((None, None) unless "norm")."""
    if p is None:
        return None, None
    if p.mode == "side":
        p.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(p.stream):
            prefetch(p.side[i], p.programs, chained=False)
        return None, None
    return p.points[i]


def start(p: Plan | None) -> None:
    """At a small step's start: the first table, in the chain."""
    if p is not None:
        prefetch(p.first)


def join(p: Plan | None) -> None:
    """At a small step's end: the current stream waits for the side stream (graph capture needs
    every fork joined)."""
    if p is not None and p.mode == "side":
        torch.cuda.current_stream().wait_stream(p.stream)
