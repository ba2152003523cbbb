"""The shapes captured prompt and mixed steps come in (engine/prompt_graph.py): a policy of the
model runner's, which the scheduler asks so that a step decoding beside prompt chunks replays
a graph with little padding. Where no prompt step is captured (on the CPU, with the `torch`
or `sdpa` attention backend, with `enforce_eager`) the runner has no buckets and the scheduler
trims nothing. Every rank's runner is built from the same configuration, so the core's
scheduler and every tensor-parallel rank's runner agree on the buckets."""
from __future__ import annotations

from dataclasses import dataclass

from liteinfer.config import MIN_PROMPT_PIECE
from liteinfer.utils import next_power_of_2


def padded_decodes(num_decodes: int, max_num_seqs: int) -> int:
    """Decoding rows of a captured mixed step: the count rounded up to a power of two, at most
    max_num_seqs."""
    return min(next_power_of_2(num_decodes), max_num_seqs) if num_decodes else 0


def prompt_piece_sizes(padded_decodes: int, mixed_prompt_tokens: int) -> list[int]:
    """The prompt token counts a captured step with `padded_decodes` decoding rows comes in,
    ascending: each brings the step to a power of two of rows, so the GEMMs' tiles and waves
    come out even (a few rows past a power of two cost cuBLAS a whole extra wave:
    docs/notes/journal.md, item 22). At least MIN_PROMPT_PIECE, at most mixed_prompt_tokens
    (which is that size alone if no power of two fits)."""
    sizes = [(1 << i) - padded_decodes for i in range(mixed_prompt_tokens.bit_length() + 1)]
    return [s for s in sizes if MIN_PROMPT_PIECE <= s <= mixed_prompt_tokens] or [
        mixed_prompt_tokens]


@dataclass(frozen=True)
class PromptBuckets:
    """The (decoding rows, prompt tokens) buckets of captured prompt and mixed steps: the
    decoding rows padded to a power of two (`padded_decodes`), the prompt tokens to one of
    `prompt_piece_sizes`."""

    max_num_seqs: int
    mixed_prompt_tokens: int

    def prompt_sizes(self, num_decodes: int) -> list[int]:
        """The prompt token counts, ascending, of a step with `num_decodes` decoding rows."""
        return prompt_piece_sizes(padded_decodes(num_decodes, self.max_num_seqs),
                                  self.mixed_prompt_tokens)

    def all(self) -> list[tuple[int, int]]:
        """Every bucket. A mixed step holds at least one prompt, so at most max_num_seqs - 1
        decoding rows."""
        decode_sizes = sorted({padded_decodes(d, self.max_num_seqs)
                               for d in range(self.max_num_seqs)})
        return [(d, p) for d in decode_sizes for p in self.prompt_sizes(d)]

    def fits(self, num_decodes: int, prompt_tokens: int) -> bool:
        return (num_decodes < self.max_num_seqs
                and prompt_tokens <= self.prompt_sizes(num_decodes)[-1])

    def bucket(self, num_decodes: int, prompt_tokens: int) -> tuple[int, int]:
        """The bucket of a step that `fits`: (decoding rows, prompt tokens), each padded."""
        p = next(s for s in self.prompt_sizes(num_decodes) if s >= prompt_tokens)
        return padded_decodes(num_decodes, self.max_num_seqs), p

    def piece(self, num_decodes: int, prompt_tokens: int) -> int:
        """The prompt tokens a step of `num_decodes` decoding rows keeps of `prompt_tokens`: the
        largest size that fits, or all of them below the smallest (padded up to it)."""
        return max((s for s in self.prompt_sizes(num_decodes) if s <= prompt_tokens),
                   default=prompt_tokens)
