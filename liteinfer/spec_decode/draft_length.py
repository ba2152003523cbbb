"""How many draft tokens a step verifies per sequence, from the measured acceptance and the
batch width.

A verification step of B sequences with k drafts each computes B(k + 1) tokens. While that is
below the width where a step stops being bound by reading the weights (`knee_tokens`), the
extra tokens cost little; past it, step time grows with the tokens. A step that verifies
drafts also costs more than that model says: it gives up the overlap of the next step's
scheduling with this one's run (engine/core.py), since the next step's inputs depend on what
is accepted; a wide one runs the prompt-shaped kernels rather than the decode ones; and a
drafting model's proposals run inside it. That overhead is measured: the time of each step
between the host seeing its predecessor's results and its own, over the model's cost, kept
apart for plain and verifying steps (`sync_cost`, a fraction of a step, stands in until both are
measured), and apart by the step's width class (its decoding sequences, by powers of two): a
narrow verification replays a captured decode step while a wide one runs the prompt-shaped
kernels, so one width's overhead says little about another's. In a verifying step the
proposers found drafts for a fraction h of the sequences they were asked about (prompt lookup
finds no match for the others, which decode one token in it). With a per-token acceptance
rate a, k drafts yield 1 + h (a + ... + a^k) tokens a sequence for B (1 + h k) computed
tokens a step of B; the policy picks the k with the most tokens per unit of step time, and 0
(no speculation, steps overlapped) wherever none beats plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Acceptance assumed before any draft is verified, and the weight of each step's measurement
# (of the acceptance and of the share of sequences the proposers find drafts for).
PRIOR_ACCEPTANCE = 0.6
ACCEPTANCE_SMOOTHING = 0.05
# With speculation off at a width where drafts are cheap to verify, every this many steps draft
# anyway to measure acceptance and cost again.
PROBE_INTERVAL = 64
# A step that proposed nothing gave up its overlap for nothing (the proposers found no match);
# after one, they are asked again only every this many steps, and the steps between overlap
# as without speculation.
RETRY_INTERVAL = 8
# While drafting, every this many steps (and soon after drafting starts, until plain steps are
# timed) this many steps run without drafts, so that a plain step's time is measured again;
# the first of them follows a verifying step's host round trip and is not timed.
PLAIN_PROBE_INTERVAL = 256
PLAIN_PROBE_FIRST = 4
PLAIN_PROBE_STEPS = 3
# The weight of each step's time in its kind's moving average, and how far one step may move
# it (a step after a pause, or behind a slow host moment, is not the steady cost).
STEP_TIME_SMOOTHING = 0.1
STEP_TIME_CLAMP = 2.0


def width_class(batch: int) -> int:
    """The class whose step times a step of `batch` decoding sequences shares: 1, 2-3, 4-7..."""
    return batch.bit_length()


@dataclass
class StepTimes:
    """One width class's step times: moving averages of seconds per unit of modelled cost, of
    plain and of verifying steps (None: unmeasured), and the kinds whose first step was seen
    (left out: compilation, first allocations)."""

    plain: float | None = None
    verify: float | None = None
    seen: set[bool] = field(default_factory=set)


class DraftLengthPolicy:
    def __init__(self, max_drafts: int, knee_tokens: int, sync_cost: float,
                 timed: bool = False):
        """timed: steps' times will be recorded (`record_step_time`), so plain steps are
        interleaved with drafting ones now and then to time them."""
        self.max_drafts = max_drafts
        self.timed = timed
        self.knee_tokens = knee_tokens
        self.sync_cost = sync_cost
        self.retry_interval = RETRY_INTERVAL  # per policy, so that a profile can vary it
        # The geometric estimate accepted / (accepted + rejections), as a ratio of two moving
        # averages (an average of per-step ratios would be biased low).
        self.mean_accepted = PRIOR_ACCEPTANCE
        self.mean_trials = 1.0
        self.steps_without_drafts = 0
        # Steps left before the proposers are asked again, after a step they found nothing in.
        self.retry_in = 0
        # The share of a verifying step's asked sequences that the proposers found drafts for
        # (moving average; a step in which they found none verifies nothing, and the retry
        # rule above prices it).
        self.hit_rate = 1.0
        self.times: dict[int, StepTimes] = {}  # by width_class
        self.steps_drafting = 0  # since the last plain probe
        self.plain_probe_left = 0

    def _cost(self, tokens: int) -> float:
        """A step's time relative to one bound by reading the weights."""
        return max(1.0, tokens / self.knee_tokens)

    @property
    def acceptance(self) -> float:
        """The estimated per-token acceptance rate."""
        return self.mean_accepted / self.mean_trials

    def step_times(self, batch: int) -> StepTimes:
        """The step times of `batch` decoding sequences' width class (empty if unmeasured)."""
        return self.times.get(width_class(batch)) or StepTimes()

    def verify_overhead(self, batch: int) -> float:
        """A verifying step's time over a plain step's of the same modelled cost, at a width
        of `batch` decoding sequences."""
        times = self.step_times(batch)
        if times.plain is None or times.verify is None:
            return 1.0 + self.sync_cost
        return times.verify / times.plain

    def _gain(self, batch: int, k: int) -> float:
        """Tokens per unit of plain step time with k drafts per sequence."""
        if k == 0:
            return batch / self._cost(batch)
        a, h = self.acceptance, self.hit_rate
        expected = 1 + h * sum(a ** i for i in range(1, k + 1))
        tokens = round(batch * (1 + h * k))
        return batch * expected / (self._cost(tokens) * self.verify_overhead(batch))

    def draft_length(self, batch: int) -> int:
        """Drafts per sequence for a step of `batch` decoding sequences."""
        if batch == 0 or self.plain_probe_left:
            return 0
        best = max(range(self.max_drafts + 1), key=lambda k: (self._gain(batch, k), -k))
        if best == 0 and self.steps_without_drafts >= PROBE_INTERVAL and \
                batch * 2 <= self.knee_tokens:
            return 1  # off where drafts would be cheap to verify: measure it again
        return best

    def wants_host_tokens(self, batch: int) -> bool:
        """Whether the next step should be scheduled with every token on the host (the step
        before it read first), so that drafts can follow them."""
        return self.retry_in == 0 and self.draft_length(batch) > 0

    def step_scheduled(self, batch: int, asked: int, drafted: int) -> None:
        """A step of `batch` running sequences was scheduled: drafts were asked for `asked`
        sequences with every token on the host, and `drafted` of them verify some. A step read
        ahead in which nobody could be asked (all prefilling) is no failed retry: the next
        step stays read ahead."""
        if drafted:
            self.hit_rate += ACCEPTANCE_SMOOTHING * (drafted / asked - self.hit_rate)
            self.steps_without_drafts = self.retry_in = 0
            self.steps_drafting += 1
            measured = self.step_times(batch).plain is not None
            every = PLAIN_PROBE_INTERVAL if measured else PLAIN_PROBE_FIRST
            if self.timed and self.steps_drafting >= every:
                self.plain_probe_left, self.steps_drafting = PLAIN_PROBE_STEPS, 0
            return
        if self.plain_probe_left:
            self.plain_probe_left -= 1
            return
        self.steps_without_drafts += 1
        if asked:
            self.retry_in = self.retry_interval - 1
        elif self.retry_in:
            self.retry_in -= 1

    def record_step_time(self, batch: int, num_tokens: int, verified: bool,
                         seconds: float) -> None:
        """A decode step of `batch` sequences and `num_tokens` tokens (drafts included) took
        `seconds`, from the host reading its predecessor's results to reading its own."""
        times = self.times.setdefault(width_class(batch), StepTimes())
        if verified not in times.seen:
            times.seen.add(verified)
            return
        per_cost = seconds / self._cost(num_tokens)
        mean = times.verify if verified else times.plain
        if mean is None:
            mean = per_cost
        else:
            per_cost = min(max(per_cost, mean / STEP_TIME_CLAMP), mean * STEP_TIME_CLAMP)
            mean += STEP_TIME_SMOOTHING * (per_cost - mean)
        if verified:
            times.verify = mean
        else:
            times.plain = mean

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` of its `num_drafted` drafts kept. The
        accepted count is geometric in the per-token rate a: each draft is kept with
        probability a until the first rejection, whose estimate is accepted / (accepted +
        rejections), here over a moving window of sequences."""
        trials = num_accepted + (num_accepted < num_drafted)
        self.mean_accepted += ACCEPTANCE_SMOOTHING * (num_accepted - self.mean_accepted)
        self.mean_trials += ACCEPTANCE_SMOOTHING * (trials - self.mean_trials)
