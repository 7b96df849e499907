"""The engine's own CPU kernels (engine/cpu_kernels.c: the int8 GEMV, RMSNorm, RoPE, SiLU·mul and a whole decoder
layer for the eager step), built on first use with the machine's C compiler, cached in the user cache dir under a
key of the source, the compiler, its flags and the CPU (with its digest beside it: a library that no longer matches
it is built again), and loaded with ctypes.

torch's packed kernel (`aten._weight_int8pack_mm`) streamed the default model's 129 MiB of int8 weights at about
13 GB/s where one thread reads fp32 at 34 (docs/benchmarks.md), so a token took 10 of its 14 ms in it. The GEMV
here rounds each activation row to int16 in blocks of 64 (one fp32 scale a block) and sums a block's products
exactly in int32, a third of the instructions per weight of widening every weight to fp32. The small kernels are
one call each where torch dispatches three to six ops (the eager CPU step is bound by its op count as much as by
its matmuls), and the layer kernel runs a decoder layer (norms, projections, RoPE, the cache writes, the
grouped-query attention, the residual adds; Qwen3's q/k norms and Gemma-3's norms, GELU and sliding windows where a
layer has them) in one call; GAPLESS_CPU_LAYER=0 runs it op by op, to compare. A prefill chunk of more than
GEMM_ROWS rows is a GEMM, run by torch on the weights de-quantised to fp32 a tile at a time. Where
the library cannot be built (no compiler, a failed build, not allowed by GAPLESS_CPU_KERNELS=0),
`unavailable_reason()` says why and torch's ops run.

The OpenMP runtime the library needs is the one torch has already loaded (the same soname, libgomp.so.1, on Linux),
so its threads are torch's and `torch.set_num_threads` sizes them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
SWITCH_ENV = "GAPLESS_CPU_KERNELS"  # "0": torch's kernels instead, to compare
# Tried in order; the first set the compiler accepts is kept. Without -fopenmp the loop runs on one thread.
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)
_COMMON_FLAGS = ("-shared", "-fPIC", "-std=c99")
BUILD_TIMEOUT_S = 120
# what a profile shows for a call (engine/telemetry/window.py counts them as ops)
OP_NAME = "gapless::kernel::int8_linear"
INT4_OP_NAME = "gapless::kernel::int4_linear"
F32_OP_NAME = "gapless::kernel::f32_linear"
INT4_GROUP = 32  # inputs sharing a scale and a minimum (both fp16) in the int4 layout
NORM_OP_NAME = "gapless::kernel::rms_norm"
SILU_OP_NAME = "gapless::kernel::silu_mul"
ROPE_OP_NAME = "gapless::kernel::rope"
LAYER_OP_NAME = "gapless::kernel::decoder_layer"
# Steps of at most this many rows (decode, candidates, a speculative verify) run the own GEMVs, and the layers as one
# call each; a longer prefill chunk is a GEMM, which torch's fp32 one runs faster than a GEMV summing each row alone
# (a 700-token prompt of the default model in fp32: 150-187 against 335-421 tok/s), so its linears run that GEMM,
# int8 and int4 weights de-quantised to fp32 a tile at a time, and its layers run as modules.
GEMM_ROWS = 32
DEQUANT_TILE_FLOATS = 1 << 21  # the fp32 rows one de-quantised tile holds (8 MiB), whatever the linear's size
# torch's packed CPU kernel for each format, what runs where the own kernels cannot be built
TORCH_CPU_OPS = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}
LAYER_SWITCH_ENV = "GAPLESS_CPU_LAYER"  # "0": the layer's ops one by one (the kernels above), to compare


class _Q8(ctypes.Structure):
    """struct gapless_q8: a quantised linear's weight, scales, minimums (NULL for int8) and bias (or NULL)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Extra(ctypes.Structure):
    """struct gapless_layer_extra: q/k norms, Gemma's post norms (each NULL where the layer has none), the norms'
    weight offset (1 for Gemma's), tanh GELU for SiLU, and a sliding layer's window (0: none)."""

    _fields_ = [
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_ffn_norm", ctypes.c_void_p),
        ("norm_offset", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("window", ctypes.c_int64),
    ]


def layer_allowed() -> bool:
    """Whether the whole-layer kernel may run (it can be switched off to compare with the per-op kernels)."""
    return os.environ.get(LAYER_SWITCH_ENV, "1") != "0"


def _readable(t: torch.Tensor, dtype: torch.dtype, numel: Optional[int] = None) -> bool:
    """Whether C may read `t` by pointer as `numel` (or all its) contiguous elements of `dtype` in host memory."""
    return t.dtype == dtype and t.is_contiguous() and t.is_cpu and (numel is None or t.numel() == numel)


_UNMARKED = contextlib.nullcontext()


def _marked(name: str) -> contextlib.AbstractContextManager:
    """A record_function around a call while a profiler runs, so the profile window sees it; a no-op otherwise
    (one flag read on the hot path)."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else _UNMARKED


class CpuKernels:
    """The loaded library: `bind` (an int8 or int4 linear, checked once; `bind_f32` an fp32 one) with `linear` and
    `linear4` that bind and run at once, for fp32 activations of any number of rows; `rms_norm`, `silu_mul`, `rope`;
    and `bind_layer` for a whole decoder layer, run by `run_layers`."""

    def __init__(self, lib: ctypes.CDLL, path: Path, flags: tuple[str, ...]):
        self.path, self.flags = path, flags
        lib.gapless_int8_vector.restype = ctypes.c_char_p
        self.vector = lib.gapless_int8_vector().decode()
        # x, m, then weight, scales, bias, y (int8) or weight, scales, mins, bias, y (int4), then n, k, threads
        # (fp32: x, m, then weight, bias, y, then n, k, threads)
        self._fn, self._fn4, self._fn32 = (
            self._linear_fn(getattr(lib, name), pointers)
            for name, pointers in (("gapless_int8_linear", 4), ("gapless_int4_linear", 5), ("gapless_f32_linear", 3))
        )
        # weight, scales, (mins,) out, n, k, threads
        self._dequant8, self._dequant4 = lib.gapless_int8_dequant, lib.gapless_int4_dequant
        for fn, pointers in ((self._dequant8, 3), (self._dequant4, 4)):
            fn.restype = None
            fn.argtypes = [*[ctypes.c_void_p] * pointers, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        norm = lib.gapless_rms_norm
        norm.restype = None
        norm.argtypes = [*[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
        self._norm = norm
        silu = lib.gapless_silu_mul
        silu.restype = None
        silu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._silu_mul = silu
        rope = lib.gapless_rope
        rope.restype = None
        rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 4]
        self._rope = rope
        layer = lib.gapless_decoder_layer
        layer.restype = ctypes.c_int
        layer.argtypes = [
            ctypes.c_void_p,  # x
            *[ctypes.c_int64] * 2,  # b, t
            ctypes.c_void_p,  # pos
            *[ctypes.c_int64] * 6,  # attn_len, dim, heads, kv heads, head dim, intermediate
            *[ctypes.c_void_p] * 2,  # norms
            ctypes.c_float,  # eps
            *[ctypes.POINTER(_Q8)] * 4,  # qkv, o, gate/up, down
            ctypes.POINTER(_Extra),  # q/k norms, post norms, norm offset, GELU, window
            *[ctypes.c_void_p] * 4,  # cos, sin_signed, k cache, v cache
            ctypes.c_int64,  # cache length
            ctypes.c_float,  # attention scale
            ctypes.c_int,  # threads
        ]
        self._layer = layer
        self._lib = lib  # keeps the library loaded while the functions are referenced

    @staticmethod
    def _linear_fn(fn, pointers: int):
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            *[ctypes.c_void_p] * pointers,
            *[ctypes.c_int64] * 2,
            ctypes.c_int,
        ]
        return fn

    @property
    def description(self) -> str:
        return self.gemv("int8")

    def gemv(self, fmt: str) -> str:
        threads = "OpenMP threads" if "-fopenmp" in self.flags else "one thread (no OpenMP)"
        return f"own {fmt} GEMV ({self.vector}, {threads})"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """x [m, k] fp32 contiguous, weight [n, k] int8, scales [n] fp32, bias [n] fp32 or None -> y [m, n] fp32."""
        return self.bind(weight, scales, bias).run(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x / sqrt(mean(x^2, -1) + eps)) over the last dimension; x and weight fp32, contiguous."""
        d = x.shape[-1]
        if not (_readable(x, torch.float32) and _readable(weight, torch.float32, d)):
            raise ValueError(
                f"RMSNorm kernel arguments: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                f"{weight.dtype}: want contiguous fp32 tensors on the CPU, the weight as long as x's last dimension"
            )
        y = torch.empty_like(x)
        with _marked(NORM_OP_NAME):
            self._norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // d if d else 0, d, eps)
        return y

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x [m, 2 * inter] = [gate | up] (rows may be strided, the columns contiguous)."""
        m, two = x.shape
        inter = two // 2
        if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 and two % 2 == 0):
            raise ValueError(f"SiLU-mul kernel arguments: x {tuple(x.shape)} {x.dtype} with strides {x.stride()}")
        y = torch.empty((m, inter), dtype=torch.float32)
        with _marked(SILU_OP_NAME):
            self._silu_mul(x.data_ptr(), x.stride(0), y.data_ptr(), m, inter)
        return y

    def rope(
        self, x: torch.Tensor, b: int, t: int, heads: int, d: int, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> torch.Tensor:
        """Rotary embedding of x [b * t, >= heads * d] (the first heads * d columns, rows may be strided) into a new
        [b, heads, t, d]; cos and sin_signed [t, d] (engine.model.signed_sin), as engine.model.apply_rope_signed."""
        if not (
            x.dtype == cos.dtype == sin_signed.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[0] == b * t
            and x.shape[1] >= heads * d
            and x.stride(1) == 1
            and d % 2 == 0
            and cos.shape == sin_signed.shape == (t, d)
            and cos.is_contiguous()
            and sin_signed.is_contiguous()
        ):
            raise ValueError(
                f"RoPE kernel arguments: x {tuple(x.shape)} {x.dtype} strides {x.stride()}, cos "
                f"{tuple(cos.shape)}, sin {tuple(sin_signed.shape)} for {b}x{t} rows of {heads} heads of {d}"
            )
        out = torch.empty((b, heads, t, d), dtype=torch.float32)
        with _marked(ROPE_OP_NAME):
            self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(), b, t, heads, d)
        return out

    def bind(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: Optional[torch.Tensor],
        mins: Optional[torch.Tensor] = None,
    ) -> "BoundLinear":
        """The linear of these weights, checked once, so that a call checks only its activations (the checks and
        the conversions were a tenth of a decode step's kernel time at 121 calls a token): int8 weight [n, k] with
        fp32 scales [n], or, with mins, int4 weight [n, k / 2] in pack_int4's layout with fp16 scales and
        minimums [n, k / 32] (quant.quantize_int4_min); an fp32 bias [n] or None."""
        n, cols = weight.shape if weight.dim() == 2 else (-1, -1)
        if mins is None:
            fmt, stored, per_row, scale_dtype = "int8", torch.int8, 1, torch.float32
        else:
            fmt, stored, scale_dtype = "int4", torch.uint8, torch.float16
            per_row = 2 * cols // INT4_GROUP if cols > 0 and (2 * cols) % INT4_GROUP == 0 else -1
        # C reads these by pointer: a wrong dtype, layout or size would read past the tensors, so check them
        if not (
            per_row > 0
            and _readable(weight, stored)
            and _readable(scales, scale_dtype, n * per_row)
            and (mins is None or _readable(mins, torch.float16, n * per_row))
            and (bias is None or _readable(bias, torch.float32, n))
        ):
            raise ValueError(
                f"{fmt} kernel arguments: weight {tuple(weight.shape)} {weight.dtype}, scales {tuple(scales.shape)} "
                f"{scales.dtype}, mins {None if mins is None else (tuple(mins.shape), mins.dtype)}, bias "
                f"{None if bias is None else (tuple(bias.shape), bias.dtype)}: want contiguous tensors on the CPU, "
                f"int8 weight [n, k] and fp32 scales [n], or uint8 int4 weight [n, k / 2] (k a multiple of "
                f"{INT4_GROUP}) and fp16 scales and mins [n, k / {INT4_GROUP}]; fp32 bias [n]"
            )
        fns = (self._fn, self._dequant8) if mins is None else (self._fn4, self._dequant4)
        return BoundLinear(*fns, weight, scales, mins, bias)

    def bind_f32(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "BoundLinear":
        """An fp32 linear (weight [n, k], bias [n] or None), checked once, for the layer kernel."""
        n = weight.shape[0] if weight.dim() == 2 else -1
        if not (n > 0 and _readable(weight, torch.float32) and (bias is None or _readable(bias, torch.float32, n))):
            raise ValueError(
                f"fp32 kernel arguments: weight {tuple(weight.shape)} {weight.dtype}, bias "
                f"{None if bias is None else (tuple(bias.shape), bias.dtype)}: want contiguous fp32 tensors on the "
                "CPU, weight [n, k] and bias [n]"
            )
        return BoundLinear(self._fn32, None, weight, None, None, bias)

    def linear4(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """x [m, k] fp32 contiguous, weight [n, k / 2] uint8 in the int4 layout (pack_int4), scales and mins
        [n, k / 32] fp16, bias [n] fp32 or None -> y [m, n] fp32."""
        return self.bind(weight, scales, bias, mins).run(x)

    def bind_layer(
        self,
        norms: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        linears: tuple["BoundLinear", ...],
        heads: tuple[int, int, int],
        scale: float,
        qk_norms: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        post_norms: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        norm_offset: float = 0.0,
        gelu: bool = False,
        window: int = 0,
    ) -> "BoundDecoderLayer":
        """A decoder layer's weights for gapless_decoder_layer, checked once and held: its two norms' weights, its
        bound int8, int4 or fp32 linears qkv, o, gate/up and down, (heads, kv heads, head dim) and the attention scale;
        where the layer has them, its q and k norms' weights [head dim] (Qwen3, Gemma-3), the norms after the
        attention and the MLP [dim] (Gemma-3), the offset every norm adds to its weight (1 for Gemma's), the tanh
        GELU in place of SiLU and a sliding window of positions (0: none)."""
        h, hkv, d = heads
        qkv, o, gu, down = linears
        dim, inter = norms[0].numel(), down.k
        shapes_ok = (
            h % hkv == 0
            and norms[1].numel() == dim
            and all(_readable(n, torch.float32) for n in norms)
            and all(_readable(n, torch.float32, d) for n in qk_norms or ())
            and all(_readable(n, torch.float32, dim) for n in post_norms or ())
            and window >= 0
            and (qkv.n, qkv.k) == ((h + 2 * hkv) * d, dim)
            and (o.n, o.k) == (dim, h * d)
            and (gu.n, gu.k) == (2 * inter, dim)
            and (down.n, down.k) == (dim, inter)
        )
        if not shapes_ok:
            raise ValueError(
                f"decoder layer kernel arguments: norms {[tuple(n.shape) for n in norms]}, q/k norms "
                f"{[tuple(n.shape) for n in qk_norms or ()]}, post norms {[tuple(n.shape) for n in post_norms or ()]}, "
                f"linears {[(lin.n, lin.k) for lin in linears]} for {h} heads, {hkv} kv heads of {d}, window {window}: "
                "want a Llama-shaped layer with fp32 norms on the CPU"
            )
        ptr = lambda pair, i: None if pair is None else pair[i].data_ptr()  # noqa: E731
        extra = _Extra(
            ptr(qk_norms, 0), ptr(qk_norms, 1), ptr(post_norms, 0), ptr(post_norms, 1), norm_offset, int(gelu), window
        )
        held = norms + (qk_norms or ()) + (post_norms or ())
        return BoundDecoderLayer(self._layer, held, eps, list(linears), (dim, h, hkv, d, inter), scale, extra)


class BoundLinear:
    """One int8, int4 or fp32 linear's weights, scales (not fp32), minimums (int4) and bias, checked and held (so their
    memory stays while it is called): `run(x)` checks x and calls the kernel, or for more than GEMM_ROWS rows
    torch's fp32 GEMM on the weights (de-quantised a tile at a time by `dequant`, None for fp32 ones)."""

    __slots__ = ("weight", "scales", "mins", "bias", "n", "k", "fmt", "_fn", "_dequant", "_args", "_name")

    def __init__(
        self,
        fn,
        dequant,
        weight: torch.Tensor,
        scales: Optional[torch.Tensor],
        mins: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
    ):
        self.weight, self.scales, self.mins, self.bias = weight, scales, mins, bias
        self.n, self.k = weight.shape[0], weight.shape[1] * (1 if mins is None else 2)
        self.fmt = "fp32" if scales is None else "int8" if mins is None else "int4"
        self._fn, self._name = fn, {"fp32": F32_OP_NAME, "int8": OP_NAME, "int4": INT4_OP_NAME}[self.fmt]
        self._dequant = dequant
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self._args = (weight.data_ptr(), ptr(scales), ptr(mins), ptr(bias))

    def holds(self, *tensors: Optional[torch.Tensor]) -> bool:
        """Whether (weight, scales, bias[, mins]) are the tensors it was bound to, with their memory where it was."""
        given = tensors + (None,) * (4 - len(tensors))
        w, s, z, b = self._args
        return all(a is m for a, m in zip(given, (self.weight, self.scales, self.bias, self.mins))) and all(
            t is None or t.data_ptr() == p for t, p in zip(given, (w, s, b, z))
        )

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] fp32, contiguous, on the CPU -> y [m, n] fp32."""
        if not (_readable(x, torch.float32) and x.dim() == 2 and x.shape[1] == self.k):
            raise ValueError(
                f"{self.fmt} kernel arguments: x {tuple(x.shape)} {x.dtype} for weight "
                f"{tuple(self.weight.shape)}: want "
                f"contiguous fp32 x [m, {self.k}] on the CPU"
            )
        m = x.shape[0]
        if m > GEMM_ROWS:
            return self._gemm(x)
        w, s, z, b = self._args
        with _marked(self._name):  # the output's allocation inside: one op in a profile
            y = torch.empty((m, self.n), dtype=torch.float32)
            threads = torch.get_num_threads()
            if s is None:
                rc = self._fn(x.data_ptr(), m, w, b, y.data_ptr(), self.n, self.k, threads)
            elif z is None:
                rc = self._fn(x.data_ptr(), m, w, s, b, y.data_ptr(), self.n, self.k, threads)
            else:
                rc = self._fn(x.data_ptr(), m, w, s, z, b, y.data_ptr(), self.n, self.k, threads)
        if rc != 0:
            raise MemoryError(f"the quantised linear kernel could not allocate {m} rows of {self.k} activations")
        return y

    def dequantized(
        self, start: int = 0, stop: Optional[int] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Rows start..stop of the weight in fp32 ([stop - start, k], into `out` where given): the values the GEMV
        multiplies."""
        stop = self.n if stop is None else stop
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"rows {start}..{stop} of a {self.n}-row {self.fmt} weight")
        if self.fmt == "fp32":
            return self.weight[start:stop] if out is None else out.copy_(self.weight[start:stop])
        rows = stop - start
        if out is None:
            out = torch.empty((rows, self.k), dtype=torch.float32)
        elif not (_readable(out, torch.float32) and tuple(out.shape) == (rows, self.k)):
            raise ValueError(f"a de-quantised tile {tuple(out.shape)} {out.dtype}: want fp32 [{rows}, {self.k}]")
        w, s, z = self.weight[start:stop], self.scales, self.mins
        assert s is not None, "an int8 or int4 weight has its scales"
        threads = torch.get_num_threads()
        if z is None:
            self._dequant(w.data_ptr(), s[start:stop].data_ptr(), out.data_ptr(), rows, self.k, threads)
        else:
            self._dequant(w.data_ptr(), s[start:stop].data_ptr(), z[start:stop].data_ptr(), out.data_ptr(), rows,
                          self.k, threads)  # fmt: skip
        return out

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (+ bias) with torch's fp32 GEMM, the int8/int4 weight de-quantised a tile of at most
        DEQUANT_TILE_FLOATS at a time (the host never holds the whole linear in fp32)."""
        with _marked(self._name):
            tile = max(1, DEQUANT_TILE_FLOATS // self.k)
            if self.fmt == "fp32" or tile >= self.n:
                w = self.dequantized()
                return torch.mm(x, w.t()) if self.bias is None else torch.addmm(self.bias, x, w.t())
            # out^T a tile of weight rows at a time (a row slice of it is contiguous, so the GEMM writes in place)
            out_t = torch.empty((self.n, x.shape[0]), dtype=torch.float32)
            buf = torch.empty((tile, self.k), dtype=torch.float32)
            for start in range(0, self.n, tile):
                stop = min(self.n, start + tile)
                torch.mm(self.dequantized(start, stop, buf[: stop - start]), x.t(), out=out_t[start:stop])
            y = out_t.t().contiguous()
            return y if self.bias is None else y.add_(self.bias)


class BoundDecoderLayer:
    """A decoder layer bound for gapless_decoder_layer; run_layers runs a list of them on a step's tensors."""

    def __init__(
        self, fn, norms, eps: float, linears: list[BoundLinear], dims: tuple[int, ...], scale: float, extra: _Extra
    ):
        # norms: the two the layer always has first, then any others the extra's pointers were taken from (held so
        # their memory stays while it is called)
        self._fn, self.norms, self.eps, self.linears, self.dims, self.scale = fn, norms, eps, linears, dims, scale
        self.extra, self.window = extra, extra.window  # the struct C reads by pointer, held with the layer
        self._q8 = [_Q8(*lin._args) for lin in linears]
        self._q8_refs = [ctypes.byref(q) for q in self._q8]
        self._extra_ref = ctypes.byref(extra)


