"""The Triton kernels of one fused decode step: five per layer, then the output head and the greedy pick.

Imported only through engine.kernels.load_triton(), which sets TRITON_INTERPRET first when the interpreter is asked
for. Every kernel serves rows in fixed blocks of BLOCK_M and reduces each row in an order fixed by K and the block
sizes alone, so a row's result is the same whether 1 or 32 rows run. With USE_PDL, a kernel loads what does not
depend on the previous kernel (weights, norms, rope tables) before gdc_wait(), and lets the next kernel start its
own prologue at once: nothing before a kernel's wait writes memory, so the early start is safe.

Rounding follows the eager model (engine/model.py) op by op: the norm's output, each projection, the rope terms and
the activation are rounded to the model's dtype where the eager path rounds them; sums run in fp32. The row
count B is not specialised on, so 1 row and 32 rows run the same compiled code.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL is reported unavailable and USE_PDL is never set
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _pdl_start(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _pdl_wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()


@triton.jit
def _rstd(x_row, rmask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row of x [rows, K] in fp32: x_row [BLOCK_M] row pointers."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_row[:, None] + offs[None, :], mask=rmask[:, None] & (offs < K)[None, :], other=0.0)
        xv = xv.to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _normed(x_row, rmask, offs, kmask, rstd, norm_w, dt):
    """The eager RMSNorm's output over one K chunk: weight * (x * rstd rounded to dt), rounded to dt. Products of
    two dt values are exact in fp32, so rounding the fp32 product is the dt product."""
    xv = tl.load(x_row[:, None] + offs[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    nw = tl.load(norm_w + offs, mask=kmask, other=0.0).to(tl.float32)
    return ((xv * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt).to(tl.float32)


@triton.jit
def _dot_rows(h, w):
    """h [M, K] . w [N, K] -> [M, N], fp32; each row's sum in an order fixed by the tile shape."""
    return tl.sum(h[:, None, :] * w[None, :, :].to(tl.float32), axis=2)


