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
