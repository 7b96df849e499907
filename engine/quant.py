"""Weight-only quantised linears: int8 with one scale per output channel, int4 with a scale and an offset per group
of INT4_GROUP inputs (the output head in int8: HEAD_FORMAT). The activations stay in floating point; the matmul
reads the quantised weights. The own CPU int4 kernel takes GGUF Q4_1's form (w = q * scale + min, both fp16:
quantize_int4_min); torch's kernels and the CUDA path take tinygemm's ((q - 8) * scale + zero: quantize_int4).

CPU: the project's own int8 and int4 GEMVs (engine/cpu_kernels.c: activations rounded to int16 in blocks of 64,
exact integer products, the weights streamed as stored; a prefill chunk of more than cpu_kernels.GEMM_ROWS rows is
torch's fp32 GEMM on the weights de-quantised a tile at a time), or where they cannot be built torch's packed
`aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` fed bf16 activations (with fp32 ones the int8
one was 8x slower, measured on this project's CPU).
CUDA: gpt-fast's form, the weight de-quantised inside the linear (`F.linear(x, w_int8.to(x.dtype)) * scales`),
which inductor fuses into the GEMV under compile; written from that construction, not yet run on a GPU here.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Optional, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import cpu_kernels

WEIGHT_BITS = {"int8": 8, "int4": 4}
INT4_GROUP = 32
# The output head's format under each weights option: int4 keeps the head (and a tied embedding, which reads its
# table) in int8. In int4 the default model's head (21 % of its weights; the file stores it as Q8_0) cost 2.1 in
# perplexity and 14 points of top-1 agreement with fp32, where its Q4_1 layers in int4 cost nothing measurable; int8
# there costs 7 % more bytes (docs/benchmarks.md). llama.cpp's 4-bit files keep the head in 6-8 bits too.
HEAD_FORMAT = {"int8": "int8", "int4": "int8"}
HEAD = "output"  # the head's module name in engine.model.Transformer
INT4_INNER_K_TILES = 2  # the CPU int4 packing's tile parameter (2, 4 or 8; results are identical)
# torch's packed int4 CPU layout takes outputs in multiples of this ("expect N to be dividable by 16")
TORCH_INT4_ROWS = 16
# torch's packed int8 CPU kernel sums inputs in steps of this many and checks nothing: with other counts it read
# past the rows (wrong sums, NaN or a crash, torch 2.13)
TORCH_INT8_INPUTS = 16
# Linears whose CPU output may stay in the kernel's bf16: what reads it (the residual add, the head's .float())
# promotes it to fp32 exactly as a cast would, so the cast back is one op a linear saved.
KEEP_KERNEL_DTYPE = ("attention.wo", "feed_forward.w2", "output")


# Weights are quantised this many fp32 values at a time (16 MiB): whole, a 262,144 x 640 head (Gemma-3's, 640 MiB in
# fp32) took 1.3-2.2 GiB more at once in temporaries, beside the model still held in full during a load.
QUANT_CHUNK_FLOATS = 1 << 22


def _by_rows(
    quantize: Callable[..., tuple[torch.Tensor, ...]], w: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, ...]:
    """quantize(w, *args), row block by row block into outputs made once: every quantisation here is row by row,
    so the result is the same bit for bit, and the temporaries are a block's."""
    n, k = w.shape
    rows = max(1, QUANT_CHUNK_FLOATS // max(k, 1))
    first = quantize(w[:rows], *args)
    if n <= rows:
        return first
    outs = tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in first)
    for start in range(0, n, rows):
        block = first if start == 0 else quantize(w[start : start + rows], *args)
        for out, part in zip(outs, block):
            out[start : start + rows] = part
    return outs


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scales [N] fp32) with w ~ q * scales[:, None]."""
    q, scales = _by_rows(_quantize_int8, w)
    return q, scales


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 in the tinygemm convention: (q [N, K] in 0..15 as uint8, scales [N, K/group],
    zeros [N, K/group]) with w ~ (q - 8) * scale + zero, zero being the value that q = 8 stands for."""
    q, scales, zeros = _by_rows(_quantize_int4, w, group)
    return q, scales, zeros


