"""Tensor-parallel workers: ranks 1..N-1 of an engine started from one process, each a
ModelRunner over its shard of the model, fed every step by rank 0 (as vLLM v1's workers).

Rank 0 alone schedules (engine/core.py). Once `Scheduler.schedule()` has picked a step, rank 0's
WorkerGroup sends each worker a WorkerStep, then rank 0 runs the step itself. A WorkerStep holds
the requests the workers have not seen (prompt and sampling params, once), the ids of those
that finished since, and for each of the step's sequences what changed on rank 0 since it was
last sent: the token ids appended (sampled tokens rank 0 has read), the blocks added (the whole
table after a preemption), and its counters. A worker applies it to its mirror of the requests
(`Sequence`s holding what the model runner reads), rebuilds the step's SchedulerOutput over
them and runs the same `ModelRunner.execute` as rank 0, so the ranks meet in the same
collectives. A mirrored sequence keeps its seeded generator from step to step, and every rank
samples from the same all-gathered logits, so every rank's generators advance alike and every
rank's sampled tokens, which stay on its device to feed its next step, are the same.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import msgspec
import torch
import torch.distributed as dist

from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.model_runner import ModelRunner
from liteinfer.engine.scheduler import SchedulerOutput
from liteinfer.engine.sequence import Sequence
from liteinfer.engine.tensor_parallel import RankDiedError, init_distributed
from liteinfer.loader import load_model_source
from liteinfer.logger import configure_logging
from liteinfer.sampling_params import SamplingParams
from liteinfer.utils import free_port, freeze_heap

logger = logging.getLogger(__name__)

# Seconds a failed send or step waits for a rank to be seen exiting, if none is yet.
EXIT_WAIT = 1.0


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the workers have not seen, sent with its first step."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class ScheduledSeq(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence of a step: what changed on rank 0 since the workers last saw it, and the
    counters the step reads (as rank 0's sequence holds them before the step)."""

    req_id: str
    num_tokens: int  # tokens it computes in this step
    num_computed_tokens: int
    new_token_ids: list[int] = []  # appended to its token ids
    new_block_ids: list[int] = []  # appended to its block table
    resumed: bool = False  # new_block_ids is its whole table (admitted again after preemption)
    num_pending: int = 0
    pending_row: int = -1
    draft_token_ids: list[int] = []  # the drafts it verifies in this step


class WorkerStep(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a worker needs to run one step: its SchedulerOutput as deltas."""

    seqs: list[ScheduledSeq]
    is_prefill: bool
    num_decodes: int
    new_requests: list[NewRequestData] = []
    finished_req_ids: list[str] = []


@dataclass
class _Sent:
    """What the workers hold of one of rank 0's sequences."""

    seq: Sequence
    num_token_ids: int
    # The table the blocks were sent from: the block manager grows a table in place and
    # replaces it only when the sequence is freed (preempted) and admitted again.
    block_table: list[int]
    num_blocks: int


class WorkerStepBuilder:
    """Rank 0's record of what the workers hold of each request, and the deltas that bring
    them up to a step."""

    def __init__(self) -> None:
        self.sent: dict[str, _Sent] = {}

    def build(self, out: SchedulerOutput) -> WorkerStep:
        # Dropped first: a new request may reuse the id of one that finished.
        finished = [rid for rid, sent in self.sent.items() if sent.seq.is_finished]
        for rid in finished:
            del self.sent[rid]
        new, seqs = [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_tokens)):
            rid = seq.request_id
            sent = self.sent.get(rid)
            if sent is None:
                new.append(NewRequestData(rid, seq.prompt_token_ids, seq.sampling_params))
                sent = self.sent[rid] = _Sent(seq, seq.num_prompt_tokens, seq.block_table, 0)
            resumed = seq.block_table is not sent.block_table
            seqs.append(ScheduledSeq(
                rid, n, seq.num_computed_tokens, seq.token_ids[sent.num_token_ids:],
                seq.block_table[0 if resumed else sent.num_blocks:], resumed, seq.num_pending,
                seq.pending_row, out.draft_token_ids[i] if out.draft_token_ids else []))
            sent.num_token_ids = len(seq.token_ids)
            sent.block_table, sent.num_blocks = seq.block_table, len(seq.block_table)
        return WorkerStep(seqs, out.is_prefill, out.num_decodes, new, finished)


class Worker:
    """A rank > 0: its model runner and the mirror of each request's state the runner reads.
    It never schedules: it holds no scheduler, block manager or tokenizer."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.requests: dict[str, Sequence] = {}

    def execute_model(self, step: WorkerStep) -> None:
        batch = self._apply(step)
        try:
            output = self.runner.execute(batch)
        except Exception:  # rank 0's step fails too, and fails its requests; the worker goes on
            logger.exception("tensor-parallel rank %d: a step failed", self.runner.tp_rank)
            return
        # As rank 0's scheduler records them: a prompt recomputed after preemption is not
        # scored twice (SchedulerOutput.prompt_logprob_spans).
        for (i, _, _), entries in zip(batch.prompt_logprob_spans, output.prompt_logprobs):
            batch.seqs[i].prompt_logprobs.extend(entries)

    def _apply(self, step: WorkerStep) -> SchedulerOutput:
        """Brings the mirror up to the step; returns the step over the mirrored sequences."""
        for rid in step.finished_req_ids:
            del self.requests[rid]
        for new in step.new_requests:
            self.requests[new.req_id] = Sequence(new.req_id, new.prompt_token_ids,
                                                 new.sampling_params)
        seqs = []
        for s in step.seqs:
            seq = self.requests[s.req_id]
            seq.token_ids += s.new_token_ids
            if s.resumed:
                seq.block_table = s.new_block_ids
            else:
                seq.block_table += s.new_block_ids
            seq.num_computed_tokens = s.num_computed_tokens
            seq.num_pending, seq.pending_row = s.num_pending, s.pending_row
            seqs.append(seq)
        drafts = [s.draft_token_ids for s in step.seqs]
        return SchedulerOutput(seqs, [s.num_tokens for s in step.seqs], step.is_prefill,
                               step.num_decodes, drafts if any(drafts) else [])

    def serve(self, conn: Connection) -> None:
        """Runs rank 0's steps until it sends None, then leaves the group."""
        decoder = msgspec.msgpack.Decoder(WorkerStep | None)
        while (step := decoder.decode(conn.recv_bytes())) is not None:
            self.execute_model(step)
        self.runner.release_graphs()
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
        init_method = f"tcp://127.0.0.1:{free_port()}"
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
        self.steps = WorkerStepBuilder()
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

    def execute_model(self, scheduled: SchedulerOutput) -> None:
        """Has every worker run the step that rank 0 runs next."""
        self._send(self.steps.build(scheduled))

    def _send(self, step: WorkerStep | None) -> None:
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
        """Stops the other ranks; the caller has freed its own graphs (ModelRunner.release_graphs).
        All ranks leave the group at once, as NCCL's teardown waits for every one."""
        try:
            self._send(None)
        except RankDiedError:
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
        for proc in self.procs:
            proc.join()
