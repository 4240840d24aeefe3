"""Triton kernels for the small-batch step (steps of up to a few thousand tokens), each beside the
unfused torch maths it must equal (`*_reference`, CPU-runnable).

`available()` says whether Triton is importable and can run here: on CUDA, or on CPU under
Triton's interpreter (`TRITON_INTERPRET=1`, how the CPU tests run these kernels). Without it the
models keep their torch path. Kernels launch with programmatic dependent launch (PDL, Hopper and
newer) when `pdl()` says so: each waits for its predecessor's writes (`gdc_wait`), then lets its
successor launch, so a chain of them overlaps each launch with the previous kernel's work.
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



def launch(kernel, grid, *args, **kw) -> None:
    """Launch a ROSE Triton kernel (each takes USE_GDC) on `grid`, with PDL where `pdl()` says so."""
    if pdl():
        kernel[grid](*args, **kw, USE_GDC=True, launch_pdl=True)
    else:
        kernel[grid](*args, **kw, USE_GDC=False)
