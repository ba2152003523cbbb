import math

import pytest
import torch

from liteinfer.engine.request_state import CachedRequestState
from liteinfer.engine.sampler import Sampler, SamplerOutput, _apply_penalties, below_min_tokens
from liteinfer.sampling_params import SamplingParams

EOS = 3


def sample(sampler: Sampler, logits: torch.Tensor, seqs: list[CachedRequestState]
           ) -> SamplerOutput:
    return sampler.sample(logits, seqs, below_min_tokens(seqs)).result()


def make_seq(prompt=(1, 2), output=(), **kw) -> CachedRequestState:
    seq = CachedRequestState("r", list(prompt), SamplingParams(**kw))
    seq.token_ids += output
    return seq


def sample_many(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n independent draws: one batch of n identical rows (default generator)."""
    torch.manual_seed(0)
    out = sample(Sampler([EOS]), logits_row.expand(n, -1).clone(),
                 [make_seq(**kw) for _ in range(n)])
    return torch.tensor(out.token_ids)


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_fast_path_and_tiny_temperature_equal_argmax():
    torch.manual_seed(1)
    logits = torch.stack([torch.randperm(100).float() for _ in range(6)])  # gaps of >= 1
    ref = logits.argmax(-1).tolist()
    greedy_seqs = [make_seq(temperature=0.0) for _ in range(6)]
    assert sample(Sampler([EOS]), logits, greedy_seqs).token_ids == ref
    # 1e-2 is not greedy, but exp(-gap / 1e-2) underflows: the sampling path agrees.
    seqs = [make_seq(temperature=t) for t in (1e-6, 1e-2) * 3]
    assert sample(Sampler([EOS]), logits, seqs).token_ids == ref


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(4, 50)
    seqs = [make_seq(temperature=0.0), make_seq(temperature=1.0),
            make_seq(temperature=0.0, logprobs=0), make_seq(temperature=2.0)]
    out = sample(Sampler([EOS]), logits, seqs).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_keeps_exactly_k_largest():
    torch.manual_seed(2)
    row = torch.randn(40)
    ids = sample_many(row, 4000, top_k=5, temperature=3.0)
    top5 = set(row.topk(5).indices.tolist())
    assert set(ids.tolist()) == top5  # nothing outside, and all five reachable


def test_top_p_keeps_smallest_nucleus():
    probs = [0.05, 0.5, 0.1, 0.25, 0.1]
    ids = sample_many(logits_for(probs), 4000, top_p=0.7)
    assert set(ids.tolist()) == {1, 3}  # 0.5 < 0.7 <= 0.5 + 0.25
    ids = sample_many(logits_for(probs), 4000, top_p=0.8)
    assert set(ids.tolist()) in ({1, 3, 2}, {1, 3, 4})  # the tie at 0.1 admits one of them
    frac = (ids == 1).float().mean().item()
    assert abs(frac - 0.5 / 0.85) < 0.03  # renormalised over the nucleus


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.5, 0.3, 0.11, 0.09]
    ids = sample_many(logits_for(probs), 4000, min_p=0.2)  # threshold 0.1
    assert set(ids.tolist()) == {0, 1, 2}


def test_top_k_top_p_min_p_combined():
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    # top-k 4 → {0,1,2,3}; top-p 0.95 over them keeps all 4 (0.9 < 0.95);
    # min-p 0.2 of the renormalised max drops 3 (0.06 < 0.08).
    ids = sample_many(logits_for(probs), 4000, top_k=4, top_p=0.95, min_p=0.2)
    assert set(ids.tolist()) == {0, 1, 2}


def reference_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= pres + freq * output.count(t)
    return out


@pytest.mark.parametrize("rep,pres,freq", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0),
                                           (1.0, 0.0, 0.4), (0.8, -0.5, 1.5)])
def test_penalties_match_reference(rep, pres, freq):
    torch.manual_seed(3)
    vocab = 30
    logits = torch.randn(3, vocab) * 3
    prompt, output = [1, 5, 5, 7, 20], [5, 9, 9, 9, 2, 7]
    seqs = [make_seq(temperature=0.0),  # no penalties: row untouched
            make_seq(prompt=prompt, output=output, repetition_penalty=rep,
                     presence_penalty=pres, frequency_penalty=freq),
            make_seq(prompt=[4], output=[4, 4], frequency_penalty=1.0)]
    x = logits.clone()
    _apply_penalties(x, seqs, [1, 2])
    assert torch.equal(x[0], logits[0])
    torch.testing.assert_close(x[1],
                               reference_penalties(logits[1], prompt, output, rep, pres, freq))
    torch.testing.assert_close(x[2], reference_penalties(logits[2], [4], [4, 4], 1.0, 0.0, 1.0))


def test_logit_bias_is_added_before_penalties():
    torch.manual_seed(4)
    vocab = 30
    logits = torch.randn(3, vocab) * 3
    bias = {int(logits[1].argmax()): -100.0, 7: 4.5, 11: 2.0}
    seqs = [make_seq(temperature=0.0),
            make_seq(temperature=0.0, logit_bias=bias),
            make_seq(prompt=[7, 11], temperature=0.0, logit_bias=bias, repetition_penalty=1.5)]
    biased = logits.clone()
    for t, b in bias.items():
        biased[1:, t] += b
    penalized = reference_penalties(biased[2], [7, 11], [], 1.5, 0.0, 0.0)
    out = sample(Sampler([EOS]), logits, seqs).token_ids
    assert out == [int(logits[0].argmax()), int(biased[1].argmax()), int(penalized.argmax())]
    for bad in ({-1: 1.0}, {3: 100.5}, {"3": 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0]])
    assert sample(Sampler([EOS]), logits, [make_seq(prompt=[1], temperature=0.0)]).token_ids == [1]
    out = sample(Sampler([EOS]), logits,
                 [make_seq(prompt=[1], temperature=0.0, repetition_penalty=1.2)])
    assert out.token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 8.0, 7.0, 1.0]])  # EOS best, then stop id 4
    kw = dict(temperature=0.0, min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    assert sample(Sampler([EOS]), logits, [make_seq(**kw)]).token_ids == [5]
    assert sample(Sampler([EOS]), logits, [make_seq(output=[6], **kw)]).token_ids == [5]
    assert sample(Sampler([EOS]), logits, [make_seq(output=[6, 6], **kw)]).token_ids == [EOS]


def run_steps(seqs: list[CachedRequestState], logits: torch.Tensor, steps: int) -> list[list[int]]:
    sampler = Sampler([EOS])
    for _ in range(steps):
        for s, t in zip(seqs, sample(sampler, logits[:len(seqs)], seqs).token_ids):
            s.token_ids.append(t)
    return [s.output_token_ids for s in seqs]


def test_seeded_reproducible_alone_in_batch_and_across_runs():
    torch.manual_seed(4)
    logits = torch.randn(1, 64).expand(5, -1).clone()
    alone = run_steps([make_seq(seed=42)], logits, 30)[0]
    torch.manual_seed(999)  # unseeded rows use the default generator: must not matter
    batch = [make_seq(), make_seq(seed=7, top_k=10), make_seq(seed=42),
             make_seq(temperature=0.0, seed=1), make_seq(top_p=0.9)]
    mixed = run_steps(batch, logits, 30)
    assert mixed[2] == alone
    assert run_steps([make_seq(seed=42)], logits, 30)[0] == alone
    assert run_steps([make_seq(seed=43)], logits, 30)[0] != alone
    assert batch[2].generator is not None and batch[0].generator is None


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(ids, minlength=len(probs)).double()
    expected = probs.double() * len(ids)
    return ((counts - expected) ** 2 / expected).sum().item()


# 99.9% quantile of chi-square with 7 degrees of freedom.
CHI2_7DF_999 = 24.32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_frequencies_follow_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    ids = sample_many(logits, 40000, temperature=temperature)
    assert chi_square(ids, (logits / temperature).softmax(-1)) < CHI2_7DF_999
    # Sanity: the test can fail — the untempered distribution is rejected at T=0.7.
    if temperature != 1.0:
        assert chi_square(ids, logits.softmax(-1)) > CHI2_7DF_999


def test_seeded_stream_follows_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2]])
    seq = make_seq(seed=5)
    ids = torch.tensor(run_steps([seq], logits, 5000)[0])
    assert chi_square(ids, logits[0].softmax(-1)) < CHI2_7DF_999


def test_logprobs_are_raw_log_softmax_with_top_n():
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    seqs = [make_seq(logprobs=3, temperature=0.5, repetition_penalty=1.5, output=[0, 1]),
            make_seq(logprobs=0, temperature=0.0),
            make_seq()]
    out = sample(Sampler([EOS]), logits, seqs)
    ref = logits.log_softmax(-1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    # The sampled token first, with its rank, then the top 3 best first.
    assert lp0.token_ids == [out.token_ids[0], *ref[0].topk(3).indices.tolist()]
    assert lp0.rank == int((ref[0] > ref[0, out.token_ids[0]]).sum()) + 1
    for t, v in zip(lp0.token_ids, lp0.logprobs):
        assert math.isclose(v, ref[0, t].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert lp1.token_ids == [out.token_ids[1]] == [ref[1].argmax().item()] and lp1.rank == 1
    assert math.isclose(lp1.logprobs[0], ref[1].max().item(), rel_tol=1e-6)
    assert out.logprobs[2] is None


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 16)
    before = logits.clone()
    sample(Sampler([EOS]), logits, [make_seq(repetition_penalty=2.0, output=[1], top_k=3),
                                    make_seq(min_tokens=1, temperature=0.0)])
    assert torch.equal(logits, before)
