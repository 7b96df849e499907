"""The GPU check's `fused` section: the fused Triton decode kernels (engine/kernels) on a CUDA GPU.

- fp32 greedy tokens of the fused step (CUDA graph, 1 and 4 candidates) against the eager path over 64 tokens;
- fp16 and bf16: first-step logits of the fused step against the eager step in the same dtype, and the first
  token where 64 greedy tokens part;
- fp16 speed at 200 new tokens (median of 3), single stream and 16 candidates, with and without Programmatic
  Dependent Launch (GAPLESS_PDL), kernels per decode step and µs per step by kernel from a profiler trace, and
  how many consecutive kernels overlap in it (PDL kept inside the CUDA graph shows as overlapping kernels);
- each GEMV kernel's achieved bandwidth on the bytes it reads (triton.testing.do_bench, L2 flushed between runs)
  on SmolLM2-135M's shapes, against the card's device-to-device copy bandwidth.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from engine.kernels import STEP_KERNELS

# (name, N outputs, K inputs): the issue's 576x960, 576x576, 576x3072, 1536x576 and 576x49152 (K x N)
GEMV_SHAPES = (
    ("qkv_rope", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("head", 49152, 576),
)
TARGETS = {
    "single_stream_tok_s": 2000,
    "candidates16_tok_s": 30000,
    "kernels_per_layer": 6,
    "kernel_gap_pct": 10,
    "gemv_pct_of_copy_bw": 50,
}


def fused_kind(name: str) -> str:
    from gpu.gpu_check import kernel_kind

    return name if name in STEP_KERNELS else f"torch {kernel_kind(name)}"


def overlapping_pairs(trace: dict) -> int:
    """Consecutive kernels (by start) where the next starts before the previous ends."""
    ks = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "dur" in e
    )
    return sum(1 for (_, end), (start, _) in zip(ks, ks[1:]) if start < end)


def _messages():
    from gpu.gpu_check import PROMPT

    return [{"role": "user", "content": PROMPT}]


def parity_fp32(folder: Path, device: str, max_new: int) -> dict:
    from engine.bench import matching_prefix
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    eager = EngineOptions(device=device, dtype="fp32", kv_cache="dynamic", sampling="host")
    fused = EngineOptions(device=device, dtype="fp32", cuda_graph=device == "cuda", kernels="fused")
    eng = Engine.load(str(folder), eager)
    try:
        ref = eng.generate(_messages(), greedy).token_ids[0]
        rows = []
        for n in (1, 4):
            eng.reconfigure(fused.with_(candidates=n))
            res = eng.generate(_messages(), greedy)
            rows.append(
                {
                    "options": res.options.to_dict(),
                    "unavailable": res.unavailable,
                    "notices": res.notices,
                    "identical": all(t == ref for t in res.token_ids),
                    "matching_prefix": [matching_prefix(t, ref) for t in res.token_ids],
                }
            )
        return {
            "reference": "fp32 eager, dynamic cache, host sampling",
            "tokens": len(ref),
            "rows": rows,
            "all_identical": all(r["identical"] for r in rows),
        }
    finally:
        eng.close()


def half_precision(folder: Path, device: str, dtype: str, max_new: int) -> dict:
    from engine.bench import matching_prefix
    from engine.decode import StaticRunner
    from engine.engine import Engine
    from engine.kernels.runner import FusedRunner
    from engine.sampling import SamplerKind
    from engine.types import EngineOptions, SamplingParams
    from gpu.gpu_check import LOGIT_TOLERANCE

    g = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    eager = EngineOptions(device=device, dtype=dtype)
    eng = Engine.load(str(folder), eager)
    try:
        ref = eng.generate(_messages(), greedy).token_ids[0]
        eng.reconfigure(eager.with_(cuda_graph=device == "cuda", kernels="fused"))
        res = eng.generate(_messages(), greedy)
        got = res.token_ids[0]
        prompt = torch.randint(3, eng.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).to(
            eng.device
        )
        dt = eng.model.tok_embeddings.weight.dtype
        with torch.inference_mode():
            e = StaticRunner(eng.model, 1, 256, eng.eos_ids, eng.device, dt)
            e.prefill(prompt, g)
            e.cache.attn_len = 41
            logits_e = eng.model(e.tok, e.pos, e.cache, None)[:, -1].float()
            f = FusedRunner(eng.model, 1, 256, eng.eos_ids, eng.device, dt)
            f.prefill(prompt, g)
            f.fused_step(g)
            logits_f = f.logits.clone()
        diff = (logits_e - logits_f).abs().max().item()
        first = matching_prefix(got, ref)
        return {
            "dtype": dtype,
            "options": res.options.to_dict(),
            "unavailable": res.unavailable,
            "first_step_max_abs_diff": diff,
            "max_abs_logit": logits_e.abs().max().item(),
            "tolerance": LOGIT_TOLERANCE[dtype],
            "within": diff <= LOGIT_TOLERANCE[dtype],
            "same_argmax": bool((logits_e.argmax(-1) == logits_f.argmax(-1)).all()),
            "tokens": len(ref),
            "first_divergence": None if got == ref else first,
            "identical": got == ref,
        }
    finally:
        eng.close()


def _median_run(eng, msgs, sampling, repeats: int = 3) -> dict:
    runs = [eng.generate(msgs, sampling).metrics for _ in range(repeats)]
    med = lambda f: (
        statistics.median(getattr(m, f) for m in runs if getattr(m, f) is not None)
        if any(getattr(m, f) is not None for m in runs)
        else None
    )  # noqa: E731
    return {f: med(f) for f in ("decode_tok_s", "step_ms_p50", "kernel_gap_pct", "launches_per_step")} | {
        "decode_tok_s_runs": [m.decode_tok_s for m in runs],
        "kernel_gap_source": runs[0].kernel_gap_source,
    }


def speed(folder: Path, device: str, pdl: bool, progress: Callable[[str], None], max_new: int = 200) -> dict:
    from engine.engine import Engine
    from engine.telemetry.window import _export_trace
    from engine.types import EngineOptions, SamplingParams
    from gpu.gpu_check import kernel_table

    os.environ["GAPLESS_PDL"] = "1" if pdl else "0"
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    opts = EngineOptions(device=device, dtype="fp16", cuda_graph=True, kernels="fused")
    eng = Engine.load(str(folder), opts)
    try:
        first = eng.generate(_messages(), greedy)  # compile + capture
        out: dict[str, Any] = {
            "pdl": eng.fused_status(),
            "options": first.options.to_dict(),
            "unavailable": first.unavailable,
            "notices": first.notices,
        }
        out["single"] = _median_run(eng, _messages(), greedy)
        eng.reconfigure(opts.with_(profile_window=False))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            res = eng.generate(_messages(), greedy)
            torch.cuda.synchronize()
        trace = _export_trace(prof) or {}
        names = [e["name"] for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
        steps = names.count("greedy_accept_kernel")
        ours = sum(1 for n in names if n in STEP_KERNELS)
        layers = eng.model.args.n_layers
        out["trace"] = {
            "decode_steps": steps,
            "fused_kernels_per_step": ours / steps if steps else None,
            "fused_kernels_per_layer": (ours - 2 * steps) / steps / layers if steps else None,
            "overlapping_kernel_pairs": overlapping_pairs(trace),
            "per_decode_step": kernel_table(trace, max(steps, 1), fused_kind),
            "tokens": len(res.token_ids[0]),
        }
        eng.reconfigure(opts.with_(candidates=16))
        eng.generate(_messages(), greedy)  # capture at 16 rows
        out["candidates16"] = _median_run(eng, _messages(), greedy)
        progress(
            f"PDL {'on' if pdl else 'off'} ({out['pdl']}): {out['single']['decode_tok_s']} tok/s single, "
            f"{out['candidates16']['decode_tok_s']} tok/s x16, {out['trace']['fused_kernels_per_step']} "
            f"kernels/step, {out['trace']['overlapping_kernel_pairs']} overlapping pairs"
        )
        return out
    finally:
        eng.close()
        os.environ.pop("GAPLESS_PDL", None)


def _copy_gb_s() -> float:
    """A device-to-device copy of 256 MiB: bytes read + written over the median time."""
    import triton.testing

    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def _gemv_call(name: str, n: int, k: int) -> Callable[[], None]:
    """One row through one GEMV kernel in fp16 with random operands: the launch do_bench times."""
    from engine.kernels import launch

    dev, dt = torch.device("cuda"), torch.float16

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev).to(dt)

    w, x, nw = r(n, k) * 0.02, r(1, k), r(k)
    if name == "qkv_rope":
        q, kc, vc = r(1, 9, 64), r(1, 3, 256, 64), r(1, 3, 256, 64)
        cos, sin = r(256, 64), r(256, 64)
        pos, tok = torch.tensor([7], device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev)
        return lambda: launch.qkv_rope(x, tok, None, nw, w, None, None, None, cos, sin, pos, q, kc, vc, 1e-5)
    if name in ("o_proj", "down"):
        res = r(1, n)
        return lambda: launch.gemv_residual(x, w, None, res)
    if name == "gate_up":
        act = r(1, n // 2)
        return lambda: launch.norm_gate_up(x, nw, w, None, act, 1e-5)
    blocks = launch.head_blocks(n, k)
    logits = torch.empty(1, n, device=dev)
    pmax, pidx = torch.empty(1, blocks, device=dev), torch.empty(1, blocks, dtype=torch.int32, device=dev)
    return lambda: launch.norm_head(x, nw, w, logits, pmax, pidx, 1e-5)


def gemv_bandwidth(progress: Callable[[str], None]) -> dict:
    """Each GEMV kernel alone at one row in fp16, L2 flushed between runs by do_bench; bytes = what it reads."""
    import triton.testing

    from engine.kernels import launch

    copy_gbs = _copy_gb_s()
    rows = []
    for name, n, k in GEMV_SHAPES:
        fn = _gemv_call(name, n, k)
        fn()
        ms = triton.testing.do_bench(fn, return_mode="median")
        nbytes = (n * k + 2 * k) * 2
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "kernel": name,
                "shape_k_x_n": f"{k}x{n}",
                "us": ms * 1e3,
                "bytes_read": nbytes,
                "gb_s": gbs,
                "pct_of_copy_bw": 100 * gbs / copy_gbs,
                "block_n_k": launch.gemv_blocks(n, k),
            }
        )
        progress(f"{name} {k}x{n}: {ms * 1e3:.2f} us, {gbs:.0f} GB/s ({100 * gbs / copy_gbs:.0f} % of copy)")
    return {
        "copy_gb_s": copy_gbs,
        "copy_note": "device-to-device copy of 256 MiB, read + write bytes over time",
        "rows": rows,
    }


def fused_check(folder: Path, progress: Callable[[str], None], device: str = "cuda", max_new: int = 64) -> dict:
    from engine.kernels import load_triton

    mod = load_triton()
    out: dict[str, Any] = {
        "triton": getattr(__import__("triton"), "__version__", None) if mod else None,
        "targets": TARGETS,
    }
    out["parity_fp32"] = parity_fp32(folder, device, max_new)
    progress(f"fp32 fused vs eager: identical={out['parity_fp32']['all_identical']}")
    for dtype in ("fp16", "bf16"):
        out[f"half_{dtype}"] = h = half_precision(folder, device, dtype, max_new)
        progress(
            f"{dtype}: first-step max |diff| {h['first_step_max_abs_diff']:.4f}, first divergence "
            f"{h['first_divergence']}"
        )
    if device == "cuda":
        out["speed_pdl"] = speed(folder, device, True, progress)
        out["speed_no_pdl"] = speed(folder, device, False, progress)
        out["gemv_bandwidth"] = gemv_bandwidth(progress)
    return out