def run_layers(
    layers: list[BoundDecoderLayer],
    x: torch.Tensor,
    b: int,
    t: int,
    pos: torch.Tensor,
    attn_len: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    local: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """The layers one after another on the residual stream x [b * t, dim] (updated in place), layer i writing its
    keys and values into k_caches[i], v_caches[i] at the positions `pos`. A sliding-window layer takes the rope
    tables `local` (cos, sin_signed) where given (Gemma-3's local rope base). The step's tensors are checked once,
    each layer's cache and sizes before its call, so C never reads past what it was given."""
    tables = [(cos, sin_signed)] + ([] if local is None else [local])
    shared_ok = (
        all(_readable(a, torch.float32) for a in (x, *(a for pair in tables for a in pair)))
        and _readable(pos, torch.int64)
        and x.dim() == 2
        and x.shape[0] == b * t
        and pos.shape == (t,)
        and all(c.dim() == 2 and c.shape == s.shape == cos.shape and c.shape[0] == t for c, s in tables)
        and len(k_caches) == len(v_caches) == len(layers)
    )
    threads = torch.get_num_threads()
    for layer, k_cache, v_cache in zip(layers, k_caches, v_caches):
        dim, h, hkv, d, inter = layer.dims
        c, s = tables[-1] if layer.window else tables[0]
        length = k_cache.shape[2] if k_cache.dim() == 4 else -1
        cache_shape = (b, hkv, length, d)
        if not (
            shared_ok
            and x.shape[1] == dim
            and cos.shape[1] == d
            and _readable(k_cache, torch.float32)
            and _readable(v_cache, torch.float32)
            and tuple(k_cache.shape) == tuple(v_cache.shape) == cache_shape
            and 0 < attn_len <= length
        ):
            raise ValueError(
                f"decoder layer kernel arguments: x {tuple(x.shape)} {x.dtype}, pos {tuple(pos.shape)} {pos.dtype}, "
                f"cos {tuple(cos.shape)}, cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, attn_len {attn_len} "
                f"for {b}x{t} rows: want contiguous fp32 tensors on the CPU, caches [B, {hkv}, L, {d}]"
            )
        qkv, o, gu, down = layer._q8_refs
        with _marked(LAYER_OP_NAME):
            rc = layer._fn(
                x.data_ptr(), b, t, pos.data_ptr(), attn_len, dim, h, hkv, d, inter,
                layer.norms[0].data_ptr(), layer.norms[1].data_ptr(), layer.eps, qkv, o, gu, down, layer._extra_ref,
                c.data_ptr(), s.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), length, layer.scale, threads,
            )  # fmt: skip
        if rc == -2:
            raise ValueError(f"decoder layer kernel: a position outside the {length}-position cache")
        if rc != 0:
            raise MemoryError("the decoder layer kernel could not allocate its scratch rows")