def _quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = lo + scales * 8
    q = torch.round((g - lo) / scales).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, scales.squeeze(-1), zeros.squeeze(-1)


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int = INT4_GROUP
) -> torch.Tensor:
    n, k = q.shape
    g = q.reshape(n, k // group, group).float() - 8
    return (g * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(n, k)


# the smallest positive fp16 (a subnormal): a group whose inputs are all equal keeps a scale that is not zero
_FP16_TINY = 2.0**-24


# GGUF types whose groups int4 holds exactly only when tried on the file's own grid (quantize_int4_min's `grid`;
# Q4_1's groups span 0..15 and come back exactly without it)
INT4_GRID_TYPES = frozenset({"Q4_0"})


def quantize_int4_min(
    w: torch.Tensor, group: int = INT4_GROUP, grid: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 in GGUF Q4_1's form, as the own CPU kernel reads it: (q [N, K] in 0..15 as uint8,
    scales [N, K/group] fp16, mins [N, K/group] fp16) with w ~ q * scale + min. 5 bits a weight where fp32 pairs
    took 6. A group's minimum and scale are rounded to fp16 before its q are chosen, so the q fit the stored pair.
    The scale is the group's range over 15, so a Q4_1 group that spans 0..15 comes back exactly (its d and m are
    the scale and the minimum).

    `grid` (weights de-quantised from GGUF Q4_0 blocks: INT4_GRID_TYPES): a group is also tried on Q4_0's grid
    (_q4_0_grid) and held on it where that gives it back exactly: most Q4_0 groups do not span 0..15 (their
    largest magnitude alone fixes the step), so the range over 15 would put them on another grid. Raises
    ValueError where a weight is not finite or beyond fp16's range (|w| above 65,504)."""
    q, scales, mins = _by_rows(_quantize_int4_min, w, group, grid)
    return q, scales, mins


def _quantize_int4_min(w: torch.Tensor, group: int, grid: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if not torch.isfinite(g).all():
        raise ValueError("int4 cannot hold these weights: they contain an inf or a NaN")
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    mins = lo.to(torch.float16)
    scales = ((hi - mins.float()) / 15).clamp(min=_FP16_TINY).to(torch.float16)
    if not (torch.isfinite(mins).all() and torch.isfinite(scales).all()):
        largest = float(w.abs().amax())
        raise ValueError(
            f"int4 keeps each group's scale and minimum in fp16; these weights reach {largest:g}, beyond fp16's range"
        )
    if not grid:
        return _fit_int4(g, scales, mins).to(torch.uint8).reshape(n, k), scales.squeeze(-1), mins.squeeze(-1)
    # Q4_0's grid where a group may lie on it, one fit for all groups; the range over 15 again where it is not exact
    on_grid, step, offset = _q4_0_grid(lo, hi, scales)
    held_scales, held_mins = torch.where(on_grid, step, scales), torch.where(on_grid, offset, mins)
    q = _fit_int4(g, held_scales, held_mins)
    if bool(on_grid.any()):
        missed = on_grid & (_int4_error(g, q, held_scales, held_mins) != 0)
        if bool(missed.any()):
            held_scales, held_mins = torch.where(missed, scales, held_scales), torch.where(missed, mins, held_mins)
            rows = missed.view(-1).nonzero().squeeze(1)
            again = (t.view(-1, t.shape[-1])[rows] for t in (g, scales, mins))
            q.view(-1, group)[rows] = _fit_int4(*again)
    return q.to(torch.uint8).reshape(n, k), held_scales.squeeze(-1), held_mins.squeeze(-1)


def _q4_0_grid(
    lo: torch.Tensor, hi: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4_min's `grid`: Q4_0's grid for each group (lo, hi and the range-over-15 scales [.., 1]):
    (q - 8) * d, whose largest magnitude is 8 |d| (at the bottom for a positive d, at the top for a negative one),
    so that end as the offset and |d| as the step (down from the top: a negative scale), both fp16. Returns
    (where a group may lie on it: its range a whole number of such steps, at most 15, and no finer than the range
    over 15; the steps; the offsets)."""
    at_bottom = lo.abs() >= hi.abs()
    eighth = torch.maximum(lo.abs(), hi.abs()) / 8
    step = torch.where(at_bottom, eighth, -eighth).to(torch.float16)
    offset = torch.where(at_bottom, lo, hi).to(torch.float16)
    levels = (hi - lo) / step.float().abs()
    whole = ((levels - levels.round()).abs() <= 1e-3) & (levels <= 15 + 1e-3)
    return whole & (step != 0) & (step.float().abs() >= scales.float()), step, offset


def _fit_int4(g: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Each grouped value's q in 0..15 under its group's fp16 scale and minimum (one a group, broadcast along the
    last dimension), as fp32."""
    return torch.round((g - mins.float()) / scales.float()).clamp_(0, 15)


def _int4_error(g: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Each group's largest |value - what the kernel multiplies| (the last dimension reduced, kept)."""
    return (_int4_values(q, scales, mins) - g).abs().amax(dim=-1, keepdim=True)


def _int4_values(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Grouped q (any integer dtype or fp32; groups along the last dimension) in fp32 as the own CPU kernel
    computes them, each group's scale and minimum broadcast along it: (q - 8) * scale + zero with zero = min +
    8 * scale (both products exact in fp32; the zero exact unless min and 8 * scale are over 2^13 apart in
    magnitude), so a value is q * scale + min rounded once."""
    s = scales.float()
    return (q.float() - 8) * s + (mins.float() + 8 * s)


def dequantize_int4_min(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int = INT4_GROUP
) -> torch.Tensor:
    """q [N, K] with scales and mins [N, K/group] in fp32: the values the own CPU kernel multiplies (_int4_values)."""
    n, k = q.shape
    return _int4_values(q.reshape(n, k // group, group), scales.unsqueeze(-1), mins.unsqueeze(-1)).reshape(n, k)


def _kernel_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bias the own kernel adds itself (fp32), or None and the caller adds it."""
    return bias if bias is not None and bias.dtype == torch.float32 else None


class _QuantLinear(nn.Module, metaclass=abc.ABCMeta):
    keep_kernel_dtype = False  # set on the linears of KEEP_KERNEL_DTYPE by quantize_linears
    weight: torch.Tensor
    scales: torch.Tensor
    bias: Optional[torch.Tensor]
    in_features: int
    out_features: int
    own_kernel: bool
    _bound: Optional["cpu_kernels.BoundLinear"] = None  # the own kernel's call, checked once

    def cpu_bound(self) -> "cpu_kernels.BoundLinear":
        """The own kernel's call for these weights (and an fp32 bias), bound once and again if they change."""
        bias, mins = _kernel_bias(self.bias), self._buffers.get("mins")
        bound = self._bound
        if bound is None or not bound.holds(self.weight, self.scales, bias, mins):
            kernels = cpu_kernels.loaded()
            assert kernels is not None, "own_kernel is set only where the library loaded"
            bound = self._bound = kernels.bind(self.weight, self.scales, bias, mins)
        return bound

    @abc.abstractmethod
    def _traced(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The own kernel as an opaque custom op, where torch.compile traces."""

    @abc.abstractmethod
    def _torch(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """torch's kernel on the CPU, the weight de-quantised inside the linear on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        bias = self.bias
        if self.own_kernel:
            y, bias = self._own_kernel(x, x2)
        else:
            y = self._torch(x, x2)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.view(*shape[:-1], self.out_features)

    def _own_kernel(self, x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(y in x's dtype, the bias still to add) from the own CPU kernel on x2's rows in fp32, with no no-op
        casts: on the CPU every call is an op the step dispatches."""
        xf = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
        if torch.compiler.is_compiling():
            y = self._traced(xf, _kernel_bias(self.bias))
        else:
            y = self.cpu_bound().run(xf)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y, None if _kernel_bias(self.bias) is not None else self.bias

    def _out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The CPU kernel's bf16 output in the activations' dtype, or as it is where its reader promotes it."""
        return y if self.keep_kernel_dtype and x.dtype == torch.float32 else y.to(x.dtype)


class Int8Linear(_QuantLinear):
    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], act_dtype: torch.dtype):
        super().__init__()
        q, scales = quantize_int8(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.on_cpu = weight.device.type == "cpu"
        self.own_kernel = self.on_cpu and cpu_kernels.kernel() is not None
        self.register_buffer("weight", q)
        # the own CPU kernel takes fp32 scales, torch's packed one bf16; on CUDA they multiply the activations' dtype
        scales_dtype = torch.float32 if self.own_kernel else torch.bfloat16 if self.on_cpu else act_dtype
        self.register_buffer("scales", scales.to(scales_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The weight's rows `idx` de-quantised to `dtype`: [len(idx), in_features]."""
        return self.weight[idx].to(dtype) * self.scales[idx].to(dtype).unsqueeze(-1)

    def _traced(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return cpu_kernels.int8_linear(x, self.weight, self.scales, bias)

    def _torch(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return self._out(torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self.scales), x)
        return F.linear(x2, self.weight.to(x.dtype)) * self.scales


class Int4Linear(_QuantLinear):
    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor  # tinygemm's form (CUDA)
    mins: torch.Tensor  # Q4_1's form (the own CPU kernel)
    scales_zeros: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        act_dtype: torch.dtype,
        group: int = INT4_GROUP,
        grid: bool = False,
    ):
        """`grid`: the weights were de-quantised from 4-bit GGUF blocks (quantize_int4_min); the own CPU kernel's
        layout then holds them as the file has them."""
        super().__init__()
        self.in_features, self.out_features, self.group = weight.shape[1], weight.shape[0], group
        self.on_cpu = weight.device.type == "cpu"
        self.own_kernel = self.on_cpu and group == cpu_kernels.INT4_GROUP and cpu_kernels.kernel() is not None
        if self.own_kernel:  # the own kernel's layout: each group's 32 inputs in 16 bytes, fp16 scales and minimums
            q, scales, mins = quantize_int4_min(weight, group, grid)
            self.register_buffer("weight", cpu_kernels.pack_int4(q))
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("mins", mins.contiguous())
            self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
            return
        q, scales, zeros = quantize_int4(weight, group)
        if self.on_cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INT4_INNER_K_TILES)
            self.register_buffer("weight", packed)
            # [K/group, N, 2]: the kernel's layout of the scales and zeros
            self.register_buffer(
                "scales_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            )
        else:
            self.register_buffer("weight", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())  # two inputs per byte
            self.register_buffer("scales", scales.to(act_dtype))
            self.register_buffer("zeros", zeros.to(act_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The weight's rows `idx` de-quantised to `dtype` ([len(idx), in_features]), or None in torch's packed CPU
        layout, which only its kernel reads."""
        if self.on_cpu and not self.own_kernel:
            return None
        b = self.weight[idx]
        n, groups = b.shape[0], self.in_features // self.group
        if self.own_kernel:  # a group's 16 bytes: its inputs 0..15 in the low nibbles, 16..31 in the high ones
            b = b.view(n, groups, self.group // 2)
            q = torch.cat([b & 0x0F, b >> 4], dim=-1)
            # in fp32 as the kernel de-quantises, then in the asked dtype
            w = _int4_values(q, self.scales[idx].unsqueeze(-1), self.mins[idx].unsqueeze(-1))
            return w.view(n, self.in_features).to(dtype)
        # two neighbouring inputs a byte, the first in the low nibble
        q = torch.stack([b & 0x0F, b >> 4], dim=-1).view(n, groups, self.group)
        w = (q.to(dtype) - 8) * self.scales[idx].to(dtype).unsqueeze(-1) + self.zeros[idx].to(dtype).unsqueeze(-1)
        return w.view(n, self.in_features)

    def _traced(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return cpu_kernels.int4_linear(x, self.weight, self.scales, self.mins, bias)

    def _torch(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            return self._out(mm(x2.to(torch.bfloat16), self.weight, self.group, self.scales_zeros), x)
        q = torch.stack([self.weight & 0x0F, self.weight >> 4], dim=-1).view(self.out_features, -1)
        n_groups = self.in_features // self.group
        w = (q.view(self.out_features, n_groups, self.group).to(x.dtype) - 8) * self.scales.unsqueeze(-1)
        w = (w + self.zeros.unsqueeze(-1)).view(self.out_features, self.in_features)
        return F.linear(x2, w)


QUANTISED_LINEARS = (Int8Linear, Int4Linear)
_LINEAR_CLASS: dict[str, type[Int8Linear] | type[Int4Linear]] = {"int8": Int8Linear, "int4": Int4Linear}


class QuantEmbedding(nn.Module):
    """An input embedding whose table is a quantised linear's weight, its looked-up rows de-quantised: the tied
    head's own (nothing held twice: the fp32 table of a 262,144-token vocabulary is 671 MB beside an int8 head's
    168), or, for an untied model, the table quantised as a linear of its own (`table`, vocab x dim)."""

    def __init__(self, source: "Int8Linear | Int4Linear", dtype: torch.dtype, tied: bool):
        super().__init__()
        self.dtype, self.tied = dtype, tied
        if tied:
            self._head = [source]  # not a submodule: the head owns (and moves) its buffers, the table reads them
        else:
            self.table = source

    @property
    def source(self) -> "Int8Linear | Int4Linear":
        return self._head[0] if self.tied else self.table

    @property
    def weight(self) -> torch.Tensor:
        """The quantised table (the head's weight where tied, so bytes_per_token sees the sharing)."""
        return self.source.weight

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.source.buffers(recurse=False))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rows = self.source.rows(idx, self.dtype)
        assert rows is not None, "built only over a layout whose rows de-quantise"
        return rows


def quantize_embedding(model: nn.Module, fmt: str, act_dtype: torch.dtype, grid: bool = False) -> bool:
    """Replace the model's input embedding (`tok_embeddings`) by a QuantEmbedding: over the head where the head
    was tied to it (quantize_linears has made the head from the same table), else over the table quantised on its
    own. False, and the embedding kept, where the format's layout here does not de-quantise rows (torch's packed
    int4 on the CPU) or the model has no such embedding."""
    emb = getattr(model, "tok_embeddings", None)
    args = getattr(model, "args", None)
    if not isinstance(emb, nn.Embedding) or args is None:
        return False
    probe = torch.zeros(1, dtype=torch.long, device=emb.weight.device)
    if args.tie_embeddings and isinstance(getattr(model, "output", None), QUANTISED_LINEARS):
        head = cast("Int8Linear | Int4Linear", model.output)
        if head.rows(probe, act_dtype) is None:
            return False
        model.tok_embeddings = QuantEmbedding(head, act_dtype, tied=True)
        return True
    if _LINEAR_CLASS[fmt] is Int4Linear and _torch_packs_int4(emb.weight.device):
        return False  # only torch's kernel reads that layout, and a table need not have outputs in its multiples
    try:
        table = _quantised(fmt, emb.weight.detach(), None, act_dtype, grid)
    except ValueError as exc:
        raise ValueError(f"tok_embeddings: {exc}") from None
    if table.rows(probe, act_dtype) is None:
        return False
    model.tok_embeddings = QuantEmbedding(table, act_dtype, tied=False)
    return True


def why_not(fmt: str, shapes: dict[str, tuple[int, int]], device: torch.device) -> Optional[str]:
    """Why `fmt` cannot quantise linears of these (out, in) shapes on `device`, or None when it can."""
    if fmt == "native":
        return None
    packed = _torch_packs_int4(device)  # the own kernels absent: torch's packed kernels run
    if packed:
        for f in dict.fromkeys((fmt, HEAD_FORMAT[fmt])):  # the layers' format, then the head's
            op = cpu_kernels.TORCH_CPU_OPS[f]
            if not has_op(op):
                return f"this torch has no aten.{op} for the CPU"
    for name, (out, inp) in shapes.items():
        held = HEAD_FORMAT[fmt] if name == HEAD else fmt
        if held == "int8" and packed and inp % TORCH_INT8_INPUTS:
            return (
                f"torch's packed int8 CPU kernel (the own kernels are not built here) needs inputs in multiples "
                f"of {TORCH_INT8_INPUTS}; {name} is {out}x{inp}"
            )
        if held == "int4" and inp % INT4_GROUP:
            return f"int4 needs inputs in groups of {INT4_GROUP}; {name} is {out}x{inp}"
        if held == "int4" and packed and out % TORCH_INT4_ROWS:
            return (
                f"torch's packed int4 CPU kernel (the own kernels are not built here) needs outputs in "
                f"multiples of {TORCH_INT4_ROWS}; {name} is {out}x{inp}"
            )
    return None


def _torch_packs_int4(device: torch.device) -> bool:
    """Whether int4 linears on `device` are torch's packed CPU layout (the own kernels absent): its kernel alone
    reads them, so their rows cannot be de-quantised for an embedding, and it takes outputs in TORCH_INT4_ROWS."""
    return device.type == "cpu" and cpu_kernels.kernel() is None


def kernel_name(fmt: str, device: torch.device) -> str:
    """What computes a linear of weight format `fmt` on `device` ("" for native weights)."""
    if fmt == "native":
        return ""
    head = "" if HEAD_FORMAT[fmt] == fmt else f"; the output head in {HEAD_FORMAT[fmt]}"
    if device.type == "cpu":
        return cpu_kernels.describe(fmt) + head
    return "de-quantised inside the linear (F.linear on the weights cast to the activations' dtype)" + head


def has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_linears(model: nn.Module, fmt: str, act_dtype: torch.dtype, grid: bool = False) -> int:
    """Replace every nn.Linear of `model` by its `fmt` form (the head by its HEAD_FORMAT), in place, and the input
    embedding by one that reads a quantised table (quantize_embedding: the tied head's); the float weights are
    freed as each is replaced. `grid`: the weights came from 4-bit GGUF blocks (quantize_int4_min). Returns how many
    linears; a ValueError names the linear whose weights the format cannot hold."""
    done = 0
    # by name, not a list of the modules: a list held every float linear until the last was replaced (the whole
    # float model beside its quantised one at the load's peak)
    for name in [n for n, _ in _linears(model)]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = parent.get_submodule(child)
        assert isinstance(lin, nn.Linear)
        try:
            q = _quantised(HEAD_FORMAT[fmt] if name == HEAD else fmt, lin.weight.detach(), lin.bias, act_dtype, grid)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        del lin
        q.keep_kernel_dtype = name.endswith(KEEP_KERNEL_DTYPE) and not _rounds_its_input(model, name)
        setattr(parent, child, q)
        done += 1
    quantize_embedding(model, fmt, act_dtype, grid)
    return done


def _quantised(
    fmt: str, weight: torch.Tensor, bias: Optional[torch.Tensor], act_dtype: torch.dtype, grid: bool
) -> "Int8Linear | Int4Linear":
    if fmt == "int4":
        return Int4Linear(weight, bias, act_dtype, grid=grid)
    return Int8Linear(weight, bias, act_dtype)


def _rounds_its_input(model: nn.Module, name: str) -> bool:
    """Whether what reads this linear's output would round a bf16 output differently from the cast fp32 one:
    Gemma's norms after the attention and the MLP give back their input's dtype, and a logit soft cap computes
    in it."""
    args = getattr(model, "args", None)
    if args is None or not getattr(args, "gemma", False):
        return False
    return not name.endswith("output") or args.final_softcap is not None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights the model holds: parameters and the quantised linears' buffers."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, QUANTISED_LINEARS):
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    return total


def bytes_per_token(model: nn.Module, embedding: nn.Module, head: nn.Module) -> int:
    """Weight bytes one decode token reads: everything held, except that an embedding the head does not share
    is read one row per token. `embedding` is the input embedding (an nn.Embedding, or transformers' own)."""
    total = weight_bytes(model)
    w = embedding.weight
    assert isinstance(w, torch.Tensor), "an input embedding holds its table as `weight`"
    if getattr(head, "weight", None) is not w:
        held = embedding.held_bytes() if isinstance(embedding, QuantEmbedding) else w.numel() * w.element_size()
        total -= held - held // w.shape[0]  # all but one row (and its scales)
    return total
