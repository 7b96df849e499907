"""Each fused Triton kernel against its torch reference, through Triton's interpreter on CPU tensors.

Both tile profiles run: the GPU's (several K chunks, several programs per head, masked tails) and the
interpreter's (few large tiles). Tolerances: fp32 1e-5 (the kernels round where the eager ops round and sum in
fp32, so only the order of the sums differs); fp16 2e-3 absolute and relative, one to two units in the last place:
a different summation order can move a value across a rounding boundary of the half-precision result, and rope /
the norm round again after it. bf16: four units in the last place at the tensor's largest magnitude, because
Triton's interpreter (3.9) converts fp32 to bf16 by truncation, not rounding to nearest (checked here: 0.7539 * 1.5
= 1.1309 gives 1.1250 where torch gives 1.1328), and the kernels round at several points; the GPU rounds to
nearest, and the GPU check compares bf16 there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.kernels import interpreting, launch  # noqa: E402
from engine.model import RMSNorm, apply_rope  # noqa: E402

pytestmark = pytest.mark.skipif(
    not interpreting(),
    reason="these run the kernels through Triton's interpreter "
    "(GAPLESS_TRITON_INTERPRET=1, set by conftest on a machine without CUDA)",
)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["gpu", "interpreter"])
def profile(request, monkeypatch):
    monkeypatch.setattr(launch, "forced_profile", request.param)
    return request.param


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        ulp = 2.0**-7 * float(b.float().abs().max())  # bf16 keeps 8 significant bits
        torch.testing.assert_close(a.float(), b.float(), atol=4 * ulp, rtol=0)
        return
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def rnd(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    n = RMSNorm(x.shape[-1], eps)
    n.weight = torch.nn.Parameter(w, requires_grad=False)
    return n(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "bias", "qk_norm", "embed"])
def test_qkv_rope_matches_torch(profile, dtype, variant):
    B, DIM, H, HKV, D, L, pos, eps = 3, 200, 4, 2, 32, 16, 11, 1e-6
    x = rnd(B, DIM, dtype=dtype)
    norm_w = (torch.rand(DIM, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    w = rnd((H + 2 * HKV) * D, DIM, dtype=dtype, scale=0.1)
    b = rnd((H + 2 * HKV) * D, dtype=dtype, scale=0.1) if variant == "bias" else None
    qn = (torch.rand(D, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype) if variant == "qk_norm" else None
    kn = (torch.rand(D, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype) if variant == "qk_norm" else None
    cos, sin = rnd(L, D, dtype=dtype), rnd(L, D, dtype=dtype, seed=1)
    tok = torch.tensor([[5], [0], [9]])
    emb = rnd(12, DIM, dtype=dtype, seed=2) if variant == "embed" else None
    x_in = emb[tok[:, 0]] if emb is not None else x
    q = torch.zeros(B, H, D, dtype=dtype)
    kc, vc = torch.zeros(B, HKV, L, D, dtype=dtype), torch.zeros(B, HKV, L, D, dtype=dtype)
    launch.qkv_rope(x, tok, emb, norm_w, w, b, qn, kn, cos, sin, torch.tensor([pos]), q, kc, vc, eps)

    qkv = F.linear(rms(x_in, norm_w, eps), w, b)
    rq, rk, rv = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    rq, rk = rq.view(B, 1, H, D), rk.view(B, 1, HKV, D)
    if variant == "qk_norm":
        rq, rk = rms(rq, qn, eps), rms(rk, kn, eps)
    rq = apply_rope(rq.transpose(1, 2), cos[pos : pos + 1], sin[pos : pos + 1])[:, :, 0]
    rk = apply_rope(rk.transpose(1, 2), cos[pos : pos + 1], sin[pos : pos + 1])[:, :, 0]
    close(q, rq, dtype)
    close(kc[:, :, pos], rk, dtype)
    close(vc[:, :, pos], rv.view(B, HKV, D), dtype)
    assert not kc[:, :, :pos].any() and not kc[:, :, pos + 1 :].any(), "only position pos is written"
    if emb is not None:
        assert torch.equal(x, x_in), "the first layer writes the embedded rows into the residual stream"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [0, 37, 63])
def test_decode_attention_matches_sdpa(profile, dtype, pos):
    B, H, HKV, D, L = 2, 6, 2, 16, 64  # groups of 3 query heads: a masked lane in a block of 4
    q = rnd(B, H, D, dtype=dtype)
    kc, vc = rnd(B, HKV, L, D, dtype=dtype, seed=1), rnd(B, HKV, L, D, dtype=dtype, seed=2)
    y = torch.zeros(B, H * D, dtype=dtype)
    launch.decode_attention(q, kc, vc, torch.tensor([pos]), y)
    ref = F.scaled_dot_product_attention(
        q[:, :, None].float(), kc[:, :, : pos + 1].float(), vc[:, :, : pos + 1].float(), enable_gqa=True
    )
    close(y, ref[:, :, 0].reshape(B, H * D).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_residual_matches_torch(profile, dtype, bias):
    B, N, K = 5, 72, 200
    a, w = rnd(B, K, dtype=dtype), rnd(N, K, dtype=dtype, scale=0.1)
    b = rnd(N, dtype=dtype, scale=0.1) if bias else None
    x = rnd(B, N, dtype=dtype, seed=3)
    ref = x + F.linear(a, w, b)
    launch.gemv_residual(a, w, b, x)
    close(x, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_norm_gate_up_matches_torch(profile, dtype, bias):
    B, DIM, INTER, eps = 3, 200, 72, 1e-5
    x = rnd(B, DIM, dtype=dtype)
    norm_w = (torch.rand(DIM, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    w = rnd(2 * INTER, DIM, dtype=dtype, scale=0.1)
    b = rnd(2 * INTER, dtype=dtype, scale=0.1) if bias else None
    out = torch.zeros(B, INTER, dtype=dtype)
    launch.norm_gate_up(x, norm_w, w, b, out, eps)
    gate, up = F.linear(rms(x, norm_w, eps), w, b).split([INTER, INTER], dim=-1)
    close(out, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_head_logits_and_block_maxima(profile, dtype):
    B, DIM, V, eps = 3, 200, 300, 1e-5
    x = rnd(B, DIM, dtype=dtype)
    norm_w = (torch.rand(DIM, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    w = rnd(V, DIM, dtype=dtype, scale=0.1)
    blocks = launch.head_blocks(V, DIM)
    logits = torch.zeros(B, V)
    pmax, pidx = torch.zeros(B, blocks), torch.zeros(B, blocks, dtype=torch.int32)
    launch.norm_head(x, norm_w, w, logits, pmax, pidx, eps)
    close(logits, F.linear(rms(x, norm_w, eps), w).float(), dtype)
    size = launch.gemv_blocks(V, DIM)[0]
    for blk in range(blocks):
        part = logits[:, blk * size : (blk + 1) * size]
        assert torch.equal(pmax[:, blk], part.max(dim=1).values)
        assert torch.equal(pidx[:, blk].long(), blk * size + part.argmax(dim=1))


def test_greedy_accept_picks_the_first_maximum_and_keeps_the_books():
    # row 0: the max 5.0 in blocks 1 and 2 -> block 1's index; row 1: done -> its EOS; row 2: picks an EOS id
    pmax = torch.tensor([[1.0, 5.0, 5.0], [9.0, 0.0, 0.0], [0.0, 0.0, 7.0]])
    pidx = torch.tensor([[3, 40, 70], [2, 33, 66], [1, 30, 61]], dtype=torch.int32)
    eos = torch.tensor([61, 62])
    done = torch.tensor([False, True, False])
    out = torch.zeros(3, 8, dtype=torch.long)
    tok = torch.zeros(3, 1, dtype=torch.long)
    counter, pos = torch.tensor([4]), torch.tensor([20])
    launch.greedy_accept(pmax, pidx, eos, done, out, tok, counter, pos)
    assert out[:, 4].tolist() == [40, 61, 61]
    assert tok[:, 0].tolist() == [40, 61, 61]
    assert done.tolist() == [False, True, True]
    assert (counter.item(), pos.item()) == (5, 21)
    assert not out[:, :4].any() and not out[:, 5:].any()
