"""De-quantising GGUF tensors with vectorised torch, on whichever device the raw bytes are on.

Each block layout follows the `gguf` package's quants.py (and llama.cpp's ggml-common.h). The arithmetic is
fp32 in the same order as quants.py does it, so the result is bit-exact with `gguf.quants.dequantize`; a cast
to the target dtype comes last. Large tensors go through in row chunks written into the output, so the
temporaries stay a fixed size however big the tensor is. Into fp32, the commonest types are computed straight
into the output (no fp32 temporary, no copy): half the time of the default model's load.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

QK_K = 256
CHUNK_ELEMENTS = 1 << 22  # values de-quantised per step: ~16 MB of fp32 temporaries

# ggml type name -> (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start + 2) of each block, as fp32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] packed bytes -> [n, 2m]: the m low nibbles, then the m high ones (ggml's order in a block),
    written into one buffer (no concatenation)."""
    n, m = qs.shape
    out = torch.empty(n, 2, m, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out[:, 0])
    torch.bitwise_right_shift(qs, 4, out=out[:, 1])
    return out.view(n, 2 * m)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 8m] single bits, bit i of byte j at 8j + i (a little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


# The kernels below work in place on their one fp32 buffer where that keeps quants.py's operations and order
# (IEEE products are commutative, and q - 8 is exact in fp32), which made them ~3x faster.


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_half(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).float().sub_(8).mul_(_half(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).float().mul_(_half(b, 0)).add_(_half(b, 2))


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    return _nibbles(b[:, qh_at + 4 :]) | (_bits(b[:, qh_at : qh_at + 4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b, 2).to(torch.int8) - 16
    return _half(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return (_half(b, 0) * _q5(b, 4).float()) + _half(b, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K, Q5_K)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_sub_blocks(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: q [n, 8, 32] of one super-block, scaled per sub-block of 32 and offset by its min."""
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_half(b, 0) * sc.float()).view(n, 8, 1)
    dm = (_half(b, 2) * mn.float()).view(n, 8, 1)
    return (d * q.float() - dm).view(n, QK_K)


def _q4_k_low(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: four groups of 32 bytes, each giving its low nibbles then its high ones."""
    n = qs.shape[0]
    g = qs.view(n, 4, 1, 32)
    return torch.cat([g & 0x0F, g >> 4], dim=2).view(n, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_sub_blocks(b, _q4_k_low(b[:, 16:]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # sub-block i takes bit i of each of the 32 bytes
    return _k_sub_blocks(b, _q4_k_low(b[:, 48:]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(b, 208) * scales).view(n, 16, 1)
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).view(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).view(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.view(n, 16, 16).float()).view(n, QK_K)


# The same arithmetic written into an fp32 output [blocks, 32]: the integers are copied in (an exact conversion;
# a mixed-dtype multiply takes torch's slow casting loop, 4x slower), then scaled in place, so the results are
# the bits of the kernels above.


def _q8_0_into(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:].view(torch.int8)).mul_(_half(b, 0))


def _q4_0_into(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(b[:, 2:])).sub_(8).mul_(_half(b, 0))


def _q4_1_into(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(b[:, 4:])).mul_(_half(b, 0)).add_(_half(b, 2))


_INTO_FP32: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "Q8_0": _q8_0_into,
    "Q4_0": _q4_0_into,
    "Q4_1": _q4_1_into,
}

_KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def supported(type_name: str) -> bool:
    """Whether a tensor of this ggml type is de-quantised here: by this module's kernels, or, for the types
    they do not cover (Q2_K, Q3_K, the IQ and TQ types, MXFP4, ...), by the `gguf` package's numpy code one
    chunk of rows at a time, into the asked dtype like the others (rarer types: correct before fast)."""
    return type_name in BLOCKS or _package_type(type_name) is not None


_PACKAGE_TYPES: dict[str, Any] = {}


def _package_type(type_name: str) -> Any:
    """The `gguf` package's GGMLQuantizationType for `type_name` where the package de-quantises it, else None."""
    if type_name not in _PACKAGE_TYPES:
        import gguf
        import numpy as np

        found = None
        q = getattr(gguf.GGMLQuantizationType, type_name, None)
        if q is not None and q in gguf.GGML_QUANT_SIZES:
            try:
                gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[q][1]), np.uint8), q)
                found = q
            except (NotImplementedError, ValueError, TypeError):  # a type the package only names
                pass
        _PACKAGE_TYPES[type_name] = found
    return _PACKAGE_TYPES[type_name]


def _package_kernel(q: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def kernel(blocks: torch.Tensor) -> torch.Tensor:
        import gguf

        values = gguf.quants.dequantize(blocks.cpu().numpy(), q)  # fp32, as this module's own kernels give
        return torch.from_numpy(values).to(blocks.device)

    return kernel


def dequantize(
    raw: torch.Tensor,
    type_name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The tensor of `shape` (torch order) stored as `raw` (uint8, the ggml bytes, any device) in `dtype`,
    written into `out` when given (contiguous, of that shape and dtype, on raw's device; e.g. a slice of a
    fused matrix).

    A result that would alias `raw` (the same stored type and dtype) is a copy, so it never holds the buffer the
    bytes were read into (engine.gguf_native reads each tensor's into one of its own)."""
    package = None if type_name in BLOCKS else _package_type(type_name)
    if package is not None:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[package]
    elif type_name in BLOCKS:
        block, size = BLOCKS[type_name]
    else:
        raise ValueError(f"no de-quantisation for ggml type {type_name}")
    cols = shape[-1] if shape else 1
    rows = raw.numel() // size * block // cols
    if cols % block or rows * cols // block * size != raw.numel():
        raise ValueError(f"{raw.numel()} bytes of {type_name} do not hold a tensor of shape {list(shape)}")
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype, device=raw.device)
    elif out.dtype != dtype or out.numel() != rows * cols or not out.is_contiguous():
        raise ValueError(f"the output for a {list(shape)} tensor must be a contiguous {dtype} of that size")
    out = out.view(rows, cols)
    raw = raw.reshape(rows, cols // block * size)
    if type_name in _PLAIN:
        out.copy_(raw.view(_PLAIN[type_name]))
        return out.view(shape)
    into = _INTO_FP32.get(type_name) if dtype == torch.float32 else None
    kernel = _KERNELS[type_name] if package is None else _package_kernel(package)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        part = raw[r : r + step]
        if into is not None:
            into(part.reshape(-1, size), out[r : r + step].view(-1, block))
        else:
            out[r : r + step] = kernel(part.reshape(-1, size)).view(part.shape[0], cols)
    return out.view(shape)
