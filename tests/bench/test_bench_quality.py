"""`liteinfer bench quality` on the real SmolLM2-135M (CPU, fp32 reference): each
quantization's KL divergence and top-1 agreement against the reference, with the bounds below.
On these two windows the harness measured (NOTES.md) perplexity 17.8 for the reference, mean KL
0.052 for fp8 against 0.302 for int4, and 0.0016 for Q8_0 against 0.250 for Q4_0 (top-1
agreement 86.6%, 73.6%, 98.0%, 73.2%): the bounds hold with wide margins."""
import math

import pytest

from liteinfer.bench.quality import QUANTIZATIONS, render


@pytest.fixture(scope="module")
def rows():
    from liteinfer.bench.quality import measure
    chosen = tuple(q for q in QUANTIZATIONS if q.name in ("fp8", "int4 RTN", "GGUF Q8_0",
                                                          "GGUF Q4_0"))
    # Two windows of 256 tokens, each's second half scored: 2 x 127 next tokens of the GPL.
    rows = measure(quantizations=chosen, window=256, tokens=512, device="cpu", dtype="float32")
    print(render(rows))
    return {r["quantization"]: r for r in rows}


@pytest.mark.slow
def test_quantizations_rank_as_their_precision(rows):
    assert rows["none"]["positions"] == 2 * 127
    # A model reading English, not noise (a uniform guess would be 49,152).
    assert 1.0 < rows["none"]["perplexity"] < 40.0
    for name in ("fp8", "int4 RTN", "GGUF Q8_0", "GGUF Q4_0"):
        r = rows[name]
        assert math.isfinite(r["kl_mean"]) and 0.0 < r["kl_mean"] <= r["kl_p99"], name
        assert 0.5 < r["top1_agreement"] <= 1.0, name
    assert rows["fp8"]["kl_mean"] < rows["int4 RTN"]["kl_mean"]
    assert rows["GGUF Q8_0"]["kl_mean"] < rows["GGUF Q4_0"]["kl_mean"]
    # 8-bit GGUF blocks barely move the model: agreement on nearly every position.
    assert rows["GGUF Q8_0"]["top1_agreement"] > 0.95
    assert rows["GGUF Q8_0"]["kl_mean"] < 0.01
