"""Launchers of the fused kernels: block sizes, grids and arguments. Block sizes follow from the shapes (K, N, head
size) alone, never from the number of rows, and rows run in fixed blocks of ROWS_PER_PROGRAM: that is what makes a
row's result independent of how many rows run."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from engine.kernels import import_error, interpreting, load_triton

ROWS_PER_PROGRAM = 4
MAX_ROWS = 32  # the greedy pick serves every row in one program


@dataclass(frozen=True)
class Blocks:
    """Tile limits. The GPU's: a GEMV over at least ~one program per SM of a large GPU, and per program a
    [ROWS_PER_PROGRAM, BLOCK_N, BLOCK_K] product of at most 4,096 values (32 registers a thread at 4 warps; larger
    tiles spill, as ptxas's resource usage showed for sm_90). The interpreter's: few programs with large tiles,
    since it pays per program and per op, not per element."""

    gemv_programs: int  # programs over N a GEMV aims at, per row block
    max_block_n: int
    max_block_k: int
    max_tile: int  # BLOCK_N * BLOCK_K at most (and BLOCK_S * BLOCK_D * BLOCK_G for attention)
    rope_pairs: int  # output pairs per program of the QKV kernel (fewer when head_dim / 2 needs it)
    attn_block_s: int  # keys per attention loop iteration at most


PROFILES = {
    "gpu": Blocks(gemv_programs=128, max_block_n=64, max_block_k=128, max_tile=1024, rope_pairs=8, attn_block_s=64),
    "interpreter": Blocks(
        gemv_programs=1, max_block_n=256, max_block_k=1024, max_tile=1 << 18, rope_pairs=1 << 20, attn_block_s=256
    ),
}
forced_profile: Optional[str] = None  # tests run the GPU's tiles through the interpreter by setting this


def blocks() -> Blocks:
    return PROFILES[forced_profile or ("interpreter" if interpreting() else "gpu")]


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a GEMV with n outputs over k inputs."""
    b = blocks()
    block_k = min(b.max_block_k, _pow2_ceil(k))
    return max(4, min(b.max_block_n, _pow2_floor(n // b.gemv_programs), b.max_tile // block_k)), block_k


def rope_pairs(head_dim: int, qk_norm: bool) -> int:
    """Output pairs (d, d + D/2) per program of the QKV kernel: a whole head when q/k norm needs its sum."""
    half = head_dim // 2
    if qk_norm:
        return half
    pairs = _pow2_floor(min(blocks().rope_pairs, half))
    while half % pairs:
        pairs //= 2
    return pairs


def qkv_block_k(dim: int, pairs: int) -> int:
    b = blocks()
    return max(16, min(b.max_block_k, _pow2_ceil(dim), _pow2_floor(b.max_tile // pairs)))


def attn_block_s(group: int, head_dim: int) -> int:
    b = blocks()
    return max(8, min(b.attn_block_s, _pow2_floor(4 * b.max_tile // (_pow2_ceil(group) * _pow2_ceil(head_dim)))))


def _kernels() -> ModuleType:
    mod = load_triton()
    if mod is None:
        raise RuntimeError(f"the fused kernels cannot run: {import_error()}")
    return mod


def _row_blocks(rows: int) -> int:
    return -(-rows // ROWS_PER_PROGRAM)


def _pdl(use_pdl: bool) -> dict:
    """The kernel's USE_PDL constexpr and, when set, the launch option that lets it start before the previous
    kernel ends."""
    return {"USE_PDL": use_pdl, "launch_pdl": True} if use_pdl else {"USE_PDL": False}


def _gemv_launch(kernel: Any, n: int, kdim: int, rows: int, use_pdl: bool) -> Callable[..., None]:
    """The launch of a GEMV-shaped kernel, to call with the kernel's own arguments: programs over n outputs in
    blocks of BLOCK_N and over the rows in blocks of ROWS_PER_PROGRAM, each reducing kdim inputs by BLOCK_K."""
    block_n, block_k = gemv_blocks(n, kdim)
    run = kernel[(-(-n // block_n), _row_blocks(rows))]
    return partial(run, BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=block_n, BLOCK_K=block_k, **_pdl(use_pdl))


def qkv_rope(
    x: torch.Tensor,
    tok: torch.Tensor,
    emb: Optional[torch.Tensor],
    norm_w: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor],
    q_norm: Optional[torch.Tensor],
    k_norm: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    use_pdl: bool = False,
) -> None:
    """x [B, dim] (written from emb[tok] when emb is given), w [(H + 2 Hkv) D, dim], q_out [B, H, D],
    caches [B, Hkv, L, D], cos/sin [L, D] in the model's dtype, pos [1]."""
    k = _kernels()
    rows, dim = x.shape
    _, n_heads, head_dim = q_out.shape
    n_kv = k_cache.shape[1]
    qk_norm = q_norm is not None
    pairs = rope_pairs(head_dim, qk_norm)
    grid = ((n_heads + 2 * n_kv) * (head_dim // 2 // pairs), _row_blocks(rows))
    k.qkv_rope_kernel[grid](
        x,
        tok,
        emb if emb is not None else x,
        norm_w,
        w,
        b if b is not None else w,
        q_norm if qk_norm else norm_w,
        k_norm if qk_norm else norm_w,
        cos,
        sin,
        pos,
        q_out,
        k_cache,
        v_cache,
        rows,
        eps,
        k_cache.shape[2],
        DIM=dim,
        H=n_heads,
        HKV=n_kv,
        D=head_dim,
        EMBED=emb is not None,
        HAS_BIAS=b is not None,
        QK_NORM=qk_norm,
        PAIRS=pairs,
        BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_K=qkv_block_k(dim, pairs),
        **_pdl(use_pdl),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    y: torch.Tensor,
    use_pdl: bool = False,
) -> None:
    """q [B, H, D] against the cache over [0, pos] -> y [B, H * D]."""
    k = _kernels()
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    k.decode_attention_kernel[(rows, n_kv)](
        q,
        k_cache,
        v_cache,
        pos,
        y,
        k_cache.shape[2],
        head_dim**-0.5,
        H=n_heads,
        HKV=n_kv,
        D=head_dim,
        GROUP=group,
        BLOCK_G=_pow2_ceil(group),
        BLOCK_D=_pow2_ceil(head_dim),
        BLOCK_S=attn_block_s(group, head_dim),
        **_pdl(use_pdl),
    )


def gemv_residual(
    a: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], x: torch.Tensor, use_pdl: bool = False
) -> None:
    """x += a @ w.T (+ b), in place: a [B, K], w [N, K], x [B, N]."""
    rows, kdim = a.shape
    n = w.shape[0]
    bias = b if b is not None else w
    _gemv_launch(_kernels().gemv_residual_kernel, n, kdim, rows, use_pdl)(
        a, w, bias, x, rows, N=n, K=kdim, HAS_BIAS=b is not None
    )


def norm_gate_up(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    w: torch.Tensor,
    b: Optional[torch.Tensor],
    out: torch.Tensor,
    eps: float,
    use_pdl: bool = False,
) -> None:
    """out = silu(gate) * up of RMSNorm(x): w [2 I, dim], out [B, I]."""
    rows, dim = x.shape
    inter = out.shape[1]
    bias = b if b is not None else w
    _gemv_launch(_kernels().norm_gate_up_kernel, inter, dim, rows, use_pdl)(
        x, norm_w, w, bias, out, rows, eps, DIM=dim, INTER=inter, HAS_BIAS=b is not None
    )


def head_blocks(vocab: int, dim: int) -> int:
    return -(-vocab // gemv_blocks(vocab, dim)[0])


def norm_head(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    w: torch.Tensor,
    logits: torch.Tensor,
    pmax: torch.Tensor,
    pidx: torch.Tensor,
    eps: float,
    use_pdl: bool = False,
) -> None:
    """logits [B, V] fp32 of RMSNorm(x) @ w.T, and each vocabulary block's max and first index: pmax/pidx [B, blocks]."""
    rows, dim = x.shape
    vocab = w.shape[0]
    _gemv_launch(_kernels().norm_head_kernel, vocab, dim, rows, use_pdl)(
        x, norm_w, w, logits, pmax, pidx, rows, eps, vocab, DIM=dim
    )


def greedy_accept(
    pmax: torch.Tensor,
    pidx: torch.Tensor,
    eos: torch.Tensor,
    done: torch.Tensor,
    out: torch.Tensor,
    tok: torch.Tensor,
    counter: torch.Tensor,
    pos: torch.Tensor,
    use_pdl: bool = False,
) -> None:
    """The greedy tokens from the head's block maxima, written as RunnerBase._accept writes them; counter, pos += 1."""
    k = _kernels()
    rows, blocks = pmax.shape
    if rows > MAX_ROWS:
        raise ValueError(f"the fused greedy pick serves at most {MAX_ROWS} rows, got {rows}")
    k.greedy_accept_kernel[(1,)](
        pmax,
        pidx,
        eos,
        done,
        out,
        tok,
        counter,
        pos,
        rows,
        blocks,
        out.stride(0),
        eos.numel(),
        BLOCK_B=MAX_ROWS,
        BLOCK_P=min(64, _pow2_ceil(blocks)),
        BLOCK_E=_pow2_ceil(eos.numel()),
        **_pdl(use_pdl),
    )
