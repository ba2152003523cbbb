"""`liteinfer bench quality` on the real SmolLM2-135M (CPU, fp32 reference): each
quantization's KL divergence and top-1 agreement against the reference, with the bounds below.
The bounds hold with a wide margin on the measured table (NOTES.md): FP8 moves the next-token
distribution less than int4 does, and Q8_0 less than Q4_0."""
import math

import pytest

from liteinfer.bench.quality import QUANTIZATIONS, render


@pytest.fixture(scope="module")
def rows():
    from liteinfer.bench.quality import measure
    chosen = tuple(q for q in QUANTIZATIONS if q.name in ("fp8", "int4 RTN", "GGUF Q8_0",
                                                          "GGUF Q4_0"))
    # Two windows of 256 tokens: 256 scored positions of the GPL's text.
    rows = measure(quantizations=chosen, window=256, tokens=512, device="cpu", dtype="float32")
    print(render(rows))
    return {r["quantization"]: r for r in rows}


@pytest.mark.slow
def test_quantizations_rank_as_their_precision(rows):
    assert rows["none"]["positions"] == 256
    # SmolLM2 reads a licence it has seen the like of: a low perplexity, not a random one.
    assert 1.0 < rows["none"]["perplexity"] < 20.0
    for name in ("fp8", "int4 RTN", "GGUF Q8_0", "GGUF Q4_0"):
        r = rows[name]
        assert math.isfinite(r["kl_mean"]) and 0.0 < r["kl_mean"] <= r["kl_p99"], name
        assert 0.5 < r["top1_agreement"] <= 1.0, name
    assert rows["fp8"]["kl_mean"] < rows["int4 RTN"]["kl_mean"]
    assert rows["GGUF Q8_0"]["kl_mean"] < rows["GGUF Q4_0"]["kl_mean"]
    # 8-bit GGUF blocks barely move the model: agreement on nearly every position.
    assert rows["GGUF Q8_0"]["top1_agreement"] > 0.95
    assert rows["GGUF Q8_0"]["kl_mean"] < 0.01
