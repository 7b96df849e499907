"""How far the project's CPU int8 GEMV (engine/cpu_kernels.c) may be from the exact product, element by element."""

from __future__ import annotations

import torch

QBLOCK = 64  # engine/cpu_kernels.c: activations share one int16 scale per block of this many inputs


def int8_kernel_tolerance(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[m, n] bound on |kernel(x, q, scales) - x @ (q * scales).T|: each activation is rounded to int16 on its
    block's scale (max |x| of the block / 32767), so it moves by at most half of that; a block's products are summed
    exactly, the blocks and the fp32 tail in fp32 (a few units of rounding of the sum of magnitudes)."""
    x = x.reshape(-1, q.shape[1])
    nb = q.shape[1] // QBLOCK
    bound = 8 * 2**-24 * (x.abs().double() @ q.abs().double().T) + 1e-7
    if nb:
        half_step = x[:, : nb * QBLOCK].abs().double().view(-1, nb, QBLOCK).amax(-1) / 32767 / 2  # [m, nb]
        weight_mass = q[:, : nb * QBLOCK].abs().double().view(-1, nb, QBLOCK).sum(-1)  # [n, nb]
        bound = bound + half_step @ weight_mass.T
    return bound * scales.double()


def within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> bool:
    return bool(((got.double().reshape(tol.shape) - want.double().reshape(tol.shape)).abs() <= tol).all())


def int4_kernel_tolerance(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """[m, n] bound on |kernel - x @ W.T| for the int4 kernel, W = q * scale + min group by group (32 inputs a
    group, engine.quant.quantize_int4_min), which it sums as (q - 8) * scale + zero, zero = min + 8 * scale: the
    activations rounded to int16 as for int8 (they meet only the (q - 8) * scale part: the zeros multiply each
    group's fp32 sum of x), and fp32 rounding of the sums of the magnitudes of every term, the -8 and the zero taken
    out of the integer sums included."""
    x = x.reshape(-1, q.shape[1]).double()
    n, k = q.shape
    group = k // scales.shape[1]
    s = scales.double().repeat_interleave(group, dim=1)
    zeros = mins.double().repeat_interleave(group, dim=1) + 8 * s
    scaled = (q.double() - 8).abs() * s  # [n, k]
    mass = scaled + zeros.abs() + 16 * s  # q * s and the -8 * s apart
    bound = 16 * 2**-24 * (x.abs() @ mass.T) + 1e-7
    nb = k // QBLOCK
    if nb:
        half_step = x[:, : nb * QBLOCK].abs().view(-1, nb, QBLOCK).amax(-1) / 32767 / 2  # [m, nb]
        bound = bound + half_step @ scaled[:, : nb * QBLOCK].view(n, nb, QBLOCK).sum(-1).T
    return bound
