"""Compile the fused decode step's kernels for an NVIDIA architecture without a GPU: Triton's compiler and the
ptxas it ships, on the calls a real step makes (recorded from FusedRunner.fused_step on meta tensors, so block
sizes and constexprs are the launch code's own). Prints one JSON line per kernel variant with its registers and
spills (cuobjdump's resource usage). Run without TRITON_INTERPRET:

    python tests/engine/fused_aot.py --arch 90 --pdl --dtype fp16 --family llama --rows 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
}
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size")
SHAPES = {  # SmolLM2-135M's, and small Qwen-like ones with a bias or q/k norm (head_dim 128)
    family: dict(zip(_SHAPE_FIELDS, sizes), qkv_bias=qkv_bias, qk_norm=qk_norm)
    for family, sizes, qkv_bias, qk_norm in (
        ("llama", (576, 2, 9, 3, 64, 1536, 49152), False, False),
        ("qwen2", (896, 2, 14, 2, 64, 4864, 4096), True, False),
        ("qwen3", (1024, 2, 16, 8, 128, 3072, 4096), False, True),
    )
}


class _Recorder:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))


def record(family: str, dtype: torch.dtype, rows: int, pdl: bool) -> list:
    from engine.kernels import launch, step_kernels
    from engine.kernels.runner import FusedRunner
    from engine.model import ModelArgs, Transformer
    from engine.sampling import SamplerKind

    s = SHAPES[family]
    args = ModelArgs(
        family=family,
        max_seq_len=256,
        tie_embeddings=True,
        o_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        norm_eps=1e-6,
        **s,
    )
    meta = torch.device("meta")
    with meta:
        model = Transformer(args, torch.zeros(256, s["head_dim"]), torch.zeros(256, s["head_dim"])).to(dtype)
    runner = FusedRunner(model, rows, 256, [2], meta, dtype)
    runner.use_pdl = pdl
    calls: list = []
    names = [n for n in dir(step_kernels) if n.endswith("_kernel")]
    recorders = type("Recorders", (), {n: _Recorder(calls, n) for n in names})
    launch._kernels = lambda: recorders  # type: ignore[assignment]
    runner.fused_step(SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False))
    return calls


def compile_call(name: str, args: tuple, kwargs: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import step_kernels

    fn = getattr(step_kernels, name)
    options = {k: kwargs.pop(k) for k in ("launch_pdl", "num_warps") if k in kwargs}
    sig, consts = {}, {}
    for pname, value in zip(fn.arg_names, list(args) + [kwargs[n] for n in fn.arg_names[len(args) :]]):
        if pname in kwargs:
            sig[pname], consts[(fn.arg_names.index(pname),)] = "constexpr", kwargs[pname]
        elif isinstance(value, torch.Tensor):
            sig[pname] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[pname] = "i1"
        elif isinstance(value, int):
            sig[pname] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[pname] = "fp32"
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32), options=options
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    fields = dict(re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    return {
        "kernel": name,
        "arch": arch,
        "pdl": bool(options.get("launch_pdl")),
        **{k.lower(): int(v) for k, v in fields.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--pdl", action="store_true")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--family", choices=list(SHAPES), default="llama")
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: this compiles for the GPU")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    seen = set()
    for name, args, kwargs in record(a.family, dtype, a.rows, a.pdl):
        key = (
            name,
            tuple(sorted((k, v) for k, v in kwargs.items())),
            tuple(TYPES[x.dtype] if isinstance(x, torch.Tensor) else type(x).__name__ for x in args),
        )
        if key in seen:
            continue
        seen.add(key)
        print(
            json.dumps({**compile_call(name, args, dict(kwargs), a.arch), "dtype": a.dtype, "family": a.family}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
