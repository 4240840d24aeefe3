"""Pooling a ragged batch's hidden states into one vector per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "max", "weightedmean", "last")


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor, mode: str,
         positions: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, D] -> [N, D]. cu_seqlens int32 [N+1], seq_ids int64 [T], positions int64 [T]
    (0-based within each sequence; "weightedmean" only), on hidden's device.

    Tokens with seq_id == N (padding) are pooled into a row that is dropped. Models that leave a
    prompt out of pooling mark its tokens so too: "max" and "weightedmean" then pool the rest as they
    are, and two more modes serve such models: "first" (CLS pooling: each sequence's first kept token)
    and "mean_kept" (mean pooling divided by the tokens kept, one more kernel than "mean").
    "weightedmean" weighs each token by its 1-based position in the sequence (sentence-transformers'
    rule; a left-out prompt keeps the positions of the tokens after it). Empty sequences (padding to
    a sequence bucket) give garbage rows the caller drops. No mode reads anything back to the host.
    """
    # Empty dummy sequences may start at T (a batch that fills its bucket): clamp to a valid row.
    if mode == "cls":
        return hidden.index_select(0, cu_seqlens[:-1].long().clamp_(max=hidden.shape[0] - 1))
    if mode == "last":
        return hidden.index_select(0, (cu_seqlens[1:].long() - 1).clamp_(min=0))
    t, n = hidden.shape[0], cu_seqlens.shape[0] - 1
    if mode == "first":  # CLS pooling that may leave a prompt out: each sequence's first pooled token
        first = torch.full((n + 1,), t - 1, dtype=torch.int64, device=hidden.device)
        first.scatter_reduce_(0, seq_ids, torch.arange(t, device=hidden.device), reduce="amin")
        return hidden.index_select(0, first[:n])
    if mode == "max":  # rows no token reaches (empty dummies) keep their zeros
        out = torch.zeros(n + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        out.scatter_reduce_(0, seq_ids.unsqueeze(1).expand(-1, hidden.shape[1]), hidden.float(), reduce="amax",
                            include_self=False)
        return out[:n]
    if mode == "weightedmean":
        w = (positions + 1).float()
        sums = torch.zeros(n + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_ids, hidden.float() * w.unsqueeze(1))
        total = torch.zeros(n + 1, dtype=torch.float32, device=hidden.device)
        total.index_add_(0, seq_ids, w)
        return sums[:n] / total[:n].clamp(min=1e-9).unsqueeze(1)
    if mode in ("mean", "mean_kept"):
        sums = torch.zeros(n + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_ids, hidden.float())
        if mode == "mean":
            counts = (cu_seqlens[1:] - cu_seqlens[:-1]).float()
        else:
            counts = torch.zeros(n + 1, dtype=torch.float32, device=hidden.device)
            counts.index_add_(0, seq_ids, torch.ones(seq_ids.shape[0], dtype=torch.float32, device=hidden.device))
            counts = counts[:n]
        return sums[:n] / counts.clamp(min=1.0).unsqueeze(1)
    raise ValueError(f"unknown pooling mode {mode!r} (choose one of {POOLING_MODES})")


def kept_rows(cu_seqlens: torch.Tensor, tokens: int, mode: str) -> torch.Tensor | None:
    """The one token state per sequence that `mode` pools ("cls": the first, "last": the last; an
    empty dummy sequence's row clamped as `pool` clamps it), int64 [N] on the device, so that the
    last block computes those rows alone (`Family.forward`'s `rows`); None for the modes that read
    more (or other) rows."""
    if mode == "cls":
        return cu_seqlens[:-1].long().clamp(max=tokens - 1)
    if mode == "last":
        return (cu_seqlens[1:].long() - 1).clamp(min=0)
    return None


def keep_rows(rows: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` ([T, ...] each) at `rows` only, or as they are (None): where a block's last
    operations (after attention, which reads every token) need only the pooled rows."""
    return tensors if rows is None else tuple(t.index_select(0, rows) for t in tensors)


def pool_fused(hidden: torch.Tensor, cu_seqlens: torch.Tensor | None, mode: str, normalize: bool) -> torch.Tensor | None:
    """`pool` ("cls", "last", "mean") and then `normalize` (if asked) or float32, in Triton kernels
    (`rose.kernels.rows`: one for CLS / last, two for mean); None for the other modes, which keep
    `pool`. "mean" divides by the sequence's tokens as `pool` does (no prompt left out).
    cu_seqlens None: hidden holds one row per sequence already (`kept_rows`)."""
    from rose.kernels import rows

    hidden = hidden.contiguous()  # the kernels read [T, D] rows (a no-op for every block's output)
    if mode in ("cls", "last"):
        return rows.pool_rows(hidden, cu_seqlens, mode == "last", normalize)
    if mode == "mean":
        out = rows.pool_mean(hidden, cu_seqlens)
        return rows.normalize_rows(out) if normalize else out
    return None


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), p=2, dim=-1)
