"""Tensor-parallel workers: ranks 1..N-1 of an engine started from one process, each a
ModelRunner over its shard of the model, fed every step by rank 0 (as vLLM v1's workers).

Rank 0 alone schedules (engine/core.py). Once `Scheduler.schedule()` has picked a step, rank 0's
WorkerGroup sends each worker the step's SchedulerOutput (engine/scheduler_output.py: plain
data, deltas only), then rank 0's own runner runs the same message. Every rank's runner applies
it to its own state of the requests and runs the same `ModelRunner.execute`, so the ranks meet
in the same collectives. A request's state keeps its seeded generator from step to step, and
every rank samples from the same all-gathered logits, so every rank's generators advance alike
and every rank's sampled tokens, which stay on its device to feed its next step, are the same.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import tempfile
import threading
from multiprocessing.connection import Connection, wait

import msgspec
import torch
import torch.distributed as dist

from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.model_runner import ModelRunner
from liteinfer.engine.scheduler_output import SchedulerOutput
from liteinfer.engine.tensor_parallel import RankDiedError, init_distributed
from liteinfer.loader import load_model_source
from liteinfer.logger import configure_logging
from liteinfer.utils import freeze_heap

logger = logging.getLogger(__name__)

# Seconds a failed send or step waits for a rank to be seen exiting, if none is yet.
EXIT_WAIT = 1.0


class Worker:
    """A rank > 0: its model runner, which keeps its own state of every request. It never
    schedules: it holds no scheduler, block manager or tokenizer."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute_model(self, out: SchedulerOutput) -> None:
        try:
            self.runner.execute(self.runner.stage(out))
        except Exception:  # rank 0's step fails too, and fails its requests; the worker goes on
            logger.exception("tensor-parallel rank %d: a step failed", self.runner.tp_rank)

    def serve(self, conn: Connection) -> None:
        """Runs rank 0's steps until it sends None, then leaves the group."""
        decoder = msgspec.msgpack.Decoder(SchedulerOutput | None)
        while (step := decoder.decode(conn.recv_bytes())) is not None:
            self.execute_model(step)
        self.runner.release()
        dist.destroy_process_group()


def run_worker(rank: int, init_method: str, model: str, config: EngineConfig, load_format: str,
               eos_token_ids: list[int], conn: Connection) -> None:
    """The main function of rank `rank` > 0, in a process of its own. `config` is resolved
    (engine/core.py resolve_config); the EOS ids come from rank 0, which has the tokenizer."""
    configure_logging()
    init_distributed(rank, config.tensor_parallel_size, init_method, config.device)
    source = load_model_source(model, load_format)
    # As on rank 0: unseeded requests draw from the default generator, the same on every rank.
    torch.manual_seed(config.seed)
    runner = ModelRunner(ModelConfig.from_hf(source.hf_config), config, source,
                         source.load_format, eos_token_ids, rank)
    freeze_heap()
    Worker(runner).serve(conn)


class WorkerGroup:
    """Ranks 1..tp_size-1 as workers in processes of their own; the calling process becomes
    rank 0 and sends them each step (`execute_model`)."""

    def __init__(self, model: str, config: EngineConfig, load_format: str,
                 eos_token_ids: list[int]):
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; "
                             "shut it down first")
        # The ranks meet through a file, not a port: a port chosen free now could be taken by
        # another process before rank 0 binds it, while the workers start.
        self.rendezvous = tempfile.TemporaryDirectory(prefix="liteinfer-tp-")
        init_method = f"file://{self.rendezvous.name}/store"
        ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(1, config.tensor_parallel_size):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, daemon=True, name=f"liteinfer-tp{rank}",
                               args=(rank, init_method, model, config, load_format,
                                     eos_token_ids, child))
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        self._encoder = msgspec.msgpack.Encoder()
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

    def execute_model(self, out: SchedulerOutput) -> None:
        """Has every worker run the step that rank 0 runs next."""
        self._send(out)

    def _send(self, step: SchedulerOutput | None) -> None:
        """Sends every worker `step` (None: shut down)."""
        self.check()
        message = self._encoder.encode(step)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except OSError as e:  # a rank's end of the pipe closed: it is exiting
            self.check(EXIT_WAIT)
            raise RankDiedError(f"a tensor-parallel rank stopped answering: {e}") from e

    def check(self, timeout: float = 0.0) -> None:
        """RankDiedError (the other ranks stopped) if any rank has exited or exits within
        `timeout` seconds. Called before each send and when a step fails: a collective with a
        dead rank fails (gloo) or times out (COLLECTIVE_TIMEOUT) rather than waiting forever."""
        # A process's sentinel is ready once its files are closed, as its sockets and pipe
        # are, which is before it can be reaped (exitcode).
        exiting = wait([p.sentinel for p in self.procs], timeout)
        dead = [p for p in self.procs if p.sentinel in exiting]
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
        """Stops the other ranks; the caller has freed its own graphs (ModelRunner.release).
        All ranks leave the group at once, as NCCL's teardown waits for every one."""
        try:
            self._send(None)
        except RankDiedError:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group()
            for proc in self.procs:
                proc.join()
        self.rendezvous.cleanup()
