"""Continuous batching: which sequences run in the next step, and how many tokens each computes."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property

from liteinfer.config import MIN_PROMPT_PIECE
from liteinfer.engine.block_manager import BlockManager
from liteinfer.engine.sequence import Sequence, SequenceStatus
from liteinfer.utils import next_power_of_2


def padded_decodes(num_decodes: int, max_num_seqs: int) -> int:
    """Decoding rows of a captured mixed step: the count rounded up to a power of two, at most
    max_num_seqs."""
    return min(next_power_of_2(num_decodes), max_num_seqs) if num_decodes else 0


def prompt_piece_sizes(padded_decodes: int, mixed_prompt_tokens: int) -> list[int]:
    """The prompt token counts a captured step with `padded_decodes` decoding rows comes in,
    ascending: each brings the step to a power of two of rows, so the GEMMs' tiles and waves
    come out even (on the H200, cuBLAS takes 14% longer for `down` over 2,080 rows than over
    2,048, and gate/up 23% longer over 1,056 than over 1,024). At least MIN_PROMPT_PIECE, at
    most mixed_prompt_tokens (which is that size alone if no power of two fits)."""
    sizes = [(1 << i) - padded_decodes for i in range(mixed_prompt_tokens.bit_length() + 1)]
    return [s for s in sizes if MIN_PROMPT_PIECE <= s <= mixed_prompt_tokens] or [
        mixed_prompt_tokens]


@dataclass
class ScheduledBatch:
    """One model step. Prefill steps compute prompt chunks (and, in a mixed step, one token of
    each decoding sequence beside them); decode steps one token per sequence."""

    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence computes in this step
    is_prefill: bool
    num_decodes: int = 0  # the leading sequences that decode one token (all, in a decode step)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, so a token is sampled for it."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_tokens[i] == len(seq)

    @cached_property
    def prompt_logprob_spans(self) -> list[tuple[int, int, int]]:
        """(sequence index, first token in its chunk, count) of the tokens whose logits give a
        prompt token's logprob that sequence asked for and does not have yet (a prompt
        recomputed after preemption is not scored twice). Token p scores prompt token p + 1."""
        spans = []
        for i in range(self.num_decodes, len(self.seqs)):
            seq = self.seqs[i]
            if seq.prompt_logprobs is None:
                continue
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs) - 1)
            end = min(start + self.num_tokens[i], seq.num_prompt_tokens - 1)
            if end > first:
                spans.append((i, first - start, end - first))
        return spans


class Scheduler:
    """First come, first served.

    Running sequences hold KV blocks; waiting ones hold none. Prompt work (new prompts, chunked
    to `max_num_batched_tokens`, and prompts of preempted sequences being recomputed) goes
    first. With `mixed_steps` every running sequence also decodes one token in the same step, so
    prompts arriving never stall the others' decoding and a step's weights are read once for
    both; otherwise a step either prefills or decodes. A step with no prompt work decodes
    (captured in CUDA graphs). With `mixed_prompt_tokens`, a step that decodes carries at most
    that many prompt tokens, trimmed to one of the sizes captured steps come in
    (`prompt_piece_sizes`; what a trimmed chunk leaves rides in the next step), so prompts fill
    the decode steps' idle compute in pieces instead of stalling them with one long step. When
    a decode finds the pool empty, the newest running sequences are preempted: their blocks are
    freed and they return to the front of the queue, so the oldest requests always make
    progress and nothing starves.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, mixed_steps: bool = False,
                 mixed_prompt_tokens: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_steps = mixed_steps
        self.mixed_prompt_tokens = mixed_prompt_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> ScheduledBatch | None:
        if not self.mixed_steps:
            return self._schedule_prompts([]) or self._decode_batch(self._reserve_decodes())
        # Decodes reserve first. A sequence they preempt goes back to the head of the queue and
        # never fits in the blocks its preemption freed, so nobody is admitted past it.
        decodes = self._reserve_decodes()
        return self._schedule_prompts(decodes) or self._decode_batch(decodes)

    def _schedule_prompts(self, decodes: list[Sequence]) -> ScheduledBatch | None:
        """Prompt chunks in the token budget left after `decodes` (one token each), or None if
        there is no prompt work."""
        budget = self.max_num_batched_tokens - len(decodes)
        if decodes and self.mixed_prompt_tokens:
            budget = min(budget, self.mixed_prompt_tokens)
        seqs = list(decodes)
        num_tokens = [1] * len(decodes)
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
        if len(seqs) == len(decodes):
            if self.waiting and not self.running and not self.waiting[0].num_pending:
                raise RuntimeError("KV pool too small for a single request")
            return None
        if decodes and self.mixed_prompt_tokens:
            self._trim_to_piece(seqs, num_tokens, len(decodes))
        return ScheduledBatch(seqs, num_tokens, is_prefill=True, num_decodes=len(decodes))

    def _trim_to_piece(self, seqs: list[Sequence], num_tokens: list[int],
                       num_decodes: int) -> None:
        """Cuts the last prompt chunks down to the largest prompt piece size that fits (fewer
        tokens than the smallest size stay, padded up to it); a chunk cut to nothing leaves the
        step (its sequence stays admitted and continues next step)."""
        prompt_tokens = sum(num_tokens) - num_decodes
        sizes = prompt_piece_sizes(padded_decodes(num_decodes, self.max_num_seqs),
                                   self.mixed_prompt_tokens)
        piece = max((s for s in sizes if s <= prompt_tokens), default=prompt_tokens)
        excess = prompt_tokens - piece
        while excess:
            cut = min(excess, num_tokens[-1])
            num_tokens[-1] -= cut
            excess -= cut
            if num_tokens[-1] == 0:
                seqs.pop()
                num_tokens.pop()

    def _reserve_decodes(self) -> list[Sequence]:
        """Running sequences that decode a token next, each given room for it. Partly
        prefilled prompts sit decodes out, and so do sequences whose pending token ends them."""
        return [seq for seq in list(self.running)
                if seq.status == SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
                and not self._at_length_limit(seq) and self._reserve(seq, len(seq))]

    @staticmethod
    def _decode_batch(seqs: list[Sequence]) -> ScheduledBatch | None:
        if not seqs:
            return None
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False, num_decodes=len(seqs))

    def _at_length_limit(self, seq: Sequence) -> bool:
        max_tokens = seq.sampling_params.max_tokens
        return len(seq) >= self.max_model_len or (
            max_tokens is not None and len(seq) - seq.num_prompt_tokens >= max_tokens)

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
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
