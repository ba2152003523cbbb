"""Continuous batching: which sequences run in the next step, and how many tokens each computes."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.messages import EngineCoreOutput, SchedulerStats
from liteinfer.engine.prompt_buckets import PromptBuckets
from liteinfer.engine.runner_output import ModelRunnerOutput
from liteinfer.engine.sampler import SamplerOutput
from liteinfer.engine.scheduler_output import (
    NewRequestData,
    ScheduledRequests,
    SchedulerOutput,
)
from liteinfer.engine.sequence import Sequence, SequenceStatus
from liteinfer.engine.step_batch import StepBatch
from liteinfer.spec_decode import Speculator


@dataclass
class ScheduledStep(StepBatch[Sequence]):
    """A step as the scheduler keeps it, over its sequences, and the step's SchedulerOutput:
    what the model runner gets (set once the step is complete)."""

    output: SchedulerOutput = field(init=False)


class Scheduler:
    """First come, first served, and the owner of every request's state in the core.

    Running sequences hold KV blocks; waiting ones hold none. Every running sequence decodes one
    token per step, and prompt work (new prompts, chunked to `max_num_batched_tokens`, and
    prompts of preempted sequences being recomputed) rides in the same step, so prompts arriving
    never stall the others' decoding and a step's weights are read once for both. A step that
    decodes carries at most `mixed_prompt_tokens` prompt tokens and, where the model runner
    captures such steps (`prompt_buckets`), is trimmed to one of the sizes they come in (what a
    trimmed chunk leaves rides in the next step). A step with no prompt work decodes (captured
    in CUDA graphs). When a decode finds the pool empty, the newest running sequences are
    preempted: their blocks are freed and they return to the front of the queue, so the oldest
    requests always make progress.

    A step's life: `schedule()` picks it; once the model runner has launched it,
    `mark_launched()` counts its tokens as computed and its sampled tokens as pending (so that
    the next step can be scheduled while this one runs); `update_from_output()` appends the
    sampled tokens, applies every stop and length check and finishes requests;
    `update_draft_token_ids()` then takes the drafts a model proposed after it.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, mixed_prompt_tokens: int, eos_token_ids: Iterable[int],
                 speculator: Speculator | None = None,
                 prompt_buckets: PromptBuckets | None = None):
        """`prompt_buckets`: the model runner's captured prompt steps (None: none run)."""
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_prompt_tokens = mixed_prompt_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.speculator = speculator
        self.prompt_buckets = prompt_buckets
        # Requests the model runner holds that finished since the last step was scheduled.
        self.finished_req_ids: list[str] = []

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Remove a finished, aborted or failed sequence and return its blocks."""
        if reason is not None:
            seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.requests.pop(seq.request_id, None)
        if seq.num_sent_token_ids:
            self.finished_req_ids.append(seq.request_id)
        if self.speculator is not None:
            self.speculator.finish(seq.request_id)

    def finish_requests(self, request_ids: Iterable[str], reason: str) -> list[Sequence]:
        """Finishes the named requests that are still unfinished; returns them."""
        seqs = [self.requests[r] for r in request_ids if r in self.requests]
        for seq in seqs:
            self.finish(seq, reason)
        return seqs

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            num_preemptions=self.num_preemptions, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            spec_decoding=self.speculator.stats if self.speculator is not None else None)

    def wants_drafts(self) -> bool:
        """Whether the next step would verify drafts from a host proposer: then the step before
        it must be read first (drafts follow the tokens it samples), instead of overlapping the
        two. A step after which a model proposes says so itself (`num_lookahead_tokens`)."""
        return (self.speculator is not None and not self.speculator.drafts_on_device
                and self.speculator.wants_host_tokens(len(self.running)))

    # ---- a step's life ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        # Decodes reserve first. A sequence they preempt goes back to the head of the queue and
        # never fits in the blocks its preemption freed, so nobody is admitted past it.
        decodes, verifies, asked = self._reserve_decodes()
        if self.speculator is not None:
            self.speculator.step_scheduled(len(self.running), asked, len(verifies))
        out = self._schedule_prompts(decodes, verifies) or self._decode_batch(decodes)
        if out is None:
            if self.speculator is not None and not self.running:
                self.speculator.paused()
            return None
        if self.speculator is not None and self.speculator.drafts_on_device:
            out.num_lookahead_tokens = self._reserve_lookahead(out)
        out.output = self._runner_output(out)
        return out

    def _runner_output(self, step: ScheduledStep) -> SchedulerOutput:
        """The step for the model runner: each sequence's changes since the runner last saw
        it. Runs for every sequence of every step: deltas only, no copies of whole lists."""
        seqs = step.seqs
        new, tokens, blocks, resumed = [], [], [], []
        for i, seq in enumerate(seqs):
            sent = seq.num_sent_token_ids
            if not sent:
                new.append(NewRequestData(seq.request_id, seq.prompt_token_ids,
                                          seq.sampling_params))
                sent = seq.num_prompt_tokens
            elif not seq.num_sent_blocks:
                resumed.append(i)
            n = len(seq.token_ids)
            if n != sent:
                tokens.append((i, seq.token_ids[sent:]))
            seq.num_sent_token_ids = n
            sent = seq.num_sent_blocks
            n = len(seq.block_table)
            if n != sent:
                blocks.append((i, seq.block_table[sent:]))
                seq.num_sent_blocks = n
        scheduled = ScheduledRequests([s.request_id for s in seqs],
                                      [s.num_computed_tokens for s in seqs],
                                      [s.num_pending for s in seqs], tokens, blocks, resumed)
        finished, self.finished_req_ids = self.finished_req_ids, []
        return SchedulerOutput(scheduled, step.num_tokens, step.is_prefill, step.num_decodes,
                               step.draft_token_ids, step.num_lookahead_tokens, new, finished)

    def mark_launched(self, out: ScheduledStep) -> None:
        """The step is running on the device: its tokens count as computed, and each sampling
        sequence has one more token pending there."""
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n
        if out.is_prefill:  # a decoded token's block is registered once its id is on the host
            for seq in out.seqs:
                self.block_manager.cache_computed_blocks(seq)
        last = None
        for seq in out.sampling_seqs:
            if seq is not last:  # a verifying sequence's rows: one pending step
                seq.num_pending += 1
                last = seq

    def update_from_output(self, out: ScheduledStep, runner_output: ModelRunnerOutput
                           ) -> list[EngineCoreOutput]:
        """Appends the step's sampled tokens (waiting for them to reach the host), checks stops
        and lengths, finishes requests, and returns one output per request that gained a
        token."""
        for (i, _, _), entries in zip(out.prompt_logprob_spans, runner_output.prompt_logprobs):
            out.seqs[i].prompt_logprobs.extend(entries)
        sampled = runner_output.wait()
        if self.speculator is not None:
            num_tokens = sum(out.num_tokens)
            self.speculator.step_read(time.perf_counter(), len(out.seqs), num_tokens,
                                      verified=any(out.draft_token_ids),
                                      decode_only=len(out.sampling_seqs) == num_tokens)
        if out.draft_token_ids:
            return self._update_verified(out, sampled)
        return self._update_sampled(out, sampled)

    def update_draft_token_ids(self, out: ScheduledStep, runner_output: ModelRunnerOutput
                               ) -> None:
        """Takes the drafts a model proposed after the step (`update_from_output` first),
        waiting for them to reach the host: each to follow its sequence's tokens. Apart from
        the update, so that a failure to read them (a fault in the drafter's passes, which run
        after the step's sampling) cannot lose the outputs of the requests the step finished."""
        if runner_output.drafts is None:
            return
        for i, drafts in runner_output.drafts.result().items():
            seq = out.seqs[i]
            if seq.status is not SequenceStatus.FINISHED:
                self.speculator.add_drafts(seq.request_id, len(seq.token_ids), drafts)

    def _update_sampled(self, out: ScheduledStep, sampled: SamplerOutput
                        ) -> list[EngineCoreOutput]:
        """update_from_output for a step without drafts: one token per sampling sequence."""
        outputs = []
        cache_blocks = self.block_manager.cache_computed_blocks
        for seq, token, logprobs in zip(out.sampling_seqs, sampled.token_ids, sampled.logprobs):
            seq.num_pending -= 1
            if seq.status is SequenceStatus.FINISHED:  # finished or aborted while this ran
                continue
            seq.append_token(token)
            cache_blocks(seq)  # its KV may be computed already
            self._check_stop(seq, token)
            outputs.append(EngineCoreOutput(
                seq.request_id, [token], None if logprobs is None else [logprobs],
                seq.prompt_logprobs if seq.num_output_tokens == 1 else None,
                seq.finish_reason, seq.stop_reason, seq.num_cached_tokens))
            if seq.finish_reason is not None:
                self.finish(seq)
        return outputs

    def _update_verified(self, out: ScheduledStep, sampled: SamplerOutput
                         ) -> list[EngineCoreOutput]:
        """update_from_output for a step that verified drafts: each sequence keeps the drafts
        its samples agree with and the sample after them. The KV of rejected drafts stays in
        the sequence's blocks, uncounted, and the next step's tokens overwrite it."""
        outputs = []
        row = 0
        for i, seq in enumerate(out.seqs):
            if not out.samples(i):
                continue
            drafts = out.draft_token_ids[i]
            rows = slice(row, row + 1 + len(drafts))
            row = rows.stop
            seq.num_pending -= 1
            if seq.status is SequenceStatus.FINISHED:
                continue
            tokens = sampled.token_ids[rows]
            accepted = 0
            if drafts:
                accepted = self.speculator.accepted_length(seq.request_id, drafts, tokens)
                seq.num_computed_tokens -= len(drafts) - accepted
                self.speculator.record(len(drafts), accepted)
            new_tokens, new_logprobs = [], []
            kept = drafts[:accepted] + tokens[accepted:accepted + 1]
            for token, logprobs in zip(kept, sampled.logprobs[rows]):
                seq.append_token(token)
                new_tokens.append(token)
                new_logprobs.append(logprobs)
                self._check_stop(seq, token)
                if seq.finish_reason is not None:
                    break
            self.block_manager.cache_computed_blocks(seq)
            outputs.append(EngineCoreOutput(
                seq.request_id, new_tokens, None if new_logprobs[0] is None else new_logprobs,
                seq.prompt_logprobs if seq.num_output_tokens == len(new_tokens) else None,
                seq.finish_reason, seq.stop_reason, seq.num_cached_tokens))
            if seq.finish_reason is not None:
                self.finish(seq)
        return outputs

    def fail(self, seqs: Iterable[Sequence], error: str) -> list[EngineCoreOutput]:
        """Finishes `seqs` with an error (their blocks return to the pool)."""
        outputs = []
        for seq in seqs:
            if seq.is_finished:
                continue
            self.finish(seq, "error")
            outputs.append(EngineCoreOutput(seq.request_id, [], finish_reason="error",
                                            error=error))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.sampling_params
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
        # Counting host tokens only: the next step may already have one pending.
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    # ---- picking a step -----------------------------------------------------------------------
    def _schedule_prompts(self, decodes: list[Sequence],
                          verifies: list[tuple[Sequence, list[int]]]) -> ScheduledStep | None:
        """Prompt chunks in the token budget left after `decodes` (one token each) and the
        sequences verifying drafts, or None if there is no prompt or draft work."""
        seqs = list(decodes)
        num_tokens = [1] * len(decodes)
        for seq, drafts in verifies:
            seqs.append(seq)
            num_tokens.append(1 + len(drafts))
        num_fixed = len(seqs)  # the step's rows that are not prompt chunks
        budget = self.max_num_batched_tokens - sum(num_tokens)
        if decodes or verifies:
            budget = min(budget, self.mixed_prompt_tokens)
        # Prompts already partly computed continue first (chunked prefill); their blocks were
        # all reserved when they were admitted.
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget)
                seqs.append(seq)
                num_tokens.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted before its last token reached the host: wait for it
                break
            # Admitted only with room for the whole prompt, so that a prompt being prefilled in
            # chunks never has to preempt (itself included) to continue. A cached prefix counts
            # as computed.
            if not self.block_manager.admit(seq):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            num_tokens.append(n)
            budget -= n
        if len(seqs) == num_fixed and not verifies:
            if self.waiting and not self.running and not self.waiting[0].num_pending:
                raise RuntimeError("KV pool too small for a single request")
            return None
        if (decodes or verifies) and self.prompt_buckets is not None:
            self._trim_to_piece(seqs, num_tokens, len(decodes), num_fixed)
        drafts = [[] for _ in seqs]
        for i, (_, d) in enumerate(verifies, start=len(decodes)):
            drafts[i] = d
        return ScheduledStep(seqs, num_tokens, is_prefill=True, num_decodes=len(decodes),
                             draft_token_ids=drafts if verifies else [])

    def _trim_to_piece(self, seqs: list[Sequence], num_tokens: list[int],
                       num_decodes: int, num_fixed: int) -> None:
        """Cuts the last prompt chunks down to the prompt tokens of a captured bucket
        (`PromptBuckets.piece`); a chunk cut to nothing leaves the step (its sequence stays
        admitted and continues next step). The first `num_fixed` sequences (decoding or
        verifying drafts) are never cut."""
        prompt_tokens = sum(num_tokens) - num_decodes
        piece = self.prompt_buckets.piece(num_decodes, prompt_tokens)
        excess = min(prompt_tokens - piece, sum(num_tokens[num_fixed:]))
        while excess:
            cut = min(excess, num_tokens[-1])
            num_tokens[-1] -= cut
            excess -= cut
            if num_tokens[-1] == 0:
                seqs.pop()
                num_tokens.pop()

    def _reserve_decodes(self) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]], int]:
        """Running sequences that decode a token next, each given room for it: those that
        decode it alone, and those that verify drafts after it (with room for them too); and
        for how many sequences with every token on the host drafts were asked.
        Partly prefilled prompts sit decodes out, and so do sequences whose pending token ends
        them. Written out for speed: it runs for every running sequence every step."""
        blocks_needed = self.block_manager.blocks_needed
        num_drafts = 0
        if self.speculator is not None:
            num_drafts = self.speculator.draft_length(len(self.running))
        decodes, verifies = [], []
        asked = 0
        for seq in list(self.running):
            n = len(seq.token_ids) + seq.num_pending
            if (seq.status is not SequenceStatus.RUNNING or n - seq.num_computed_tokens != 1
                    or self._at_length_limit(seq, n)):
                continue
            drafts = []
            if num_drafts and not seq.num_pending:
                asked += 1
                drafts = self._propose(seq, num_drafts)
            # Drafts never preempt anyone: without room for them, the sequence decodes alone.
            if drafts and self.block_manager.can_allocate(seq, n + len(drafts)):
                self.block_manager.allocate(seq, n + len(drafts))
                verifies.append((seq, drafts))
            # Most steps: its blocks hold the token already.
            elif blocks_needed(seq, n) == 0 or self._reserve(seq, n):
                decodes.append(seq)
        return decodes, verifies, asked

    def _reserve_lookahead(self, out: ScheduledStep) -> int:
        """Drafts per sequence a model proposes after the step (0: none), and room for them
        where there is some without preempting: their KV is written at the positions after
        each sampling sequence's next token (the model runner proposes nothing for a sequence
        without that room)."""
        k = self.speculator.draft_length(len(self.running))
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_tokens)):
            need = min(seq.num_computed_tokens + n + k, self.max_model_len)
            if k and out.samples(i) and self.block_manager.can_allocate(seq, need):
                self.block_manager.allocate(seq, need)
        return k

    def _propose(self, seq: Sequence, num_drafts: int) -> list[int]:
        """Draft tokens for a sequence whose tokens are all on the host, within its length
        limits. Sequences whose sampling reads their earlier outputs (penalties, a reasoning
        budget), that may not stop yet (min_tokens), or whose grammar begins after a reasoning
        section (its rows would need the grammar from the draft that ends it) draft nothing. A
        constrained sequence's rows each allow what may follow the drafts before them, so a
        draft its grammar forbids is rejected (structured_output/worker.py)."""
        params = seq.sampling_params
        constraint = params.structured_outputs
        if (seq.reads_outputs or seq.num_output_tokens < params.min_tokens
                or (constraint is not None and constraint.reasoning_end_token_id is not None)):
            return []
        n = len(seq.token_ids)
        room = min(num_drafts, params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - n - 1)
        if room <= 0:
            return []
        return self.speculator.propose(seq.request_id, seq.num_prompt_tokens, seq.token_ids,
                                       room)

    @staticmethod
    def _decode_batch(seqs: list[Sequence]) -> ScheduledStep | None:
        if not seqs:
            return None
        return ScheduledStep(seqs, [1] * len(seqs), is_prefill=False, num_decodes=len(seqs))

    def _at_length_limit(self, seq: Sequence, length: int) -> bool:
        """length: len(seq)."""
        max_tokens = seq.sampling_params.max_tokens
        return length >= self.max_model_len or (
            max_tokens is not None and length - seq.num_prompt_tokens >= max_tokens)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a running sequence room for `num_tokens`, preempting the newest running ones as
        needed. False if `seq` itself had to be preempted."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_sent_blocks = 0  # its next table is sent whole
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
