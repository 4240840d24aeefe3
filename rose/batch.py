"""`Batch`: the one thing that crosses from Tulip to ROSE.

A batch is ragged: every sequence's tokens sit back to back on one flat axis,
with `cu_seqlens` marking where each starts. There is no padding between
sequences and no KV cache. Everything here is built on the host; the engine
copies it to the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


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
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: tuple[int, ...]
    seq_ids: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int] | np.ndarray],
                       pool_from: Sequence[int] | None = None) -> "Batch":
        """Pack token-id sequences (lists or int arrays) into one ragged batch. `pool_from[i]`:
        how many leading tokens of sequence i pooling leaves out (they still attend)."""
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        if pool_from is not None and any(pool_from):
            b = cls.from_sequences(seqs)  # its seq_ids are its own: mark the left-out tokens in place
            b.seq_ids.numpy()[b.positions.numpy() < np.repeat(np.asarray(pool_from, dtype=np.int64), b.seq_lens)] = \
                b.num_seqs
            return b
        if len(seqs) == 1:  # the online case: skip the ragged bookkeeping
            ids = np.asarray(seqs[0], dtype=np.int64)
            n = ids.shape[0]
            if n == 0:
                raise ValueError("empty sequence at index 0")
            return cls(torch.from_numpy(ids), torch.from_numpy(np.arange(n)),
                       torch.from_numpy(np.array([0, n], dtype=np.int32)), n, (n,),
                       torch.from_numpy(np.zeros(n, dtype=np.int64)))
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
        )