@triton.jit
def _gemv_block(B, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's outputs and rows of a GEMV over B rows and N outputs: (n, n < N, rows, rows < B)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return n, n < N, rows, rows < B


@triton.jit
def _first_chunk(w_rows, nmask, K, BLOCK_K: tl.constexpr):
    """The first BLOCK_K inputs of the weight rows starting at w_rows [N]: what a kernel loads before its wait."""
    first = tl.arange(0, BLOCK_K)
    return tl.load(w_rows[:, None] + first[None, :], mask=nmask[:, None] & (first < K)[None, :], other=0.0)


@triton.jit
def _norm_dot2(
    x_row, rmask, rstd, norm_w, dt, rows1, w1, rows2, w2, nmask, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """RMSNorm(x) of BLOCK_M rows (row pointers x_row, 1/rms rstd) against two sets of weight rows of a [*, K]
    matrix (row pointers rows1, rows2 [N]; w1, w2 their first chunk, loaded before the caller's wait): two fp32
    [BLOCK_M, N] sums, each in the order fixed by BLOCK_K."""
    acc1 = tl.zeros([BLOCK_M, w1.shape[0]], tl.float32)
    acc2 = tl.zeros([BLOCK_M, w2.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        kmask = offs < K
        h = _normed(x_row, rmask, offs, kmask, rstd, norm_w, dt)
        if k0 > 0:  # the first chunk was loaded before the wait
            wmask = nmask[:, None] & kmask[None, :]
            w1 = tl.load(rows1[:, None] + offs[None, :], mask=wmask, other=0.0)
            w2 = tl.load(rows2[:, None] + offs[None, :], mask=wmask, other=0.0)
        acc1 += _dot_rows(h, w1)
        acc2 += _dot_rows(h, w2)
    return acc1, acc2


@triton.jit(do_not_specialize=["B"])
def qkv_rope_kernel(
    x_ptr,
    tok_ptr,
    emb_ptr,
    norm_w,
    w_ptr,
    b_ptr,
    qn_ptr,
    kn_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    B,
    eps,
    cache_len,
    DIM: tl.constexpr,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    EMBED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """RMSNorm + the QKV GEMV (+ bias, + q/k RMSNorm) + rope + the write of k and v into the cache at pos.

    Program (head * D/2/PAIRS + chunk, row block): PAIRS output pairs (d, d + D/2) of one q, k or v head, so rope's
    rotate-half is elementwise between two accumulators. With QK_NORM a program holds its whole head (PAIRS = D/2).
    With EMBED (the first layer) the rows come from the embedding of the token ids, and program 0 of each row block
    writes them into the residual stream x.
    """
    _pdl_start(USE_PDL)
    HALF: tl.constexpr = D // 2
    CHUNKS: tl.constexpr = HALF // PAIRS
    head = tl.program_id(0) // CHUNKS
    chunk = tl.program_id(0) % CHUNKS
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    dt = q_ptr.dtype.element_ty
    j = chunk * PAIRS + tl.arange(0, PAIRS)
    n1 = head * D + j
    n2 = n1 + HALF
    jmask = j < HALF  # always: PAIRS divides D / 2
    w1 = _first_chunk(w_ptr + n1 * DIM, jmask, DIM, BLOCK_K)
    w2 = _first_chunk(w_ptr + n2 * DIM, jmask, DIM, BLOCK_K)
    if HAS_BIAS:
        b1 = tl.load(b_ptr + n1).to(tl.float32)
        b2 = tl.load(b_ptr + n2).to(tl.float32)
    _pdl_wait(USE_PDL)
    pos = tl.load(pos_ptr)
    if EMBED:
        ids = tl.load(tok_ptr + rows, mask=rmask, other=0)
        x_row = emb_ptr + ids * DIM
    else:
        x_row = x_ptr + rows * DIM
    rstd = _rstd(x_row, rmask, DIM, eps, BLOCK_M, BLOCK_K)
    acc1, acc2 = _norm_dot2(
        x_row, rmask, rstd, norm_w, dt, w_ptr + n1 * DIM, w1, w_ptr + n2 * DIM, w2, jmask, DIM, BLOCK_M, BLOCK_K
    )
    if EMBED:
        if tl.program_id(0) == 0:
            for k0 in range(0, DIM, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                emask = rmask[:, None] & (offs < DIM)[None, :]
                xv = tl.load(x_row[:, None] + offs[None, :], mask=emask, other=0.0)
                tl.store(x_ptr + rows[:, None] * DIM + offs[None, :], xv, mask=emask)
    if HAS_BIAS:
        acc1 += b1[None, :]
        acc2 += b2[None, :]
    a1 = acc1.to(dt).to(tl.float32)
    a2 = acc2.to(dt).to(tl.float32)
    is_v = head >= H + HKV
    if QK_NORM:
        if head < H + HKV:
            ss = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
            r = 1.0 / tl.sqrt(ss / D + eps)
            if head < H:
                w_n1 = tl.load(qn_ptr + j).to(tl.float32)
                w_n2 = tl.load(qn_ptr + HALF + j).to(tl.float32)
            else:
                w_n1 = tl.load(kn_ptr + j).to(tl.float32)
                w_n2 = tl.load(kn_ptr + HALF + j).to(tl.float32)
            a1 = ((a1 * r[:, None]).to(dt).to(tl.float32) * w_n1[None, :]).to(dt).to(tl.float32)
            a2 = ((a2 * r[:, None]).to(dt).to(tl.float32) * w_n2[None, :]).to(dt).to(tl.float32)
    smask = rmask[:, None] & (j < HALF)[None, :]
    if is_v:
        kvh = head - H - HKV
        dst = vc_ptr + ((rows[:, None] * HKV + kvh) * cache_len + pos) * D + j[None, :]
        tl.store(dst, a1.to(dt), mask=smask)
        tl.store(dst + HALF, a2.to(dt), mask=smask)
    else:
        c1 = tl.load(cos_ptr + pos * D + j).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + pos * D + HALF + j).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + pos * D + j).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + pos * D + HALF + j).to(tl.float32)[None, :]
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as the eager op rounds them
        o1 = ((a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
        if head < H:
            dst = q_ptr + (rows[:, None] * H + head) * D + j[None, :]
        else:
            dst = kc_ptr + ((rows[:, None] * HKV + head - H) * cache_len + pos) * D + j[None, :]
        tl.store(dst, o1, mask=smask)
        tl.store(dst + HALF, o2, mask=smask)


@triton.jit
def decode_attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    y_ptr,
    cache_len,
    scale,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Attention of one row's query heads of one KV head over cache positions [0, pos], online softmax over key
    blocks of BLOCK_S. Program (row, kv head); y [B, H * D]."""
    _pdl_start(USE_PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < D
    _pdl_wait(USE_PDL)
    n = (tl.load(pos_ptr) + 1).to(tl.int32)
    qh = row * H + kvh * GROUP + g
    q = tl.load(q_ptr + qh[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    base = (row * HKV + kvh) * cache_len * D
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < n
        kvmask = smask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + base + s[:, None] * D + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(smask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + base + s[:, None] * D + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(y_ptr + qh[:, None] * D + d[None, :], out.to(dt), mask=gmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["B"])
def gemv_residual_kernel(
    a_ptr,
    w_ptr,
    b_ptr,
    x_ptr,
    B,
    N: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """x[rows, n] = x + (a @ w.T + b) for a block of N outputs, in place (each program owns its outputs): the
    O projection and the down projection with their residual adds. a [B, K], w [N, K], x [B, N]."""
    _pdl_start(USE_PDL)
    n, nmask, rows, rmask = _gemv_block(B, N, BLOCK_M, BLOCK_N)
    dt = x_ptr.dtype.element_ty
    w = _first_chunk(w_ptr + n * K, nmask, K, BLOCK_K)
    _pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        kmask = offs < K
        if k0 > 0:  # the first chunk was loaded before the wait
            w = tl.load(w_ptr + n[:, None] * K + offs[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + rows[:, None] * K + offs[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc += _dot_rows(a.to(tl.float32), w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    o = acc.to(dt).to(tl.float32)
    mask = rmask[:, None] & nmask[None, :]
    xp = x_ptr + rows[:, None] * N + n[None, :]
    x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    tl.store(xp, (x + o).to(dt), mask=mask)


@triton.jit(do_not_specialize=["B"])
def norm_gate_up_kernel(
    x_ptr,
    norm_w,
    w_ptr,
    b_ptr,
    out_ptr,
    B,
    eps,
    DIM: tl.constexpr,
    INTER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = silu(gate) * up of RMSNorm(x) for a block of INTER features: w [2 * INTER, DIM] (gate rows, then up)."""
    _pdl_start(USE_PDL)
    n, nmask, rows, rmask = _gemv_block(B, INTER, BLOCK_M, BLOCK_N)
    dt = out_ptr.dtype.element_ty
    gate_rows = w_ptr + n * DIM
    up_rows = w_ptr + (INTER + n) * DIM
    wg = _first_chunk(gate_rows, nmask, DIM, BLOCK_K)
    wu = _first_chunk(up_rows, nmask, DIM, BLOCK_K)
    if HAS_BIAS:
        bg = tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        bu = tl.load(b_ptr + INTER + n, mask=nmask, other=0.0).to(tl.float32)
    _pdl_wait(USE_PDL)
    x_row = x_ptr + rows * DIM
    rstd = _rstd(x_row, rmask, DIM, eps, BLOCK_M, BLOCK_K)
    acc_g, acc_u = _norm_dot2(x_row, rmask, rstd, norm_w, dt, gate_rows, wg, up_rows, wu, nmask, DIM, BLOCK_M, BLOCK_K)
    if HAS_BIAS:
        acc_g += bg[None, :]
        acc_u += bu[None, :]
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    mask = rmask[:, None] & nmask[None, :]
    tl.store(out_ptr + rows[:, None] * INTER + n[None, :], (act * up).to(dt), mask=mask)


@triton.jit(do_not_specialize=["B"])
def norm_head_kernel(
    x_ptr,
    norm_w,
    w_ptr,
    logits_ptr,
    pmax_ptr,
    pidx_ptr,
    B,
    eps,
    V,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Final RMSNorm + the output head for a block of the vocabulary: logits [B, V] in fp32 (rounded to the model's
    dtype first, as the eager head's output is), and the block's max and its first index per row [B, V/BLOCK_N]."""
    _pdl_start(USE_PDL)
    pid = tl.program_id(0)
    n, nmask, rows, rmask = _gemv_block(B, V, BLOCK_M, BLOCK_N)
    dt = x_ptr.dtype.element_ty
    _pdl_wait(USE_PDL)
    x_row = x_ptr + rows * DIM
    rstd = _rstd(x_row, rmask, DIM, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, DIM, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        kmask = offs < DIM
        h = _normed(x_row, rmask, offs, kmask, rstd, norm_w, dt)
        w = tl.load(w_ptr + n[:, None] * DIM + offs[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += _dot_rows(h, w)
    logits = acc.to(dt).to(tl.float32)
    mask = rmask[:, None] & nmask[None, :]
    tl.store(logits_ptr + rows[:, None] * V + n[None, :], logits, mask=mask)
    logits = tl.where(nmask[None, :], logits, float("-inf"))
    best = tl.max(logits, axis=1)
    first = tl.min(tl.where(logits == best[:, None], n[None, :], V), axis=1)
    nblocks = tl.num_programs(0)
    tl.store(pmax_ptr + rows * nblocks + pid, best, mask=rmask)
    tl.store(pidx_ptr + rows * nblocks + pid, first, mask=rmask)


@triton.jit(do_not_specialize=["B"])
def greedy_accept_kernel(
    pmax_ptr,
    pidx_ptr,
    eos_ptr,
    done_ptr,
    out_ptr,
    tok_ptr,
    counter_ptr,
    pos_ptr,
    B,
    NBLOCKS,
    out_stride,
    N_EOS,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The greedy token of every row from the head's block maxima (the first index of the largest logit, as
    torch.argmax picks), then the runner's bookkeeping in the same program: rows already done emit their EOS,
    done |= token is an EOS, out[:, counter] = token, the next input = token, counter += 1, pos += 1."""
    _pdl_start(USE_PDL)
    rows = tl.arange(0, BLOCK_B)
    rmask = rows < B
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ptr + e, mask=e < N_EOS, other=-1)
    eos0 = tl.load(eos_ptr)
    _pdl_wait(USE_PDL)
    best = tl.full([BLOCK_B], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_B], tl.int32)
    for p0 in range(0, NBLOCKS, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = rmask[:, None] & (p < NBLOCKS)[None, :]
        vals = tl.load(pmax_ptr + rows[:, None] * NBLOCKS + p[None, :], mask=mask, other=float("-inf"))
        idx = tl.load(pidx_ptr + rows[:, None] * NBLOCKS + p[None, :], mask=mask, other=0)
        m = tl.max(vals, axis=1)
        at = tl.min(tl.where(vals == m[:, None], idx, 2147483647), axis=1)
        better = m > best  # strictly: an equal maximum in a later block keeps the earlier index
        best_i = tl.where(better, at, best_i)
        best = tl.where(better, m, best)
    done = tl.load(done_ptr + rows, mask=rmask, other=0) != 0
    tok = tl.where(done, eos0, best_i.to(tl.int64))
    hit = tl.sum((tok[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0
    counter = tl.load(counter_ptr)
    pos = tl.load(pos_ptr)
    tl.store(done_ptr + rows, (done | hit).to(done_ptr.dtype.element_ty), mask=rmask)
    tl.store(out_ptr + rows * out_stride + counter, tok, mask=rmask)
    tl.store(tok_ptr + rows, tok, mask=rmask)
    tl.debug_barrier()  # every thread has read counter and pos before either moves on
    tl.store(counter_ptr, counter + 1)
    tl.store(pos_ptr, pos + 1)
