"""Tokens sampled on the device whose ids the host has not read yet (overlapped steps).

The scheduler counts them per sequence (`num_pending`) and the runner's request states carry
the count and the row of the newest one in the step that sampled it (`pending_row`). A step's
inputs give such a token id 0 and its row (NOT_PENDING for an id the host knows), and the model
reads the id from the newest step's samples on the device (`PendingTokens.read`), eager or
captured alike. A sequence with a pending token decodes it alone (one token a step).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

NOT_PENDING = -1  # an input row whose token id the host knows


class PendingRequest(Protocol):
    token_ids: list[int]
    num_pending: int
    pending_row: int


class PendingTokens:
    """The newest step's sampled tokens on the device, which feed the next step (a draft
    model's steps read the target's: `DraftModelRunner`)."""

    def __init__(self, max_rows: int, device: torch.device):
        self.sampled = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def keep(self, token_ids: torch.Tensor) -> None:
        """The step's samples, row by row (`assign_rows` says which row is whose)."""
        self.sampled[:token_ids.shape[0]].copy_(token_ids)

    def read(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Token ids with the pending ones (row >= 0) read from the newest samples."""
        return torch.where(rows >= 0, self.sampled[rows.clamp(min=0)], ids)


def last_token_inputs(seqs: Sequence[PendingRequest]) -> tuple[list[int], list[int]]:
    """The id and pending row of each decoding sequence's one input token, its newest."""
    ids, rows = [], []
    for seq in seqs:
        if seq.num_pending:
            ids.append(0)
            rows.append(seq.pending_row)
        else:
            ids.append(seq.token_ids[-1])
            rows.append(NOT_PENDING)
    return ids, rows


def assign_rows(sampling_seqs: Sequence[PendingRequest]) -> None:
    """A step is launched: each sampling request's newest pending token will be in the step's
    row it samples last in (`sampling_seqs`: the request of every sampled row, in order)."""
    for row, seq in enumerate(sampling_seqs):
        seq.pending_row = row
