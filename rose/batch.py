"""`Batch`: the one thing that crosses from Tulip to ROSE.

A batch is ragged: every sequence's tokens sit back to back on one flat axis,
with `cu_seqlens` marking where each starts. There is no padding between
sequences and no KV cache. Everything here is built on the host; the engine
copies it to the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


# One sequence's positions and seq_ids are a prefix of these (views: no allocation per batch),
# its cu_seqlens one small tensor per length, all three (and their numpy arrays) kept per length in `_ONE` (one dict look-up:
# a torch call per tensor costs more than the rest of an online request's batch).
# Shared, so nothing may write into a Batch's tensors (the engine only copies them to the device).
_ARANGE = torch.arange(0, dtype=torch.int64)
_ZEROS = torch.zeros(0, dtype=torch.int64)
_ONE: dict[int, tuple] = {}


def _one_sequence(n: int) -> tuple:
    """(positions, cu_seqlens, seq_ids) of a one-sequence batch of `n` tokens, then the same three as
    numpy arrays (the same memory)."""
    global _ARANGE, _ZEROS
    if n > _ARANGE.shape[0]:
        size = 1 << (n - 1).bit_length()
        _ARANGE, _ZEROS = torch.arange(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int64)
    pos, cu, sid = _ARANGE[:n], torch.tensor([0, n], dtype=torch.int32), _ZEROS[:n]
    one = _ONE[n] = (pos, cu, sid, pos.numpy(), cu.numpy(), sid.numpy())
    return one


@dataclass(frozen=True)
class Batch:
    """A ragged batch of N sequences, T tokens in all.

    input_ids:  int64 [T]   token ids, sequence after sequence.
    positions:  int64 [T]   position of each token inside its sequence (0-based).
    cu_seqlens: int32 [N+1] cumulative lengths: sequence i is tokens
                cu_seqlens[i]:cu_seqlens[i+1].
    max_seqlen: longest sequence in the batch, in tokens.
    seq_lens:   host copy of the N lengths (the engine reads it without a
                device sync).
    seq_ids:    int64 [T]   index of the sequence each token belongs to (pooling uses it);
                tokens pooling must leave out (a prompt prefix, see `from_sequences`) carry N
                instead: pooling drops that row.
    segment_starts: int64 [N] or None: per sequence, where its second segment starts (a cross-encoder's
                query-document pair: token type 1 from there on), 0 for one segment; None when no
                sequence has two (the usual case: nothing to copy, no token types).
    host:       (input_ids, positions, seq_ids, cu_seqlens) as numpy arrays over the same memory, or
                None; `from_sequences` sets it, and the GraphRunner stages a step from it (a
                `Tensor.numpy()` call per tensor cost ~1.9 us of an H200 host's time before each replay).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: tuple[int, ...]
    seq_ids: torch.Tensor
    segment_starts: torch.Tensor | None = None
    host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False,
                                                                              compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int] | np.ndarray],
                       pool_from: Sequence[int] | None = None,
                       segment_starts: Sequence[int] | None = None) -> "Batch":
        """Pack token-id sequences (lists or int arrays) into one ragged batch. `pool_from[i]`:
        how many leading tokens of sequence i pooling leaves out (they still attend).
        `segment_starts[i]`: where sequence i's second segment starts (0: none; checked by the caller)."""
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        if segment_starts is not None and any(segment_starts):
            if len(segment_starts) != len(seqs):
                raise ValueError(f"{len(segment_starts)} segment starts for {len(seqs)} sequences")
            b = cls.from_sequences(seqs, pool_from)
            return dataclasses.replace(b, segment_starts=torch.tensor(segment_starts, dtype=torch.int64))
        if pool_from is not None and any(pool_from):
            b = cls.from_sequences(seqs)
            seq_ids = b.seq_ids.clone()  # (a one-sequence batch shares its seq_ids): mark the left-out tokens
            seq_ids.numpy()[b.positions.numpy() < np.repeat(np.asarray(pool_from, dtype=np.int64), b.seq_lens)] = \
                b.num_seqs
            return cls(b.input_ids, b.positions, b.cu_seqlens, b.max_seqlen, b.seq_lens, seq_ids)
        if len(seqs) == 1:  # the online case: skip the ragged bookkeeping
            ids = np.asarray(seqs[0], dtype=np.int64)
            n = ids.shape[0]
            if n == 0:
                raise ValueError("empty sequence at index 0")
            positions, cu, seq_ids, pos_np, cu_np, sid_np = _ONE.get(n) or _one_sequence(n)
            return cls(torch.from_numpy(ids), positions, cu, n, (n,), seq_ids, host=(ids, pos_np, sid_np, cu_np))
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        if (lens <= 0).any():
            raise ValueError(f"empty sequence at index {int(np.argmin(lens))}")
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
        cu = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        seq_ids = np.repeat(np.arange(len(seqs), dtype=np.int64), lens)
        positions = np.arange(ids.shape[0], dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
        return cls(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            cu_seqlens=torch.from_numpy(cu),
            max_seqlen=int(lens.max()),
            seq_lens=tuple(int(x) for x in lens),
            seq_ids=torch.from_numpy(seq_ids),
            host=(ids, positions, seq_ids, cu),
        )
