"""Where a few-row GEMM cut along K (kernels/fewrow_gemm.py's swapped kernel, kernels/wna16.py's
few-row kernel) sums its splits: a workspace the model runner allocates for its models' layers
and frees with its graphs. Kept apart from the kernels so that the runner needs no Triton."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows the few-row kernels take: their input rows are one tile (BLOCK_M) of wgmma operands, and
# each split's partial holds that many rows of every feature.
FEWROW_MAX_ROWS = 128


@dataclass
class SplitKWorkspace:
    """fp32 partials, flat (a launch of N features cut into `splits` takes [splits, N,
    FEWROW_MAX_ROWS] of them), and int32 arrival counters, one a tile, zero between launches
    (each tile's last split resets its own). The model runner allocates one for all the layers
    of its models (LayerOps.scratch) before capturing its graphs and frees it with them; the
    launches that share it are stream-ordered, and under PDL each waits for the one before to
    end before it touches it."""

    partials: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, launches: list[tuple[int, int]], device: torch.device | str
                 ) -> SplitKWorkspace | None:
        """Room for every launch of `launches`, each (N, splits); None if there are none."""
        if not launches:
            return None
        partials = max(n * splits for n, splits in launches) * FEWROW_MAX_ROWS
        return cls(torch.empty(partials, dtype=torch.float32, device=device),
                   torch.zeros(max(n for n, _ in launches), dtype=torch.int32, device=device))

    def fits(self, n: int, splits: int) -> bool:
        return (splits * n * FEWROW_MAX_ROWS <= self.partials.numel()
                and n <= self.counters.numel())


def split_buffers(workspace: SplitKWorkspace | None, n: int, splits: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials and counters of a launch of N features cut into `splits` (> 1): the given
    workspace's, or, without one (a kernel test, a benchmark), a workspace of its own."""
    if workspace is None:
        workspace = SplitKWorkspace.allocate([(n, splits)], device)
    assert workspace.fits(n, splits), f"the split-K workspace has no room for {splits} x {n}"
    return workspace.partials, workspace.counters
