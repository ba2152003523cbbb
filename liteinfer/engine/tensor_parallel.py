"""Tensor parallelism: one process per rank, each running a model runner over its shard of the
model (layers/linear.py splits the projections; the KV pool holds the rank's KV heads). The
ranks' layers meet in the all-reduces of the row-parallel projections and the vocabulary-split
embedding, and the LM head's logits are all-gathered, so every rank samples the same tokens from
the same logits with the same generator state. Only rank 0's outputs reach the caller.

Started from one process (engine/worker.py), rank 0 alone runs the engine core: scheduler,
block manager, structured outputs, front end. It spawns the other ranks as workers, each a
ModelRunner, and sends them every step it schedules before running it itself; the workers never
schedule, tokenize or detokenize. Started by torchrun on one or several nodes, every rank runs
the same program and its own engine core in lockstep (as vLLM's external launcher does): their
schedulers make the same decisions from the same calls and the same number of KV blocks.

Either way the ranks agree on the KV pool's size (the smallest any rank can hold;
ModelRunner._size_kv_pool), and a rank that exits stops the engine (RankDiedError) rather
than leaving the others waiting in a collective.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits this long for a rank that stopped answering fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited: the engine cannot go on."""


def torchrun_rank() -> int | None:
    """This process's rank when torch's launcher (torchrun, one process per rank on each node)
    started it, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"])


def init_distributed(rank: int, world_size: int, init_method: str, device: str,
                     local_rank: int | None = None) -> None:
    """Joins the tensor-parallel group: NCCL with one GPU per rank (the rank's GPU on its own
    node), gloo on CPU."""
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