_lock = threading.Lock()
_loaded: Optional[CpuKernels] = None
_reason: Optional[str] = None
_tried = False


def kernel() -> Optional[CpuKernels]:
    """The built library, building it on the first call; None when it cannot be (see unavailable_reason)."""
    global _loaded, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load()
            except KernelUnavailable as e:
                _reason = str(e)
                log.info("the own CPU kernels are unavailable: %s", e)
            except Exception as e:  # what the build did not foresee: torch's kernels run, and say why
                _reason = f"building them failed: {type(e).__name__}: {e}"
                log.warning("the own CPU kernels are unavailable: %s", _reason, exc_info=True)
        return _loaded


def loaded() -> Optional[CpuKernels]:
    """The library where it is built (building it on the first call), without taking the lock after that: for the
    hot path."""
    return _loaded if _tried else kernel()


def tried() -> bool:
    """Whether this process has built or loaded the library already (or found it cannot)."""
    return _tried


def unavailable_reason() -> Optional[str]:
    """Why the own kernels do not run (torch's do instead), or None when they do."""
    kernel()
    return _reason


def describe(fmt: str = "int8") -> str:
    """What computes a CPU int8 (or int4) linear here, for the model panel and the bench JSON."""
    k = kernel()
    if k is None:
        return f"aten.{TORCH_CPU_OPS[fmt]} ({_reason})"
    if not layer_allowed():
        return f"{k.gemv(fmt)}; layers op by op ({LAYER_SWITCH_ENV}=0)"
    return f"{k.gemv(fmt)}; each decoder layer as one call in eager fp32 steps on a static cache"


