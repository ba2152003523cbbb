"""What the model runner hands the scheduler for one launched step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.sampler import SampledTokens, SamplerOutput


@dataclass
class ProposalPlan:
    """A step's proposals, planned on the host before its launch (the scheduler advances the
    sequences' counters right after): per proposing sequence, in `seq_indices` order, its
    sampled rows, the drafts it verifies, the position its first verified token takes, and
    its block table; and whether a proposal's row may split its attention (split-K), from the
    host's bound on its length."""

    num_tokens: int           # k: drafts proposed per sequence
    seq_indices: list[int]    # the step's sequences that propose (sampling, with room)
    sample_rows: torch.Tensor  # [S, K + 1] int64: rows of the step's samples (last repeated)
    drafts: torch.Tensor       # [S, K] int64: the drafts verified, -1 past a sequence's own
    base: torch.Tensor         # [S] int64: the position of the first sampled token
    block_tables: torch.Tensor  # [S, table width] int32
    may_split: bool


@dataclass
class HeadCatchUp:
    """An EAGLE-3 head's pass over a step's tokens, once the step is sampled: at each token's
    position it reads the token after it (`next_ids`, the step's samples at `sample_rows`)."""

    next_ids: torch.Tensor     # [T] int64, 0 at the sampled rows
    positions: torch.Tensor    # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: the step's token rows that sample, in sample order
    aux_rows: torch.Tensor     # [T] int64: each token's row in the target's aux hidden states


@dataclass
class DraftPlan:
    """What the drafter does once the step is sampled."""

    proposals: ProposalPlan | None
    catch_up: HeadCatchUp | None = None


class ProposedDrafts:
    """Draft tokens proposed on the device, per proposing sequence of the step (`seq_indices`,
    indices into its sequences); their copy to the host starts at once."""

    def __init__(self, token_ids: torch.Tensor, seq_indices: list[int]):
        self.seq_indices = seq_indices
        if token_ids.device.type == "cpu":
            self._host, self._event = token_ids, None
        else:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> dict[int, list[int]]:
        """Each proposing sequence's drafts, by its index in the step."""
        if self._event is not None:
            self._event.synchronize()
        return dict(zip(self.seq_indices, self._host.tolist()))


@dataclass
class ModelRunnerOutput:
    """One step's results. The sampled tokens stay on the device (they feed the next step
    there) until `wait()`; the prompt logprobs the step scored are on the host already, one
    list per entry of the step's `prompt_logprob_spans`."""

    sampled: SampledTokens | None  # None: no sequence reached its last token
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # Drafts a model proposed after the step (draft_model, eagle3), as vLLM v1's runner
    # output carries them; None: none proposed.
    drafts: ProposedDrafts | None = None

    def wait(self) -> SamplerOutput:
        return self.sampled.result() if self.sampled is not None else SamplerOutput([], [])


@dataclass
class StepForward:
    """A launched step's forward pass, not sampled yet: the logits of its sampling rows (None
    if none sample) and the prompt logprobs it scored."""

    logits: torch.Tensor | None
    prompt_logprobs: list[list[TokenLogprobs]]
    # The draft model's proposals to make once the step is sampled (None: none).
    draft_plan: DraftPlan | None = None
