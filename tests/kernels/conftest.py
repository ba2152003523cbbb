"""Shared fixtures for the Triton kernel tests.

Without CUDA the kernels run under the Triton interpreter on small CPU shapes; with
`-m gpu` on a CUDA machine the same tests run on full-size shapes.
"""
import os

import torch

if not torch.cuda.is_available():
    # Read by triton.jit when the kernel modules are imported, so it must be set first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from liteinfer.attention import allocate_kv_pool
from liteinfer.attention.torch_backend import slot_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (max abs error relative to max|ref|, ||out - ref|| / ||ref||). The interpreter rounds
# fp32 -> bf16 by truncation, hence the bf16 slack.
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 2e-3),
              torch.bfloat16: (3e-2, 1.5e-2)}
# e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of itself.
FP8_TOLERANCE = (2 ** -4, 2 ** -4)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """On the GPU the tests run on several pytest-xdist workers (scripts/gpu_session.sh); each
    gives its cached blocks back after a test, so that the workers' current tests, not the sum
    of their largest ones, must fit in memory together."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
def device(request) -> str:
    torch.manual_seed(0)
    return request.param


@pytest.fixture
def full(device: str) -> bool:
    """Full-size shapes on the GPU, small ones under the interpreter."""
    return device == "cuda"


@pytest.fixture
def needs_dot(device: str):
    """Attention tests call this with their dtype: the interpreter multiplies bf16 bit
    patterns as integers in tl.dot, so bf16 attention is checked on the GPU only."""
    def check(dtype: torch.dtype) -> None:
        if device == "cpu" and dtype == torch.bfloat16:
            pytest.skip("bf16 tl.dot is wrong under the Triton interpreter")
    return check


@pytest.fixture
def needs_fp8_store(device: str):
    """Kernels that write e4m3 are checked on the GPU only: the interpreter rounds to e4m3
    wrongly (ties away from even, and a rounding carry into the exponent is lost: 124 -> 64).
    It widens e4m3 correctly (but for NaN), so kernels reading e4m3 pools run there; the
    torch paths (attention.torch_backend, layers.quantization.fp8) write e4m3 on the CPU."""
    if device == "cpu":
        pytest.skip("the Triton interpreter rounds to e4m3 wrongly")


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Every element finite and close: max error and relative norm error, per dtype."""
    dtype = dtype or out.dtype
    max_tol, rel_tol = FP8_TOLERANCE if dtype == torch.float8_e4m3fn else TOLERANCES[dtype]
    out64, ref64 = out.double(), ref.double().to(out.device)
    assert torch.isfinite(out64).all(), "non-finite output"
    max_err = (out64 - ref64).abs().max().item()
    scale = max(1.0, ref64.abs().max().item())
    assert max_err <= max_tol * scale, f"max error {max_err:.3g} > {max_tol * scale:.3g}"
    rel = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert rel <= rel_tol, f"relative error {rel:.3g} > {rel_tol:.3g}"


def _pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
          dtype: torch.dtype, device: str, head_major: bool = True) -> torch.Tensor:
    """An uninitialized pool [num_blocks, block_size, Hkv, D]: head-major as the engine
    allocates it, or contiguous (token-major); the kernels must serve both."""
    if head_major:
        return allocate_kv_pool(num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                device=device)
    return torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                       device=device)


class _PagedKV:
    """A KV pool holding ragged sequences in shuffled blocks. Every pool row that no sequence
    owns (unused blocks, tails of last blocks) is NaN, so any stray read poisons the output.
    kv_dtype: the pool's element type when not `dtype` (e4m3: K/V drawn in fp32, rounded)."""

    def __init__(self, context_lens: list[int], num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: str, spare_blocks: int = 3,
                 head_major: bool = True, kv_dtype: torch.dtype | None = None):
        dtype = kv_dtype or dtype
        self.context_lens = context_lens
        self.block_size = block_size
        per_seq = [-(-c // block_size) for c in context_lens]
        num_blocks = sum(per_seq) + spare_blocks
        self.k_cache, self.v_cache = (
            _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                  head_major).fill_(float("nan")) for _ in range(2))
        perm = torch.randperm(num_blocks, device=device)
        width = max(1, max(per_seq, default=1))
        self.block_tables = torch.zeros(len(context_lens), width, dtype=torch.int32, device=device)
        used = 0
        for b, (ctx, n) in enumerate(zip(context_lens, per_seq)):
            self.block_tables[b, :n] = perm[used:used + n].to(torch.int32)
            used += n
            at = slot_rows(self.k_cache, self.slots(b))
            for cache in (self.k_cache, self.v_cache):
                cache[at] = torch.randn(ctx, num_kv_heads, head_dim, device=device).to(dtype)
        self.context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)

    def slots(self, b: int) -> torch.Tensor:
        pos = torch.arange(self.context_lens[b], device=self.block_tables.device)
        return self.block_tables[b, pos // self.block_size].long() * self.block_size \
            + pos % self.block_size

    def kv64(self, b: int, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's K and V as float64 [ctx, Hq, D], KV heads repeated HF-style."""
        group = num_q_heads // self.k_cache.shape[2]
        at = slot_rows(self.k_cache, self.slots(b))
        k, v = self.k_cache[at].double(), self.v_cache[at].double()
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                   scale: float, chunk: int = 1024) -> torch.Tensor:
    """float64 causal attention of q [n, H, D] at positions first_pos.. over k/v [ctx, H, D],
    in query chunks so that long prompts fit in memory."""
    outs = []
    kv_pos = torch.arange(k.shape[0], device=k.device)
    for i in range(0, q.shape[0], chunk):
        qc = q[i:i + chunk].double()
        s = torch.einsum("qhd,khd->hqk", qc, k) * scale
        q_pos = first_pos + i + torch.arange(qc.shape[0], device=k.device)
        s = s.masked_fill(kv_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def _rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """float64 HF rotate_half RoPE of x [T, H, D], one position per token."""
    cos, sin = cos_sin[positions.long()].double().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 through dtype, where the unfused layers hold a tensor of the model dtype. The
    Triton interpreter converts fp32 to bf16 by truncation, so on CPU the reference does too."""
    if dtype == torch.bfloat16 and x.device.type == "cpu":
        return (x.float().view(torch.int32) & -65536).view(torch.float32).double()
    return x.to(dtype).double()


def _normed_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm in float64, rounding where it does."""
    h = x.double()
    normed = _rounded(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    return _rounded(weight.double() * normed, x.dtype)


def _qkv_views(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str):
    """q, k, v as strided views of one fused projection output, as the model produces them."""
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                      device=device)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


@pytest.fixture(name="qkv_views")
def qkv_views_fixture():
    return _qkv_views


@pytest.fixture(name="rope_ref")
def rope_ref_fixture():
    return _rope_ref


@pytest.fixture(name="assert_close")
def assert_close_fixture():
    return _assert_close


@pytest.fixture(name="pool")
def pool_fixture():
    return _pool


@pytest.fixture(name="at")
def at_fixture():
    return slot_rows


@pytest.fixture(name="PagedKV")
def paged_kv_fixture():
    return _PagedKV


@pytest.fixture(name="attention_ref")
def attention_ref_fixture():
    return _attention_ref


@pytest.fixture(name="rounded")
def rounded_fixture():
    return _rounded


@pytest.fixture(name="normed_ref")
def normed_ref_fixture():
    return _normed_ref