class KernelUnavailable(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    raise KernelUnavailable("no C compiler on PATH (cc, gcc or clang) to build it")


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    return out.stdout


def _load() -> CpuKernels:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        raise KernelUnavailable(f"switched off ({SWITCH_ENV}=0)")
    from engine.paths import cache_dir

    cc = _compiler()
    source = SOURCE.read_bytes()
    identity = "\0".join([_compiler_version(cc), platform.machine(), _cpu_identity(), torch.__version__])
    out_dir = cache_dir() / "cpu-kernels"
    with contextlib.suppress(OSError):
        out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    build: Optional[Path] = None
    loads = _loads_libraries(out_dir)  # else (a cache on a file system mounted noexec) nothing in it can run
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + identity.encode() + " ".join(flags).encode()).hexdigest()[:20]
        path = out_dir / f"kernels-{key}.so"
        if not loads or not _intact(path):  # not built yet, or damaged (loading a truncated one crashed)
            build = build or _build_folder(out_dir, loads)
            path = build / path.name
            err = _build(cc, flags, path)
            if err:
                errors.append(f"{' '.join(flags)}: {err}")
                continue
        try:
            return CpuKernels(ctypes.CDLL(str(path)), path, flags)
        except (OSError, AttributeError) as e:
            errors.append(f"{' '.join(flags)}: could not load {path.name}: {e}")
    raise KernelUnavailable(f"{Path(cc).name} could not build engine/cpu_kernels.c: {errors[-1][:300]}")


