"""What the model runner hands the scheduler for one launched step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.sampler import SampledTokens, SamplerOutput


@dataclass
class ModelRunnerOutput:
    """One step's results. The sampled tokens stay on the device (they feed the next step
    there) until `wait()`; the prompt logprobs the step scored are on the host already, one
    list per entry of the step's `prompt_logprob_spans`."""

    sampled: SampledTokens | None  # None: no sequence reached its last token
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)

    def wait(self) -> SamplerOutput:
        return self.sampled.result() if self.sampled is not None else SamplerOutput([], [])


@dataclass
class StepForward:
    """A launched step's forward pass, not sampled yet: the logits of its sampling rows (None
    if none sample) and the prompt logprobs it scored."""

    logits: torch.Tensor | None
    prompt_logprobs: list[list[TokenLogprobs]]
