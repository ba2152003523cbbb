"""The split argmax of greedy decoding against torch's: the same index for every row, ties (which
bf16 logits hold plenty of) to the lowest, across piece boundaries, in every logits dtype."""
import pytest
import torch

from liteinfer.kernels.argmax import CHUNK, argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_is_torchs(device, full, dtype):
    vocab = 128256 if full else 3 * CHUNK + 5
    rows = 128 if full else 6
    # Rounded to a coarse grid: each row holds its maximum several times, in several pieces.
    logits = (torch.randn(rows, vocab, device=device) * 4).round().to(dtype)
    assert ((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).any()
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_argmax_rows_finds_lone_maxima_anywhere(device):
    """A row's only maximum at the first and last index of a piece, and at the vocabulary's
    end, whatever the rest (here all -inf but one row, as a grammar mask leaves them)."""
    vocab = 2 * CHUNK + 3
    spots = [0, CHUNK - 1, CHUNK, vocab - 1]
    logits = torch.randn(len(spots) + 1, vocab, device=device)
    logits[-1] = float("-inf")
    logits[-1, 7] = -1e30
    for row, spot in enumerate(spots):
        logits[row, spot] = 100.0
    assert argmax_rows(logits).tolist() == [*spots, 7]