def _digest_path(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _intact(library: Path) -> bool:
    """Whether `library` is there as it was built: its bytes have the digest recorded beside it when it was."""
    try:
        recorded = _digest_path(library).read_text(encoding="ascii").strip()
        return hashlib.sha256(library.read_bytes()).hexdigest() == recorded
    except (OSError, UnicodeDecodeError):  # a digest file damaged as the library can be: built again
        return False


def _loads_libraries(folder: Path) -> bool:
    """Whether a library in `folder` can be loaded: not on a file system mounted noexec (where loading one fails
    with "failed to map segment"). True where the platform cannot tell."""
    noexec = getattr(os, "ST_NOEXEC", 0)
    try:
        return not (noexec and os.statvfs(folder).f_flag & noexec)
    except OSError:
        return True


def _build_folder(cache: Path, loads: bool = True) -> Path:
    """Where a library is built: the cache, or where it cannot be written (read-only, another user's) or its
    libraries cannot be loaded (noexec) a temporary folder removed at exit, so the kernels still run, built again
    at each start."""
    if loads and cache.is_dir() and os.access(cache, os.W_OK | os.X_OK):
        return cache
    why = "not writable" if loads else "on a file system that does not load programs (mounted noexec)"
    try:
        folder = Path(tempfile.mkdtemp(prefix="gapless-cpu-kernels-"))
    except OSError as e:
        raise KernelUnavailable(f"the cache folder {cache} is {why}, and no temporary folder can be made: {e}") from e
    atexit.register(shutil.rmtree, folder, True)
    if not _loads_libraries(folder):
        raise KernelUnavailable(
            f"the cache folder {cache} is {why}, and the temporary folder {folder.parent} is on a file system "
            "mounted noexec: no library built can be loaded"
        )
    log.warning("the cache folder %s is %s: the CPU kernels are built in %s for this run", cache, why, folder)
    return folder


def _build(cc: str, flags: tuple[str, ...], path: Path) -> Optional[str]:
    """Compile into a temporary file renamed into place, so a crash or a second process never sees half a
    library, and record its digest beside it (_intact); the compiler's last error line, or None."""
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    except OSError as e:
        return f"cannot write in {path.parent}: {e.strerror or e}"
    os.close(fd)
    try:
        cmd = [cc, *flags, *_COMMON_FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            return str(e)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            return lines[-1] if lines else f"exit status {done.returncode}"
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, path)
        _record_digest(path, digest)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _record_digest(library: Path, digest: str) -> None:
    """Write the library's digest beside it (renamed into place, as the library is)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=library.parent)  # can fail too (no inode, a quota)
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, _digest_path(library))
    except OSError as e:
        log.warning("could not record the digest of %s (it is built again at the next start): %s", library, e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@torch.library.custom_op("gapless::int8_linear", mutates_args=())
def _int8_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    k = kernel()
    assert k is not None, "the int8 linear op is only used where the kernel loaded"
    return k.linear(x, weight, scales, bias)


@_int8_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("gapless::int4_linear", mutates_args=())
def _int4_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    k = kernel()
    assert k is not None, "the int4 linear op is only used where the kernel loaded"
    return k.linear4(x, weight, scales, mins, bias)


@_int4_linear_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def int4_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """The int4 kernel's linear: a direct call in eager mode, an opaque custom op where torch.compile traces."""
    if torch.compiler.is_compiling():
        return _int4_linear_op(x, weight, scales, mins, bias)
    k = _loaded
    assert k is not None, "int4_linear runs only where kernel() loaded the library"
    return k.linear4(x, weight, scales, mins, bias)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] in 0..15 (k a multiple of 32) -> [n, k / 2] uint8 in the kernel's layout: each group of 32 inputs
    in 16 bytes, inputs 0..15 in the low nibbles and 16..31 in the high ones."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // INT4_GROUP, 2, INT4_GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """The kernel's linear: a direct call in eager mode, an opaque custom op where torch.compile traces."""
    if torch.compiler.is_compiling():
        return _int8_linear_op(x, weight, scales, bias)
    k = _loaded
    assert k is not None, "int8_linear runs only where kernel() loaded the library"
    return k.linear(x, weight, scales, bias)
