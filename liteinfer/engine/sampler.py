"""Turns one step's logits into one token per sequence, vectorised across the batch.

Order (vLLM's): fp32 → grammar bitmask (structured outputs) → min_tokens stop-token mask →
logit bias → repetition/presence/frequency penalties →
greedy argmax | temperature → top-k → top-p → min-p → exponential-race sample. A sequence
whose reasoning budget is spent samples its end-of-reasoning token, whatever the rest says.
Logprobs come from the raw model logits, before any of that (vLLM's default).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.request_state import CachedRequestState
from liteinfer.sampling_params import SamplingParams
from liteinfer.structured_output.manager import GrammarBitmask, apply_grammar_bitmask
from liteinfer.utils import to_device


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sequence
    # Per sequence: the sampled token's logprob and rank and the top-N, when params.logprobs is
    # not None.
    logprobs: list[TokenLogprobs | None]


class SampledTokens:
    """One step's samples: on the device at once (they feed the next step), on the host when
    `result()` is called. The device-to-host copy starts right away and overlaps what follows."""

    def __init__(self, token_ids: torch.Tensor, rows: torch.Tensor, params: list[SamplingParams],
                 num_top: int | None):
        self.token_ids = token_ids  # [B] int64 on the device
        self._params, self._num_top = params, num_top
        self._result: SamplerOutput | None = None
        if rows.device.type == "cpu":
            self._host, self._event = rows, None
        else:
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            rows = self._host.tolist()
            if self._num_top is None:
                self._result = SamplerOutput(rows, [None] * len(self._params))
            else:
                self._result = SamplerOutput([int(r[0]) for r in rows], logprob_entries(
                    rows, [p.logprobs for p in self._params], self._num_top))
        return self._result


def below_min_tokens(seqs: list[CachedRequestState]) -> list[int]:
    """The rows whose request has fewer outputs than its min_tokens (tokens still pending on
    the device count: they are outputs too)."""
    return [i for i, s in enumerate(seqs) if s.sampling_params.min_tokens
            and len(s) - s.num_prompt_tokens < s.sampling_params.min_tokens]


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int], use_triton: bool = False):
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.use_triton = use_triton  # greedy rows' argmax through kernels/argmax.py

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from liteinfer.kernels.argmax import argmax_rows
            return argmax_rows(x)
        return x.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, seqs: list[CachedRequestState],
               min_tok_rows: list[int], grammar_bitmask: GrammarBitmask | None = None
               ) -> SampledTokens:
        """Samples without waiting for the device. Penalties read the sequences' token ids, so
        those must hold every earlier token (no pending ones). `min_tok_rows`: the rows below
        their min_tokens (`below_min_tokens`); `grammar_bitmask` masks the rows of constrained
        requests."""
        params = [s.sampling_params for s in seqs]
        greedy = [p.greedy for p in params]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        pen_rows = [i for i, s in enumerate(seqs) if s.needs_penalties]
        end_rows = [i for i, s in enumerate(seqs)
                    if s.thinking is not None and s.thinking.must_end(s.token_ids)]
        want_logprobs = any(p.logprobs is not None for p in params)
        if all(greedy) and not (min_tok_rows or bias_rows or pen_rows or end_rows
                                or want_logprobs):
            if grammar_bitmask is not None:  # in place: nothing reads these logits afterwards
                apply_grammar_bitmask(logits, grammar_bitmask)
            token_ids = self._argmax(logits)
            return SampledTokens(token_ids, token_ids, params, None)

        # A copy: the caller's logits buffer may be reused (CUDA graphs) and feeds the logprobs.
        x = logits.to(torch.float32, copy=True)
        if grammar_bitmask is not None:
            apply_grammar_bitmask(x, grammar_bitmask)
        if min_tok_rows:
            self._mask_stop_tokens(x, seqs, min_tok_rows)
        if bias_rows:
            _add_logit_bias(x, params, bias_rows)
        if pen_rows:
            _apply_penalties(x, seqs, pen_rows)
        if end_rows:
            _force_reasoning_end(x, params, end_rows)
        token_ids = self._argmax(x)
        if not all(greedy):
            sampled = _sample(x, seqs, greedy)
            token_ids = torch.where(to_device(greedy, torch.bool, x.device), token_ids, sampled)

        if not want_logprobs:
            return SampledTokens(token_ids, token_ids, params, None)
        return _with_logprobs(logits, token_ids, params)

    def _mask_stop_tokens(self, x: torch.Tensor, seqs: list[CachedRequestState],
                          rows: list[int]) -> None:
        """Below min_tokens nothing may end the sequence: EOS (even with ignore_eos, as vLLM)
        and stop_token_ids get -inf."""
        vocab = x.shape[1]
        r: list[int] = []
        c: list[int] = []
        for i in rows:
            ids = [t for t in {*self.eos_token_ids, *seqs[i].sampling_params.stop_token_ids}
                   if t < vocab]
            r += [i] * len(ids)
            c += ids
        x[to_device(r, torch.long, x.device), to_device(c, torch.long, x.device)] = float("-inf")


def _force_reasoning_end(x: torch.Tensor, params: list[SamplingParams], rows: list[int]
                         ) -> None:
    """Every token of `rows` but their end of reasoning gets -inf (greedy or sampled, only it
    can come)."""
    index = to_device(rows, torch.long, x.device)
    ends = to_device([params[i].think_token_ids[1] for i in rows], torch.long, x.device)
    x[index] = float("-inf")
    x[index, ends] = 0.0


def _add_logit_bias(x: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    biases = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items()]
    r, c, v = zip(*biases)
    x.index_put_((to_device(r, torch.long, x.device), to_device(c, torch.long, x.device)),
                 to_device(v, torch.float32, x.device), accumulate=True)


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] float occurrence counts."""
    flat = list(itertools.chain.from_iterable(id_lists))
    lengths = to_device([len(ids) for ids in id_lists], torch.long, device)
    # output_size spares repeat_interleave a device→host sync.
    rows = torch.repeat_interleave(torch.arange(len(id_lists), device=device), lengths,
                                   output_size=len(flat))
    counts = torch.zeros(len(id_lists), vocab, device=device)
    return counts.index_put_((rows, to_device(flat, torch.long, device)),
                             torch.ones((), device=device), accumulate=True)


