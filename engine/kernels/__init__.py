"""Fused Triton decode kernels: what can run where, and the lazy import that honours the interpreter switch.

Triton is imported only here, on first use: GAPLESS_TRITON_INTERPRET=1 must set TRITON_INTERPRET before that import
for the kernels to run on CPU tensors through Triton's interpreter. GAPLESS_PDL=0 switches Programmatic Dependent
Launch off, to compare.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from engine.model import ModelArgs

INTERPRET_ENV = "GAPLESS_TRITON_INTERPRET"
PDL_ENV = "GAPLESS_PDL"
MIN_CAPABILITY = (7, 5)  # Triton's oldest supported NVIDIA architecture (Turing)
PDL_CAPABILITY = (9, 0)  # griddepcontrol is Hopper and newer
# The kernels of one fused decode step (engine/kernels/step_kernels.py), in launch order: five per layer, the head
# and the greedy pick.
STEP_KERNELS = (
    "qkv_rope_kernel",
    "decode_attention_kernel",
    "gemv_residual_kernel",
    "norm_gate_up_kernel",
    "norm_head_kernel",
    "greedy_accept_kernel",
)


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "") == "1"


_triton: Optional[ModuleType] = None
_import_error: Optional[str] = None


def load_triton() -> Optional[ModuleType]:
    """The kernels module, importing Triton on first call; None when Triton cannot be imported (see import_error)."""
    global _triton, _import_error
    if _triton is None and _import_error is None:
        if interpreting():
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            from engine.kernels import step_kernels
        except ImportError as exc:
            _import_error = f"Triton is not installed or does not import ({exc})"
        else:
            if interpreting() and not _interpreter_active():
                _import_error = (
                    f"Triton was imported before {INTERPRET_ENV}=1 took effect, so it cannot interpret; "
                    "set the variable before starting"
                )
            else:
                _triton = step_kernels
    return _triton


def _interpreter_active() -> bool:
    """Triton decides at import whether its own library functions are interpreted."""
    import triton.language.standard

    return type(triton.language.standard.zeros).__name__ == "InterpretedFunction"


def import_error() -> Optional[str]:
    load_triton()
    return _import_error


def unavailable_reason(args: ModelArgs, device: torch.device) -> Optional[str]:
    """Why the fused kernels cannot serve this model on this device, or None when they can."""
    if device.type == "cpu" and not interpreting():
        return (
            f"the fused kernels are Triton GPU kernels and this runs on the CPU (set {INTERPRET_ENV}=1 to run "
            "them through Triton's interpreter, slowly)"
        )
    if device.type == "cuda" and interpreting():
        return f"{INTERPRET_ENV}=1 runs the kernels on CPU tensors only; unset it to run them on the GPU"
    if device.type not in ("cpu", "cuda"):
        return f"the fused kernels do not run on {device.type}"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            return f"this GPU (compute capability {cap[0]}.{cap[1]}) is older than Triton supports ({MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]})"
    if args.gemma:
        return (
            f"the fused kernels serve the Llama, Mistral and Qwen families; {args.family} (Gemma's norms, "
            "sliding-window layers) runs the torch path"
        )
    if args.hidden_act not in ("silu", "swish"):
        return f"activation {args.hidden_act!r} has no fused kernel"
    if args.head_dim % 2:
        return f"head_dim {args.head_dim} is odd"
    if args.qk_norm and args.head_dim & (args.head_dim - 1):
        return f"q/k norm with head_dim {args.head_dim}: the fused kernel needs a power of two"
    if args.n_heads % args.n_kv_heads:
        return f"{args.n_heads} query heads do not group evenly over {args.n_kv_heads} KV heads"
    err = import_error()
    if err:
        return err
    return None


def pdl_status(device: torch.device) -> tuple[bool, str]:
    """(use PDL, why not / what it is) for kernels launched on `device`."""
    if os.environ.get(PDL_ENV, "1") == "0":
        return False, f"switched off ({PDL_ENV}=0)"
    if device.type != "cuda":
        return False, "Programmatic Dependent Launch is a CUDA feature (Hopper and newer)"
    cap = torch.cuda.get_device_capability(device)
    if cap < PDL_CAPABILITY:
        return False, f"needs compute capability 9.0 (Hopper) or newer; this GPU is {cap[0]}.{cap[1]}"
    mod = load_triton()
    if mod is None or mod.gdc_wait is None:
        return False, "the installed Triton has no gdc_wait / gdc_launch_dependents"
    return True, "on: each kernel loads its weights before waiting for the previous kernel"
