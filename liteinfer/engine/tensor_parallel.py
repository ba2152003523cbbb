"""Tensor parallelism: one process per rank, each running an engine core over its shard of the
model (layers/linear.py splits the projections; the KV pool holds the rank's KV heads).

Every rank runs the same EngineCore calls in the same order. Started from one process, rank 0
spawns the others (WorkerGroup) and sends each add_request / abort_requests / step to them
before running it itself; only rank 0's core has a front end, so the other ranks never tokenize
or detokenize. Started by torchrun on one or several nodes, every rank runs the same program,
so the same calls, by itself (as vLLM's external launcher does). Their schedulers therefore
make the same decisions with the same number of KV blocks, their layers meet in the all-reduces
of the row-parallel projections and the vocabulary-split embedding, and the LM head's logits are
all-gathered, so every rank samples the same tokens from the same logits with the same
generator state. Only rank 0's outputs reach the caller.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from liteinfer.config import EngineConfig
from liteinfer.utils import free_port

# A rank's main function: (rank, init_method, model, config, load_format, connection to rank 0).
RankMain = Callable[[int, str, str, EngineConfig, str, Connection], None]


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


class WorkerGroup:
    """Ranks 1..tp_size-1 in processes of their own; the calling process becomes rank 0."""

    def __init__(self, model: str, config: EngineConfig, load_format: str, rank_main: RankMain):
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; "
                             "shut it down first")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(1, config.tensor_parallel_size):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, daemon=True, name=f"liteinfer-tp{rank}",
                               args=(rank, init_method, model, config, load_format, child))
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        self._join_group(config, init_method)

    def _join_group(self, config: EngineConfig, init_method: str) -> None:
        """Joins the group as rank 0, failing fast if a rank dies before it joins (as a spawned
        rank does when the script that started it has no `if __name__ == "__main__":` guard)."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                init_distributed(0, config.tensor_parallel_size, init_method, config.device)
            except BaseException as e:  # re-raised by the caller
                errors.append(e)

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            for proc in self.procs:
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"{proc.name} exited (code {proc.exitcode}) before joining the "
                        "tensor-parallel group; a script that starts a tensor-parallel engine "
                        "must guard its entry point with `if __name__ == \"__main__\":`")
        if errors:
            raise errors[0]

    def call(self, method: str, *args: Any) -> None:
        """Has every other rank's engine run `method(*args)`."""
        self.check()
        try:
            for conn in self.conns:
                conn.send((method, args))
        except OSError as e:  # a rank's end of the pipe closed: it is exiting
            for proc in self.procs:
                proc.join(timeout=1.0)
            self.check()
            raise RankDiedError(f"a tensor-parallel rank stopped answering: {e}") from e

    def check(self) -> None:
        """RankDiedError (the other ranks stopped) if any rank has exited. Called before each
        call and when a step fails: a collective with a dead rank fails (gloo) or times out
        (COLLECTIVE_TIMEOUT) rather than waiting forever."""
        dead = [p for p in self.procs if p.exitcode is not None]
        if dead:
            self.kill()
            raise RankDiedError(f"tensor-parallel {dead[0].name} exited (code "
                                f"{dead[0].exitcode}); the engine has stopped")

    def kill(self) -> None:
        """Stops every other rank at once (no collective is waited for)."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join()

    def shutdown(self) -> None:
        """Stops the other ranks; the caller has freed its own graphs (ModelRunner.release_graphs).
        All ranks leave the group at once, as NCCL's teardown waits for every one."""
        try:
            self.call("shutdown")
        except RankDiedError:
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
        for proc in self.procs:
            proc.join()


def serve_rank(engine: Any, conn: Connection) -> None:
    """Runs rank 0's calls on this rank's `engine` until shutdown, then leaves the group."""
    while True:
        method, args = conn.recv()
        if method == "shutdown":
            break
        getattr(engine, method)(*args)
    engine.runner.release_graphs()
    dist.destroy_process_group()
