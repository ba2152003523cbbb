"""The token embedding and the LM head, split over tensor-parallel ranks by vocabulary.

Each rank holds a contiguous slice of the vocabulary's rows. Under tensor parallelism the
vocabulary is padded to a multiple of VOCAB_PADDING * tp_size, so every slice has the same size
and stays aligned for the GEMM; the padding rows are zeros. A lookup on one rank yields the rows
of its own ids and zeros for the rest, and the ranks' results are all-reduced. The LM head
multiplies by the rank's slice, and the slices' logits are all-gathered, padding dropped, so
every rank samples from the full logits. With one rank there is no padding and no collective:
the layers are nn.Embedding's lookup and the LM head GEMM (or GEMV, for one row) of today.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from liteinfer.layers.linear import UnquantizedLinearMethod, matmul_normed
from liteinfer.layers.ops import LayerOps
from liteinfer.utils import cdiv

if TYPE_CHECKING:
    from liteinfer.layers.norm_act import RMSNorm

# Rows per rank are a multiple of this (vLLM's DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64

# torch 2.13 renamed all_gather_into_tensor (now deprecated, warning per call) to
# all_gather_single; older releases only have the first.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary split over tp_size ranks: unpadded on one rank."""
    if tp_size == 1:
        return vocab_size
    multiple = VOCAB_PADDING * tp_size
    return cdiv(vocab_size, multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """The embedding of `num_embeddings` tokens, each rank holding the rows of its vocabulary
    slice [vocab_start, vocab_start + rows_per_rank), the ones past the vocabulary zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: LayerOps):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        tp_rank, tp_size = self.tp_rank, self.tp_size = ops.tp_rank, ops.tp_size
        self.rows_per_rank = padded_vocab_size(num_embeddings, tp_size) // tp_size
        self.vocab_start = tp_rank * self.rows_per_rank
        self.num_token_rows = self.rank_tokens(tp_rank)  # the rest pad
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def rank_tokens(self, rank: int) -> int:
        """How many of rank `rank`'s rows are tokens."""
        return max(0, min(self.rows_per_rank, self.num_embeddings - rank * self.rows_per_rank))

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[str | None, tuple[int, ...]]]:
        """The checkpoint tensor that fills the weight, as (shard, shape) (see _ShardedLinear)."""
        return [(None, (self.num_embeddings, self.embedding_dim))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        """Copies this rank's rows of the checkpoint's [vocab, dim] tensor; zeros the padding."""
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != (vocab, hidden) "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        n = self.num_token_rows
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_token_rows)
        x = nn.functional.embedding(local.masked_fill(~mine, 0), self.weight)
        x.masked_fill_(~mine.unsqueeze(-1), 0)
        dist.all_reduce(x)
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """logits = norm(hidden) W^T over the vocabulary, W split by rows like the embedding (and,
    with tied embeddings, the embedding's own weight: `tie_weights`). W is loaded in the model
    dtype and multiplied by the method LayerOps.quant gives an LM head (the model dtype's
    unless it gives one; one that quantizes converts its own copy after loading, so a tied
    embedding keeps its rows as they are); a one-row input goes through the GEMV kernel with
    the norm fused in under LayerOps.gemv."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: LayerOps):
        super().__init__(num_embeddings, embedding_dim, ops)
        self.use_gemv = ops.gemv
        self.scratch = ops.scratch
        quant_method = ops.quant.lm_head_method(ops.triton) if ops.quant else None
        self.quant_method = quant_method or UnquantizedLinearMethod()

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head computes logits (forward_normed), it does not embed")

    def forward_normed(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The [rows, vocab] logits of norm(hidden), on every rank."""
        logits = matmul_normed(self, hidden, norm)
        if self.tp_size == 1:
            return logits
        rows = logits.shape[0]
        gathered = logits.new_empty(self.tp_size * rows, self.rows_per_rank)
        _all_gather(gathered, logits.contiguous())
        # Rank-major slices side by side, without their padding: one copy.
        slices = [gathered[r * rows:(r + 1) * rows, :self.rank_tokens(r)]
                  for r in range(self.tp_size) if self.rank_tokens(r)]
        return torch.cat(slices, dim=1)
