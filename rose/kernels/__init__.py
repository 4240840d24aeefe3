"""Triton kernels for the small-batch step (steps of up to a few thousand tokens), each beside the
unfused torch maths it must equal (`*_reference`, CPU-runnable).

`available()` says whether Triton is importable and can run here: on CUDA, or on CPU under
Triton's interpreter (`TRITON_INTERPRET=1`, how the CPU tests run these kernels). Without it the
models keep their torch path. Kernels launch with programmatic dependent launch (PDL, Hopper and
newer) when `pdl()` says so: each waits for its predecessor's writes (`gdc_wait`), then lets its
successor launch, so a chain of them overlaps each launch with the previous kernel's work.
`shape_class` is the class of a step's attention shape that every per-shape choice reads (the
attention table's backend, the attention kernel's tile).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def pdl() -> bool:
    """Programmatic dependent launch: CUDA, compute capability >= 9, not interpreted, not disabled
    (ROSE_PDL=0)."""
    if interpreted() or os.environ.get("ROSE_PDL", "1") == "0":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def shape_class(seqs: int, max_len: int) -> tuple[int, int]:
    """The class of a step's attention shape that every per-shape choice reads (the swept table's
    backend, the Triton kernel's launch tile): sequences and the longest length rounded up to powers
    of two, lengths from 64. A batch has the same class eagerly as under its graph key (whose
    sequence bucket is that power of two and whose length bucket rounds up to it), so a step computes
    the same bits whether it was captured or not (e5-mistral at 4 x 600 tokens had taken one backend
    for its 600 tokens and another for its graph's 1,024-token bucket: cosine 0.9983)."""
    return 1 << (max(seqs, 1) - 1).bit_length(), max(64, 1 << (max(max_len, 1) - 1).bit_length())


def launch(kernel, grid, *args, **kw) -> None:
    """Launch a ROSE Triton kernel (each takes USE_GDC) on `grid`, with PDL where `pdl()` says so."""
    if pdl():
        kernel[grid](*args, **kw, USE_GDC=True, launch_pdl=True)
    else:
        kernel[grid](*args, **kw, USE_GDC=False)
