"""The fast-path decoder: one Transformer module for the Llama, Mistral, Qwen2 and Qwen3 families.

Built from a Hugging Face config and loaded from an HF-named state dict. Attention reads and writes a KV cache
object handed in by the caller (static, dynamic or none), so the same module serves every kv_cache mode.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import cpu_kernels
from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
GEMMA_FAMILIES = ("gemma3_text",)
# Rope types whose frequencies do not depend on the sequence length: one table serves every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArgs:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma3_text
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_seq_len: int  # the usable context
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2, or attention_bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3, Gemma-3: RMSNorm over each head of q and k before rope
    hidden_act: str
    # Gemma-3: the embedding scaled by sqrt(dim), norms that scale by 1 + weight in fp32, a norm after the
    # attention and on both sides of the MLP, its own attention scale, and sliding-window layers with a rope base
    # of their own; a final soft cap on the logits where the config sets one.
    gemma: bool = False
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    sliding_window: Optional[int] = None  # the keys a sliding layer sees: the last `sliding_window` positions
    sliding_layers: tuple[bool, ...] = ()  # per layer: a sliding-window layer
    final_softcap: Optional[float] = None

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        family = cfg.model_type
        if family not in FAST_FAMILIES:
            raise ValueError(f"{family} is not on the fast path")
        gemma = family in GEMMA_FAMILIES
        if gemma:
            act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        else:
            act = getattr(cfg, "hidden_act", "silu")
        if act not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
            raise ValueError(f"activation {act!r} is not on the fast path")
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        context = int(cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        if window and (family == "mistral" or getattr(cfg, "use_sliding_window", False)):
            context = min(context, int(window))  # within the window, full attention is exact
        if family == "qwen3" and getattr(cfg, "layer_types", None):
            if any(t != "full_attention" for t in cfg.layer_types):
                raise ValueError("sliding-window layers are not on the fast path")
        sliding: tuple[bool, ...] = ()
        if gemma:
            if getattr(cfg, "use_bidirectional_attention", False):
                raise ValueError("bidirectional attention is not on the fast path")
            if getattr(cfg, "attn_logit_softcapping", None) is not None:
                raise ValueError("attention logit soft-capping is not on the fast path")
            sliding = tuple(t == "sliding_attention" for t in cfg.layer_types)
            if any(t not in ("sliding_attention", "full_attention") for t in cfg.layer_types):
                raise ValueError(f"layer types {sorted(set(cfg.layer_types))} are not on the fast path")
            if any(sliding) and not window:
                raise ValueError("sliding-window layers without a window size")
            if rope_parameters(cfg, "sliding_attention").get("rope_type", "default") != "default":
                raise ValueError("a scaled rope on the sliding-window layers is not on the fast path")
        rope = rope_parameters(cfg)
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not on the fast path")
        factors = getattr(cfg, "rope_freq_factors", None)
        if factors is not None and rope_type != "default":
            raise ValueError(f"rope frequency factors on top of rope type {rope_type!r}")
        if factors is not None and len(factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(factors)} factors for {head_dim // 2} frequencies")
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial rotary embedding (partial_rotary_factor {partial}) is not on the fast path")
        return cls(
            family=family,
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            n_layers=cfg.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            norm_eps=cfg.rms_norm_eps,
            max_seq_len=context,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # As transformers builds each family: Qwen2 has q/k/v biases always; Llama, Qwen3 and Gemma-3 follow
            # attention_bias (o_proj too); only Llama reads mlp_bias; Mistral has no biases.
            qkv_bias=family == "qwen2" or (attention_bias and family in ("llama", "qwen3", *GEMMA_FAMILIES)),
            o_bias=attention_bias and family in ("llama", "qwen3", *GEMMA_FAMILIES),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)) and family == "llama",
            qk_norm=family == "qwen3" or gemma,
            hidden_act=act,
            gemma=gemma,
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else None,
            sliding_window=int(window) if any(sliding) and window else None,
            sliding_layers=sliding if any(sliding) else (),
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
        )


def is_rope_base(theta: object) -> bool:
    """Whether a config's rope_theta can build the rope tables: a positive number (a string failed building them,
    0 or less made them NaN)."""
    return isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0


def rope_parameters(cfg, layer_type: str = "full_attention") -> dict:
    """Rope settings from either transformers 5 (`rope_parameters`) or 4 (`rope_theta` + `rope_scaling`); for
    a model whose layer types have settings of their own (Gemma-3), those of `layer_type`."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    out = dict(getattr(cfg, "rope_scaling", None) or {})
    out.setdefault("rope_type", out.get("type", "default"))
    out["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    return out


def rope_tables(
    cfg, head_dim: int, max_seq_len: int, layer_type: str = "full_attention"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_seq_len, head_dim] in fp32, computed as transformers does (so logits match)."""
    params = rope_parameters(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
        factors = getattr(cfg, "rope_freq_factors", None)  # from a GGUF's rope_freqs tensor, as llama.cpp applies it
        if factors is not None:  # their count is checked with the rest of the config (ModelArgs.from_hf_config)
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        nested = isinstance(getattr(cfg, "rope_parameters", None), dict) and layer_type in cfg.rope_parameters
        kw = {"layer_type": layer_type} if nested else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **kw)
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class KVCache(Protocol):
    def update(
        self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at input_pos [T]; return the keys/values to attend over."""
        ...


class StaticKVCache:
    """Preallocated once: [B, Hkv, L, D] per layer, written with index_copy_, read over the first attn_len rows.
    Plain tensors owned by the runner (no parameters, nothing to register with the model)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v
        self.batch, self.length = k[0].shape[0], k[0].shape[2]
        self.attn_len = self.length  # set by the caller before each forward: the context bucket in use

    @classmethod
    def allocate(
        cls, args: ModelArgs, batch: int, length: int, dtype: torch.dtype, device: torch.device
    ) -> "StaticKVCache":
        shape = (batch, args.n_kv_heads, length, args.head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)],
        )

    def rows(self, n: int) -> "StaticKVCache":
        """The first n rows, sharing this cache's storage (the batch-1 prefill of a multi-candidate batch)."""
        view = StaticKVCache([t[:n] for t in self.k], [t[:n] for t in self.v])
        view.attn_len = self.attn_len
        return view

    def over(self, n: int) -> "StaticKVCache":
        """This cache attending over its first n positions (n may be symbolic in a compiled step)."""
        view = StaticKVCache(self.k, self.v)
        view.attn_len = n
        return view

    def update(self, layer, input_pos, k, v):
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(2, input_pos, k)
        vc.index_copy_(2, input_pos, v)
        return kc[:, :, : self.attn_len], vc[:, :, : self.attn_len]

    def copy_row0_to_all(self, length: int) -> None:
        """Candidates: the prompt was prefilled into row 0; share it with every row (a device copy)."""
        for kc, vc in zip(self.k, self.v):
            kc[1:, :, :length].copy_(kc[:1, :, :length].expand(self.batch - 1, -1, -1, -1))
            vc[1:, :, :length].copy_(vc[:1, :, :length].expand(self.batch - 1, -1, -1, -1))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class DynamicKVCache:
    """Grows with torch.cat every step: the allocation pattern of a naive loop."""

    def __init__(self, n_layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * n_layers
        self.v: list[Optional[torch.Tensor]] = [None] * n_layers

    def update(self, layer, input_pos, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def expand_rows(self, batch: int) -> None:
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k is None or v is None:
                raise RuntimeError("the dynamic cache's rows are shared after the prefill has filled every layer")
            self.k[i], self.v[i] = k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous()


def eager_cpu_kernels(x: torch.Tensor) -> Optional["cpu_kernels.CpuKernels"]:
    """The engine's own CPU kernels where they serve x: fp32 on the CPU in an eager step (under compile, inductor
    fuses these ops itself) and the library built; None otherwise, and torch's ops run."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return cpu_kernels.loaded()
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic without the two casts, which are no-ops here
            kernels = eager_cpu_kernels(x)  # one call for the six ops below
            if kernels is not None and x.is_contiguous() and self.weight.is_contiguous():
                return kernels.rms_norm(x, self.weight, self.eps)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and scales in fp32, before the cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


def make_norm(args: ModelArgs, dim: int) -> RMSNorm:
    return GemmaRMSNorm(dim, args.norm_eps) if args.gemma else RMSNorm(dim, args.norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos, sin: [T, D]
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(D/2, -1) * signed_sin(sin), bit for bit
    (a negation is exact, and rounding is symmetric in sign)."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rope with the sign folded into the table once a step: four ops instead of six."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def masked_attention(
    q, k, v, mask: torch.Tensor, input_pos: torch.Tensor, gqa: bool, scale: Optional[float] = None
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D], mask [T, S] bool (True = attend), which is `s <= input_pos[t]` for
    every caller. Looked up as a module global at trace time, so the GPU check can measure another attention
    kernel in its place (one that builds the mask from the positions)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def window_mask(input_pos: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """[T, keys] bool: query t at position input_pos[t] sees the keys at positions (input_pos[t] - window,
    input_pos[t]], the keys being positions 0..keys-1 (as every cache holds them)."""
    s = torch.arange(keys, device=input_pos.device)[None, :]
    pos = input_pos[:, None]
    return (s <= pos) & (s > pos - window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.wo = nn.Linear(self.q_size, args.dim, bias=args.o_bias)
        self.q_norm = make_norm(args, args.head_dim) if args.qk_norm else None
        self.k_norm = make_norm(args, args.head_dim) if args.qk_norm else None
        self.scale = args.attn_scale
        self.window = args.sliding_window if args.sliding_layers and args.sliding_layers[layer] else None

    def forward(self, x, B: int, T: int, cos, sin, input_pos, cache: Optional[KVCache], mask: Optional[torch.Tensor]):
        """x [B * T, dim] (the rows of the batch's tokens, so no linear reshapes); cos [T, D] and sin [T, D] with
        its first half negated (signed_sin). A sliding-window layer is given its window's mask (or None, where
        it builds one over the keys the cache returns)."""
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.q_norm(q.view(B, T, H, D)), self.k_norm(k.view(B, T, Hkv, D))
            q = apply_rope_signed(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
            k = apply_rope_signed(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        else:  # q and k are adjacent in the fused projection: one rope over both heads' sets
            qk, v = self.wqkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            kernels = eager_cpu_kernels(qk)
            if kernels is not None and qk.dim() == 2 and qk.stride(1) == 1 and cos.is_contiguous():
                qk = kernels.rope(qk, B, T, H + Hkv, D, cos, sin)  # the same roundings, one call
            else:
                qk = apply_rope_signed(qk.view(B, T, H + Hkv, D).transpose(1, 2), cos, sin)  # [B, H + Hkv, T, D]
            q, k = qk.split([H, Hkv], dim=1)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, input_pos, k, v)
        gqa = self.n_heads != self.n_kv_heads
        if self.window is not None:
            if mask is None:
                mask = window_mask(input_pos, k.shape[2], self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
        elif mask is None:  # no cache, or a dynamic cache: causal over the keys, queries are the last T
            causal = T > 1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, scale=self.scale)
        else:
            y = masked_attention(q, k, v, mask, input_pos, gqa, self.scale)
        y = y.transpose(1, 2).reshape(B * T, self.q_size)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inter = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x):
        h = self.w13(x)
        kernels = None if self.gelu else eager_cpu_kernels(h)
        if kernels is not None and h.dim() == 2:
            return self.w2(kernels.silu_mul(h))
        gate, up = h.split([self.inter, self.inter], dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(act * up)


class _Refs:
    """What a binding was made from, by identity: the submodules of `modules`, the named attributes of each
    `(module, names)` in `settings`, the parameters and buffers of `holders`, and the tensors' storage. `hold()`
    is False once any was replaced, added, removed or re-placed."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        settings: tuple[tuple[nn.Module, tuple[str, ...]], ...],
        holders: tuple[nn.Module, ...],
    ):
        tables = [m._modules for m in modules] + [t for h in holders for t in (h._parameters, h._buffers)]
        self.tables, self.sizes = tables, [len(t) for t in tables]
        entries = [(table, name, obj) for table in tables for name, obj in table.items()]
        entries += [(vars(m), name, vars(m).get(name)) for m, names in settings for name in names]
        self.owners, self.names, self.objects = (list(column) for column in zip(*entries))
        self.tensors = [t for t in self.objects if isinstance(t, torch.Tensor)]
        self.pointers = [t.data_ptr() for t in self.tensors]

    def hold(self) -> bool:  # loops in C (map): about 5 us for a layer's ~40 entries
        return (
            list(map(len, self.tables)) == self.sizes
            and all(map(operator.is_, map(dict.get, self.owners, self.names), self.objects))
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = make_norm(args, args.dim)
        self.attention = Attention(args, layer)
        self.ffn_norm = make_norm(args, args.dim)
        self.feed_forward = FeedForward(args)
        # Gemma: a norm on the attention's output and on the MLP's, before each joins the residual stream
        self.post_attention_norm = make_norm(args, args.dim) if args.gemma else None
        self.post_ffn_norm = make_norm(args, args.dim) if args.gemma else None
        self._cpu_bound: Optional[cpu_kernels.BoundDecoderLayer] = None  # the whole-layer CPU kernel's binding
        # what the binding (or the finding that there is none) was made from; while it all still holds, a step
        # reuses it without the checks of _bind_cpu_layer (about 30 us a layer, a tenth of a 10 ms step)
        self._cpu_refs: Optional[_Refs] = None

    def cpu_layer(self, kernels: "cpu_kernels.CpuKernels") -> Optional["cpu_kernels.BoundDecoderLayer"]:
        """This layer bound for the whole-layer CPU kernel (gapless_decoder_layer), or None where the kernel does
        not cover it: layers whose four linears are int8 or int4 on the own kernels or fp32, in Llama's shape or with
        Qwen3's q/k norms or Gemma-3's norms, GELU and sliding window."""
        if self._cpu_refs is not None and self._cpu_refs.hold():
            return self._cpu_bound
        bound = self._cpu_bound = self._bind_cpu_layer(kernels)
        att, ffn = self.attention, self.feed_forward
        linears = (att.wqkv, att.wo, ffn.w13, ffn.w2)
        norms = self._norms()
        settings = (
            (self, ("post_attention_norm", "post_ffn_norm")),
            (att, ("q_norm", "k_norm", "window", "scale", "n_heads", "n_kv_heads", "head_dim")),
            (ffn, ("gelu",)),
            *((norm, ("eps",)) for norm in norms),
            *((lin, ("own_kernel", "bias")) for lin in linears),  # a bias that is None is a plain attribute
        )
        self._cpu_refs = _Refs((self, att, ffn), settings, norms + linears)
        return bound

    def _norms(self) -> tuple[RMSNorm, ...]:
        """The layer's norms: the two every layer has, then q/k's and the post norms where it has them."""
        att = self.attention
        extra = (att.q_norm, att.k_norm, self.post_attention_norm, self.post_ffn_norm)
        return (self.attention_norm, self.ffn_norm, *(n for n in extra if n is not None))

    def _bind_cpu_layer(self, kernels: "cpu_kernels.CpuKernels") -> Optional["cpu_kernels.BoundDecoderLayer"]:
        from engine.quant import Int4Linear, Int8Linear

        att, ffn = self.attention, self.feed_forward
        linears = (att.wqkv, att.wo, ffn.w13, ffn.w2)
        norms = self._norms()
        kind = type(self.attention_norm)
        qk = (att.q_norm, att.k_norm)
        post = (self.post_attention_norm, self.post_ffn_norm)
        if (
            kind not in (RMSNorm, GemmaRMSNorm)
            or any(type(n) is not kind or n.eps != self.attention_norm.eps for n in norms)  # the kernel takes one
            or (qk[0] is None) != (qk[1] is None)
            or (post[0] is None) != (post[1] is None)
            or ffn.gelu != (kind is GemmaRMSNorm)  # the kernel's GELU is Gemma's, its SiLU Llama's
            or (att.window is not None and att.window < 1)
        ):
            return None

        def bindable(lin: nn.Module) -> bool:  # an int8 or int4 linear on the own kernels, or a plain fp32 one
            if type(lin) is nn.Linear:
                return lin.weight.dtype == torch.float32
            return isinstance(lin, (Int8Linear, Int4Linear)) and lin.own_kernel

        if not all(map(bindable, linears)) or any(
            lin.bias is not None and lin.bias.dtype != torch.float32 for lin in linears
        ):
            return None
        scale = att.scale if att.scale is not None else att.head_dim**-0.5
        heads = (att.n_heads, att.n_kv_heads, att.head_dim)
        weights = lambda pair: None if pair[0] is None else (pair[0].weight, pair[1].weight)  # noqa: E731

        def bound(lin: nn.Module) -> "cpu_kernels.BoundLinear":  # each checked as its own kernel call checks it
            if type(lin) is nn.Linear:
                return kernels.bind_f32(lin.weight, lin.bias)
            return cast("Int8Linear | Int4Linear", lin).cpu_bound()

        try:
            parts = tuple(map(bound, linears))
            return kernels.bind_layer(
                (self.attention_norm.weight, self.ffn_norm.weight),
                self.attention_norm.eps,
                parts,
                heads,
                scale,
                qk_norms=weights(qk),
                post_norms=weights(post),
                norm_offset=1.0 if kind is GemmaRMSNorm else 0.0,
                gelu=ffn.gelu,
                window=att.window or 0,
            )
        except ValueError as exc:  # tensors the kernel cannot read as they are: the layer's modules run instead
            log.info("layer kept on its modules: %s", exc)
            return None

    def forward(self, x, B: int, T: int, cos, sin, input_pos, cache, mask):
        a = self.attention(self.attention_norm(x), B, T, cos, sin, input_pos, cache, mask)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


# Rope tables a model is built with: positions below this (or its whole context where shorter). A long context's
# tables are large and slow to compute (Llama-3's 131,072 positions of 128 dims: 134 MB and 0.33 s here; Gemma-3's
# two sets of 32,768 x 256: 134 MB), and a conversation rarely reaches them; Transformer.cover_positions grows them.
ROPE_POSITIONS_AT_LOAD = 8192

# (cos, sin, the sliding-window layers' (cos, sin) or None) for the positions below n, on the CPU in fp32
RopeMaker = Callable[[int], tuple[torch.Tensor, torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]]


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor
    rope_cos_local: Optional[torch.Tensor]  # the sliding-window layers' tables, where their rope differs
    rope_sin_local: Optional[torch.Tensor]
    embed_scale: Optional[torch.Tensor]  # Gemma: sqrt(dim) in the model's dtype, as transformers rounds it
    # what makes longer rope tables (build_transformer sets it); None: the tables given are all there are
    make_rope: Optional[RopeMaker] = None

    def __init__(
        self,
        args: ModelArgs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        super().__init__()
        self.args = args
        # given storage, so no random init runs: on the meta device Embedding's normal_ imports torch._dynamo (3 s)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = make_norm(args, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", cos, persistent=False)  # [L, D] fp32, cast at use
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_cos_local", None if local is None else local[0], persistent=False)
        self.register_buffer("rope_sin_local", None if local is None else local[1], persistent=False)
        scale = torch.tensor(args.dim**0.5) if args.gemma else None
        self.register_buffer("embed_scale", scale, persistent=False)
        # tables replaced by longer ones on a GPU: a captured CUDA graph still reads them where it was captured
        self._retired_rope: list[tuple[Optional[torch.Tensor], ...]] = []

    @property
    def rope_positions(self) -> int:
        """How many positions the rope tables hold."""
        return int(self.rope_cos.shape[0])

    def cover_positions(self, n: int) -> None:
        """Rope tables for every position below n (at most the model's context, as the tables it could be built
        with): made longer, at least doubled, where they are shorter. Whoever runs positions past
        ROPE_POSITIONS_AT_LOAD calls this first, before anything is compiled or captured for them (every runner
        does, for its length). The values are the same as the whole context's tables at those positions."""
        n = min(n, self.args.max_seq_len)
        have = self.rope_positions
        if n <= have:
            return
        if self.make_rope is None:
            raise ValueError(f"this model's rope tables hold {have} positions and cannot be extended to {n}")
        size = min(self.args.max_seq_len, max(n, 2 * have))
        cos, sin, local = self.make_rope(size)
        device, dtype = self.rope_cos.device, self.rope_cos.dtype
        if device.type == "cuda":
            self._retired_rope.append((self.rope_cos, self.rope_sin, self.rope_cos_local, self.rope_sin_local))
        self.rope_cos, self.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
        if local is not None:
            self.rope_cos_local, self.rope_sin_local = local[0].to(device, dtype), local[1].to(device, dtype)

    def forward(
        self,
        idx: torch.Tensor,  # [B, T]
        input_pos: torch.Tensor,  # [T] absolute positions
        cache: Optional[KVCache] = None,
        mask: Optional[torch.Tensor] = None,  # [T, S] bool, True = attend; None = causal over the keys
        last_only: bool = True,
    ) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_embeddings(idx.view(B * T))  # [B * T, dim] through the blocks
        dtype = x.dtype
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(dtype)
        rope = self._rope(self.rope_cos, self.rope_sin, input_pos, dtype)
        local, window = rope, mask  # what the sliding-window layers take (Gemma-3)
        if self.rope_cos_local is not None and self.rope_sin_local is not None:
            local = self._rope(self.rope_cos_local, self.rope_sin_local, input_pos, dtype)
        if mask is not None and self.args.sliding_window is not None:
            # over the keys the full mask covers; without a mask each sliding layer builds its own over its keys
            window = window_mask(input_pos, mask.shape[1], self.args.sliding_window)
        sliding = self.args.sliding_layers or (False,) * len(self.layers)
        own_step = self._cpu_layers(x, B, T, rope, local, input_pos, cache, mask)
        if not own_step:
            for block, slides in zip(self.layers, sliding):
                x = block(x, B, T, *(local if slides else rope), input_pos, cache, window if slides else mask)
        x = x.view(B, T, -1)
        if last_only:
            x = x[:, -1:]
        h = self.norm(x)
        if own_step and type(self.output) is nn.Linear and self.output.weight.dtype == torch.float32:
            # the layers ran as the own kernel's calls: an fp32 head is its fp32 GEMV too (checked on each bind)
            kernels = cast("cpu_kernels.CpuKernels", cpu_kernels.loaded())
            rows = h.reshape(-1, h.shape[-1]).contiguous()
            logits = kernels.bind_f32(self.output.weight, self.output.bias).run(rows).view(*h.shape[:-1], -1)
        else:
            logits = self.output(h)
        cap = self.args.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()  # [B, T or 1, V]

    def _cpu_layers(self, x, B: int, T: int, rope, local, input_pos, cache, mask) -> bool:
        """Every layer through the whole-layer CPU kernel, x updated in place, where it serves this step (eager
        fp32 on the CPU, a static cache, at most GEMM_ROWS rows, int8, int4 or fp32 linears on the own kernels,
        layers it covers: Block.cpu_layer);
        False where it does not, and the modules run. The kernel attends to the positions s <= input_pos[t] below
        the cache's attn_len (and within a sliding layer's window), which is what every caller's mask says (and a
        prefill from position 0 without one); sliding layers take the `local` rope tables."""
        kernels = eager_cpu_kernels(x)
        if (
            kernels is None
            or not isinstance(cache, StaticKVCache)
            or not cpu_kernels.layer_allowed()
            or (mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (T, cache.attn_len)))
            or input_pos.device.type != "cpu"
            or not x.is_contiguous()
            or B * T > cpu_kernels.GEMM_ROWS  # a long prefill chunk: the modules, whose linears run GEMMs
        ):
            return False
        bound = []
        for block in self.layers:
            b = cast(Block, block).cpu_layer(kernels)
            if b is None:
                return False
            bound.append(b)
        cos, sin = rope
        pos = input_pos.contiguous()
        cpu_kernels.run_layers(bound, x, B, T, pos, cache.attn_len, cos, sin, cache.k, cache.v, local)
        return True

    @staticmethod
    def _rope(cos_table, sin_table, input_pos, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_table[input_pos], sin_table[input_pos]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, signed_sin(sin)

    def num_parameters(self) -> int:
        """The model's parameters whatever the weight format: a quantised linear holds its weight as buffers, so it
        counts as its in x out; a tied head is counted once (in the embedding's table where that is still held,
        else as the quantised head the embedding reads)."""
        from engine.quant import QUANTISED_LINEARS

        n = sum(p.numel() for p in self.parameters())
        table_held = isinstance(self.tok_embeddings, nn.Embedding)  # else the embedding reads the head's table
        for name, m in self.named_modules():
            if isinstance(m, QUANTISED_LINEARS) and not (name == "output" and self.args.tie_embeddings and table_held):
                n += m.in_features * m.out_features
        return n

    def weight_bytes(self) -> int:
        # parameters, and the buffers that stand for weights (quantised linears); the rope tables are not weights
        held = [
            *self.parameters(),
            *(b for n, b in self.named_buffers() if not n.startswith("rope_") and n != "embed_scale"),
        ]
        return sum(t.numel() * t.element_size() for t in held)


class _TakenOnRead(dict):
    """A dict whose reads remove the entry: each weight is dropped as soon as it is fused or moved."""

    def __getitem__(self, key):
        return self.pop(key)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, without a copy when the parts already lie one after another in one buffer
    (as the GGUF loader de-quantises q/k/v and gate/up)."""
    first = parts[0]
    at = first.storage_offset()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or p.storage_offset() != at
            or p.shape[1:] != first.shape[1:]
            or p.dtype != first.dtype
        ):
            return torch.cat(parts)
        at += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _hf_to_fast(state_dict: dict[str, torch.Tensor], args: ModelArgs, consume: bool = False) -> dict[str, torch.Tensor]:
    """HF parameter names -> ours, fusing q/k/v and gate/up into one matrix each. With `consume`, the given dict
    is emptied first, so the host never holds the unfused and the fused model at once."""
    sd = (_TakenOnRead if consume else dict)((k.removeprefix("model."), v) for k, v in state_dict.items())
    if consume:
        state_dict.clear()
    out = {"tok_embeddings.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"]}
    if not args.tie_embeddings:
        key = "lm_head.weight" if "lm_head.weight" in sd else None
        if key is None:
            raise ModelLoadError("the checkpoint has no lm_head.weight and its config does not tie embeddings")
        out["output.weight"] = sd[key]
    for i in range(args.n_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[p + "attention.wqkv.weight"] = joined(
            [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]
        )
        if args.qkv_bias:
            out[p + "attention.wqkv.bias"] = joined(
                [sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]
            )
        out[p + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        if args.o_bias:
            out[p + "attention.wo.bias"] = sd[a + "o_proj.bias"]
        if args.qk_norm:
            out[p + "attention.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[p + "attention.k_norm.weight"] = sd[a + "k_norm.weight"]
        out[p + "feed_forward.w13.weight"] = joined([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        if args.mlp_bias:
            out[p + "feed_forward.w13.bias"] = joined([sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"]])
        out[p + "feed_forward.w2.weight"] = sd[m + "down_proj.weight"]
        if args.mlp_bias:
            out[p + "feed_forward.w2.bias"] = sd[m + "down_proj.bias"]
        out[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        if args.gemma:  # Gemma's post_attention_layernorm is on the attention's output; the MLP has norms of its own
            out[p + "post_attention_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
            out[p + "ffn_norm.weight"] = sd[p + "pre_feedforward_layernorm.weight"]
            out[p + "post_ffn_norm.weight"] = sd[p + "post_feedforward_layernorm.weight"]
        else:
            out[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def build_transformer(
    cfg, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, consume: bool = False
) -> Transformer:
    """Our decoder from an HF config and HF-named weights, in `dtype` on `device` (`consume`: see _hf_to_fast)."""
    args = ModelArgs.from_hf_config(cfg)
    own_local = bool(args.sliding_layers) and rope_parameters(cfg, "sliding_attention") != rope_parameters(cfg)

    def make_rope(n: int):
        cos, sin = rope_tables(cfg, args.head_dim, n)
        return cos, sin, rope_tables(cfg, args.head_dim, n, "sliding_attention") if own_local else None

    cos, sin, local = make_rope(min(args.max_seq_len, ROPE_POSITIONS_AT_LOAD))
    with torch.device("meta"):
        model = Transformer(args, cos, sin, local)
    threads = torch.get_num_threads()
    # copies gain nothing from intra-op threads and lose much when the cores are busy (as in de-quantising)
    torch.set_num_threads(1)
    try:
        weights = _hf_to_fast(state_dict, args, consume)
    except KeyError as exc:
        raise ModelLoadError(
            f"the checkpoint lacks the weight {exc.args[0]!r} that a {args.family} model needs"
        ) from None
    finally:
        torch.set_num_threads(threads)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    model.load_state_dict(weights, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos = cos.to(device)
    model.rope_sin = sin.to(device)
    if local is not None:
        model.rope_cos_local, model.rope_sin_local = local[0].to(device), local[1].to(device)
    model.make_rope = make_rope
    if args.gemma:
        model.embed_scale = torch.tensor(args.dim**0.5, device=device)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"weights missing for {', '.join(missing[:4])}")
    return model.eval().requires_grad_(False)
