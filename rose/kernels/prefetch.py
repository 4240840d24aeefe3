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

import torch
import triton
import triton.language as tl

from rose.kernels import interpreted, launch

CHUNK = 32 * 1024  # bytes per prefetch instruction (a multiple of 16, as the instruction needs)


@functools.cache
def enabled() -> bool:
    """On CUDA (compute capability >= 9: the bulk prefetch is Hopper's), not interpreted, unless
    ROSE_PREFETCH_L2=0 (a knob for measurements)."""
    if interpreted() or os.environ.get("ROSE_PREFETCH_L2", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


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


def plan(blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]):
    """For blocks' (qkv, out, up, down) weights in order: the tables of the first block's start
    (`prefetch`) and of each block's two add + norm kernels ([(after out, after down)]), as the
    module docstring says; None where there is nothing to ask for. None if not `enabled()`."""
    if not enabled() or not blocks:
        return None
    n = len(blocks)
    first = table([blocks[0][0], blocks[0][1], blocks[0][2]])
    points = []
    for i, (_, _, _, down) in enumerate(blocks):
        nxt = blocks[i + 1] if i + 1 < n else None
        after_out = table([down] + ([nxt[0]] if nxt else []))
        after_down = table([nxt[1], nxt[2]]) if nxt else None
        points.append((after_out, after_down))
    return first, points


@triton.jit
def issue(pf_ptr, pf_n, BLOCK: tl.constexpr):
    """This program's share of table `pf_ptr` ([pf_n, 2] int64): one bulk L2 prefetch per chunk.
    Call it before `gdc_wait`: it depends on nothing. BLOCK: the program's thread count (one chunk
    per thread per round)."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0) + \
        tl.program_id(2) * tl.num_programs(0) * tl.num_programs(1)
    progs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    for c0 in range(pid * BLOCK, pf_n, progs * BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
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


def prefetch(tab: torch.Tensor | None, programs: int = 8) -> None:
    """Launch the bulk prefetch of table `tab` (None: nothing) on the current stream."""
    if tab is None or not tab.shape[0]:
        return
    launch(_prefetch_kernel, (programs,), tab, tab.shape[0], BLOCK=128, num_warps=4)