def _apply_penalties(x: torch.Tensor, seqs: list[CachedRequestState], rows: list[int]) -> None:
    """Repetition penalty over prompt+output ids (HF/vLLM: divide positive logits, multiply
    negative ones); presence/frequency over output ids (OpenAI: -= p*(count>0) + f*count)."""
    device, vocab = x.device, x.shape[1]
    ps = [seqs[i].sampling_params for i in rows]
    idx = to_device(rows, torch.long, device)
    rep, pres, freq = to_device(
        [[p.repetition_penalty for p in ps], [p.presence_penalty for p in ps],
         [p.frequency_penalty for p in ps]], torch.float32, device).unsqueeze(-1)
    sub = x[idx]
    counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab, device)
    if any(p.repetition_penalty != 1.0 for p in ps):
        prompt = _token_counts([seqs[i].prompt_token_ids for i in rows], vocab, device)
        pen = torch.where((counts > 0) | (prompt > 0), rep, 1.0)
        sub = torch.where(sub > 0, sub / pen, sub * pen)
    sub -= freq * counts + pres * (counts > 0)
    x[idx] = sub


def _sample(x: torch.Tensor, seqs: list[CachedRequestState], greedy: list[bool]) -> torch.Tensor:
    """Samples every row (greedy rows get a throwaway draw from the default generator only)."""
    device, vocab = x.device, x.shape[1]
    ps = [s.sampling_params for s in seqs]
    temp, top_k, top_p, min_p = to_device(
        [[1.0 if g else p.temperature for p, g in zip(ps, greedy)],
         [p.top_k or vocab for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]],
        torch.float32, device).unsqueeze(-1)
    x.div_(temp)

    use_top_p = any(p.top_p < 1.0 for p in ps)
    if use_top_p or any(p.top_k for p in ps):
        srt, order = x.sort(dim=-1, descending=True)
        # Masking by rank keeps exactly k tokens even when logits tie.
        srt.masked_fill_(torch.arange(vocab, device=device) >= top_k, float("-inf"))
        if use_top_p:
            probs = srt.softmax(dim=-1)
            # Smallest nucleus: keep a token while the mass ranked above it is still < top_p.
            # top_p == 1 rows are exempt: rounding can push the cumsum to 1 before the tail.
            before = probs.cumsum(dim=-1) - probs
            srt.masked_fill_((before >= top_p) & (top_p < 1.0), float("-inf"))
        x.scatter_(-1, order, srt)
    if any(p.min_p > 0.0 for p in ps):
        # prob < min_p * max_prob  ⇔  logit < max_logit + log(min_p); log(0) = -inf masks nothing.
        floor = x.amax(dim=-1, keepdim=True) + min_p.log()
        x.masked_fill_(x < floor, float("-inf"))

    probs = x.softmax(dim=-1)
    # Exponential race: argmax(p / q), q ~ Exp(1), picks i with probability p_i. A seeded row
    # draws exactly one fresh [vocab] tensor from its own generator, so its stream does not
    # depend on the batch it is in.
    q = torch.empty_like(probs).exponential_()
    for i, (s, g) in enumerate(zip(seqs, greedy)):
        if s.sampling_params.seed is not None and not g:
            if s.generator is None:
                s.generator = torch.Generator(device=device)
                s.generator.manual_seed(s.sampling_params.seed)
            q[i] = torch.empty(vocab, device=device).exponential_(generator=s.generator)
    # q == 0 would turn a masked p == 0 into NaN, which argmax picks.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                   params: list[SamplingParams]) -> SampledTokens:
    n = max(p.logprobs or 0 for p in params)
    return SampledTokens(token_ids, logprob_table(raw, token_ids, n), params, n)


def logprob_table(raw: torch.Tensor, token_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Per row of the raw logits: the token's id, logprob and rank (1 = most likely), then the
    top-n ids and their logprobs; float64 [rows, 3 + 2n], packed for one device→host copy."""
    lp = raw.float().log_softmax(dim=-1)
    chosen = lp.gather(-1, token_ids.unsqueeze(-1))
    rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1
    cols = [token_ids.unsqueeze(-1).double(), chosen.double(), rank.double()]
    if n:
        top = lp.topk(n, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=-1)


def logprob_entries(rows: list[list[float]], num_top: list[int | None],
                    n: int) -> list[TokenLogprobs | None]:
    """logprob_table rows on the host, each with its own top count (None: that row wants no
    logprobs)."""
    entries: list[TokenLogprobs | None] = []
    for r, k in zip(rows, num_top):
        if k is None:
            entries.append(None)
            continue
        entries.append(TokenLogprobs([int(r[0]), *map(int, r[3:3 + k])],
                                     [r[1], *r[3 + n:3 + n + k]], int(r[2])))
    return entries
