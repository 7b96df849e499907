"""The whole GPU check in one run: token-exact parity of every option combination against eager, the ladder of
presets with the transformers baselines, NVML/GPM probing, kernel-gap figures and the out-of-memory fallback.

    python tests/gpu/gpu_check.py --out "$OUT" [--budget-s 255] [--model PATH|smollm2-shaped|tiny]

Writes OUT/gpu_check.json after every section, so a run stopped by its time limit still reports what it did.
The device machine has no network and a small transfer limit, so by default the model is SmolLM2-135M's exact
architecture (30 layers, 576 wide, GQA 9/3, 49152 vocab) with random weights: speed, kernel gaps and parity do
not depend on the weights' values. On a CPU machine every CUDA section is recorded as skipped with the reason.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # gpu.fused_check, when run as a script

import torch  # noqa: E402
from tiny_models import SMOLLM2, TINY_SHAPE  # noqa: E402

PROMPT = "Explain in two sentences why small language models are often slow on large GPUs."


def make_word_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` synthetic words: any token id decodes, so random weights stream text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
    return tok


def make_model_folder(path: Path, shape: dict, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path, safe_serialization=True)
    make_word_tokenizer(shape["vocab_size"]).save_pretrained(path)
    gen = path / "generation_config.json"
    if gen.exists():
        gen.unlink()
    return path


TINY = dict(SMOLLM2, **TINY_SHAPE, vocab_size=512, max_position_embeddings=1024)

# The weight formats' shapes (issue targets: int8 >= 1.5x and int4 >= 2x fp16 single-stream decode; weights <= 0.55x
# and <= 0.3x of fp16 memory: int4 keeps its head in int8, 0.352x and 0.325x by the layouts' bytes). Llama-3.2-1B
# ties its head; Llama-3.1-8B does not.
_LLAMA3 = dict(num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0,
               rms_norm_eps=1e-5, vocab_size=128256, bos_token_id=1, eos_token_id=2)  # fmt: skip
WEIGHT_SHAPES = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, tie_word_embeddings=False),
    "tiny": dict(TINY, max_position_embeddings=512),
}  # fmt: skip


def make_random_folder(path: Path, shape: dict, device: str, seed: int = 0) -> Path:
    """A Llama folder of random fp16 weights (std 0.02, norms 1) drawn on `device` and written as one safetensors
    file: an 8B folder in well under a minute where transformers' init and save of fp32 would take many."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    make_word_tokenizer(shape["vocab_size"]).save_pretrained(path)
    dim, inter, head_dim = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float16) * 0.02).cpu()

    weights = {"model.embed_tokens.weight": rand(cfg.vocab_size, dim), "model.norm.weight": torch.ones(dim).half()}
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = rand(cfg.vocab_size, dim)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, (n, k) in {
            "self_attn.q_proj": (q, dim), "self_attn.k_proj": (kv, dim), "self_attn.v_proj": (kv, dim),
            "self_attn.o_proj": (dim, q), "mlp.gate_proj": (inter, dim), "mlp.up_proj": (inter, dim),
            "mlp.down_proj": (dim, inter),
        }.items():  # fmt: skip
            weights[p + name + ".weight"] = rand(n, k)
        weights[p + "input_layernorm.weight"] = torch.ones(dim).half()
        weights[p + "post_attention_layernorm.weight"] = torch.ones(dim).half()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def weight_formats(
    work: Path,
    shapes: list[str],
    progress: Callable[[str], None],
    device: str = "cuda",
    dtype: str = "fp16",
    fast: bool = True,
    max_new: int = 128,
    repeats: int = 3,
) -> dict:
    """Single-stream decode and weight memory per weight format (native, int8, int4) on random weights in each
    shape: one engine a shape, reconfigured per format, compiled and captured (`fast`), one warm-up answer, then
    `repeats` answers of `max_new` tokens (median decode tok/s). Memory: the engine's weight bytes and, on CUDA,
    the allocator's bytes in use after the format is placed (caches and graphs are allocated at the first answer,
    after that reading)."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    cuda = device == "cuda"
    out: dict[str, Any] = {}
    for name in shapes:
        t = time.perf_counter()
        folder = make_random_folder(work / f"weights-{name}", WEIGHT_SHAPES[name], device if cuda else "cpu")
        progress(f"{name}: random fp16 folder in {time.perf_counter() - t:.1f}s")
        opts = EngineOptions(
            device=device, dtype=dtype, kv_cache="static", sampling="device", compile=fast, cuda_graph=fast and cuda,
            profile_window=False,
        )  # fmt: skip
        eng = Engine.load(str(folder), opts)
        rows: dict[str, Any] = {}
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=max_new, seed=0)
            msgs = [{"role": "user", "content": "w5 w9 w11 w3 w8"}]
            for fmt in ("native", "int8", "int4"):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                eng.reconfigure(eng.options.with_(weights=fmt))
                allocated = torch.cuda.memory_allocated() if cuda else None
                row: dict[str, Any] = {
                    "weight_bytes": eng.info.weight_bytes,
                    "allocated_bytes_after_placing": allocated,
                    "bytes_per_token": eng.info.bytes_per_token,
                    "weights_kernel": eng.info.weights_kernel,
                }
                warm = eng.generate(msgs, params)
                row["unavailable"] = warm.unavailable
                runs = [eng.generate(msgs, params).metrics.decode_tok_s for _ in range(repeats)]
                row["decode_tok_s_runs"] = runs
                row["decode_tok_s"] = statistics.median(runs) if all(r is not None for r in runs) else None
                rows[fmt] = row
                progress(f"{name} {fmt}: {row['decode_tok_s']} tok/s, weights {row['weight_bytes'] / 1e9:.3f} GB")
        finally:
            eng.close()
        base = rows["native"]
        for fmt in ("int8", "int4"):
            r = rows[fmt]
            r["weight_bytes_vs_native"] = r["weight_bytes"] / base["weight_bytes"]
            if cuda:
                r["allocated_vs_native"] = r["allocated_bytes_after_placing"] / base["allocated_bytes_after_placing"]
            if r["decode_tok_s"] and base["decode_tok_s"]:
                r["decode_vs_native"] = r["decode_tok_s"] / base["decode_tok_s"]
        out[name] = {"shape": WEIGHT_SHAPES[name], "dtype": dtype, "max_new_tokens": max_new, "formats": rows}
    return out


SECTIONS = (
    "nvml",
    "fused",
    "parity_fp32",
    "ladder",
    "telemetry",
    "sdpa_first_use",
    "kernels",
    "oom_fallback",
    "parity_fp16",
    "parity_bf16",
    "logits_fp16",
    "logits_bf16",
    "speculation",
    "weights",
)


class Report:
    def __init__(self, out: Path, budget_s: float, chosen=None):
        self.out, self.t0, self.budget_s = out, time.perf_counter(), budget_s
        self.chosen = set(SECTIONS if chosen is None else chosen)
        self.data: dict[str, Any] = {"sections": {}, "started_unix": time.time()}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, fn: Callable[[], Any], need_s: float = 0.0, cuda: bool = False) -> None:
        if name in SECTIONS and name not in self.chosen:
            return
        if cuda and not torch.cuda.is_available():
            self.data["sections"][name] = {"skipped": "no CUDA device on this machine"}
        elif self.left() < need_s:
            self.data["sections"][name] = {"skipped": f"time budget: {self.left():.0f}s left, needs ~{need_s:.0f}s"}
        else:
            t = time.perf_counter()
            self.data["sections"][name] = {"running": True}
            try:
                result = fn()
                self.data["sections"][name] = {
                    "ok": True,
                    "seconds": time.perf_counter() - t,
                    "result": result,
                    **self._progress_of(name),
                }
            except Exception as exc:  # a check script records every failure and goes on to the next section
                self.data["sections"][name] = {
                    "ok": False,
                    "seconds": time.perf_counter() - t,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                    **self._progress_of(name),
                }
            except BaseException:  # stopped from outside (the time limit's SIGINT): keep what the section said
                self.data["sections"][name] = {
                    "ok": False,
                    "seconds": time.perf_counter() - t,
                    "error": "interrupted (time limit)",
                    **self._progress_of(name),
                }
                self.write()
                raise
        print(
            f"[{time.perf_counter() - self.t0:6.1f}s] {name}: "
            f"{ {k: v for k, v in self.data['sections'][name].items() if k in ('ok', 'skipped', 'error', 'seconds')} }",
            flush=True,
        )
        self.write()

    def _progress_of(self, name: str) -> dict:
        lines = self.data.get("progress", {}).pop(name, None)
        return {"progress": lines} if lines else {}

    def progress(self, name: str) -> Callable[[str], None]:
        """A progress callback for a long section: its lines are kept in the report (written at most every 2 s), so
        a section stopped by the time limit still says how far it got and what it measured on the way."""
        last = [0.0]

        def say(msg: str) -> None:
            print("  ", msg, flush=True)
            self.data.setdefault("progress", {}).setdefault(name, []).append(
                f"{time.perf_counter() - self.t0:.1f}s {msg}"
            )
            if time.perf_counter() - last[0] > 2.0:
                last[0] = time.perf_counter()
                self.write()

        return say

    def write(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.t0
        path = self.out / "gpu_check.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(path)


def option_grid(device: str, candidates: tuple[int, ...]):
    from engine.types import EngineOptions

    for kv, sampling, compiled, graph, n in itertools.product(
        ("static", "dynamic", "none"), ("device", "host"), (False, True), (False, True), candidates
    ):
        if kv != "static" and (compiled or graph):
            continue  # compile and graphs need the static cache (reported unavailable otherwise)
        if graph and device != "cuda":
            continue
        yield EngineOptions(
            device=device, kv_cache=kv, sampling=sampling, compile=compiled, cuda_graph=graph, candidates=n
        )


def parity(
    folder: Path,
    device: str,
    dtype: str,
    max_new: int,
    candidates: tuple[int, ...],
    report: Report,
    with_compile: bool,
    profile_window: bool = True,
) -> dict:
    """Every option combination against the eager reference (dynamic cache, host sampling) in the same dtype."""
    from engine.bench import matching_prefix
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    msgs = [{"role": "user", "content": PROMPT}]
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    eng = Engine.load(
        str(folder),
        EngineOptions(device=device, dtype=dtype, kv_cache="dynamic", sampling="host", profile_window=profile_window),
    )
    try:
        ref = eng.generate(msgs, greedy).token_ids[0]
        rows = []
        for opts in option_grid(device, candidates):
            if opts.compile and not with_compile:
                continue
            if report.left() < 30:
                rows.append({"options": opts.to_dict(), "skipped": "time budget"})
                continue
            eng.reconfigure(opts.with_(dtype=dtype, profile_window=profile_window))
            t = time.perf_counter()
            res = eng.generate(msgs, greedy)
            got = res.token_ids
            prefix = [matching_prefix(r, ref) for r in got]
            rows.append(
                {
                    "options": res.options.to_dict(),
                    "unavailable": res.unavailable,
                    "notices": res.notices,
                    "identical": all(r == ref for r in got),
                    "matching_prefix": prefix,
                    "tokens": [len(r) for r in got],
                    "decode_tok_s": res.metrics.decode_tok_s,
                    "kernel_gap_pct": res.metrics.kernel_gap_pct,
                    "kernel_gap_source": res.metrics.kernel_gap_source,
                    "metrics_unavailable": res.metrics.unavailable,
                    "seconds_with_warmup": time.perf_counter() - t,
                }
            )
        return {
            "dtype": dtype,
            "reference_tokens": len(ref),
            "all_identical": all(r.get("identical", False) for r in rows if "skipped" not in r),
            "rows": rows,
        }
    finally:
        eng.close()


def logits_check(folder: Path, device: str, dtype: str, compile_fn: Callable = torch.compile) -> dict:
    """First-step logits of the compiled decode step against the eager one, same dtype (its own section: one
    more compile)."""
    from engine.engine import Engine
    from engine.types import EngineOptions

    eng = Engine.load(str(folder), EngineOptions(device=device, dtype=dtype))
    try:
        return first_step_logits(eng, dtype, compile_fn)
    finally:
        eng.close()


LOGIT_TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}  # max |difference| of first-step logits


def first_step_logits(eng, dtype: str, compile_fn: Callable = torch.compile) -> dict:
    """Max |logit difference| of the first decode step after a 40-token prompt: the model compiled by `compile_fn`
    against the eager model, both fed the step the way the static runner feeds its compiled and captured step
    (static cache, whole 256-position bucket attended under the position mask)."""
    from engine.decode import StaticRunner
    from engine.sampling import SamplerKind

    g = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.config.vocab_size, (40,), generator=gen).to(eng.device)
    bucket = 256
    dtype_t = eng.model.tok_embeddings.weight.dtype

    def first_step(model) -> torch.Tensor:
        runner = StaticRunner(eng.model, 1, bucket, eng.eos_ids, eng.device, dtype_t)
        runner.prefill(prompt, g)
        runner.cache.attn_len = bucket  # what StaticRunner.bucket_step sets for the compiled step
        mask = runner.arange[:bucket][None, :] <= runner.pos[:, None]
        return model(runner.tok, runner.pos, runner.cache, mask)[:, -1].float()

    with torch.inference_mode():
        logits_e = first_step(eng.model)
        logits_c = first_step(compile_fn(eng.model, dynamic=False))
        diff = (logits_e - logits_c).abs().max().item()
        tol = LOGIT_TOLERANCE[dtype]
        return {
            "max_abs_diff": diff,
            "max_abs_logit": logits_e.abs().max().item(),
            "tolerance": tol,
            "within": diff <= tol,
            "same_argmax": bool((logits_e.argmax(-1) == logits_c.argmax(-1)).all()),
        }


def probe_nvml() -> dict:
    """What NVML and GPM report while the GPU does real work."""
    from engine.telemetry.monitor import Monitor

    mon = Monitor(torch.device("cuda"), interval_s=0.1)
    mon.start()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        a @ a
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    time.sleep(0.3)
    samples = mon.drain()
    summary = mon.summary(t0, t1)
    mon.close()
    return {
        "unavailable": mon.unavailable,
        "summary": summary,
        "samples": len(samples),
        "last_sample": samples[-1].__dict__ if samples else None,
        "peak_dram_bw_bytes_s": mon.peak_dram_bw_bytes_s,
    }


def ladder(folder: Path, max_new: int, candidates: int, repeats: int, progress: Callable[[str], None]) -> dict:
    from app.cmd_bench import format_table
    from engine.bench import run_suite
    from engine.ladder import BenchConfig

    cfg = BenchConfig(
        model=str(folder),
        device="cuda",
        max_new_tokens=max_new,
        repeats=repeats,
        candidates=candidates,
        baseline=True,
        compile=True,
        prompt=PROMPT,
    )
    report = run_suite(cfg, progress=progress, command=sys.argv)
    report["table"] = format_table(report)
    print(report["table"], flush=True)
    return report


KERNEL_KINDS = (  # kernel name -> kind, first match wins (cuBLAS, PyTorch's SDPA kernels, inductor's Triton)
    ("attention", re.compile(r"fmha|attention|flash|softmax", re.I)),
    ("matmul (cuBLAS/CUTLASS)", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk", re.I)),
    ("fused (inductor Triton)", re.compile(r"^triton_")),
    ("copy / index / fill", re.compile(r"copy|index|fill|scatter|gather|cat", re.I)),
)


def telemetry(folder: Path, out: Path, device: str, max_new: int = 200) -> dict:
    """One generation on the ladder's top single-stream rung, its telemetry saved as `telemetry.json` for
    `gapless replay` on a machine with Qt (the README's HUD-on-a-GPU screenshot comes from it)."""
    from engine.engine import Engine
    from engine.recording import Recorder, save
    from engine.telemetry.machine import describe_machine
    from engine.types import EngineOptions, SamplingParams

    on_gpu = device == "cuda"
    opts = EngineOptions(device=device, dtype="fp16" if on_gpu else "fp32", compile=on_gpu, cuda_graph=on_gpu)
    eng = Engine.load(str(folder), opts)
    try:
        messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new, seed=0)
        eng.generate(messages, sampling)  # compile and capture happen here, outside the recording
        rec = Recorder()
        result = eng.generate(messages, sampling, on_event=rec)
        label = eng.info.name  # the HUD writes the options beside it
        recording = rec.finish(result, label, eng.info.to_dict(), describe_machine())
    finally:
        eng.close()
    save(recording, out / "telemetry.json")
    m = recording.metrics
    return {
        "file": "telemetry.json",
        "steps": len(recording.steps),
        "samples": len(recording.samples),
        "decode_tok_s": m.decode_tok_s,
        "kernel_gap_pct": m.kernel_gap_pct,
        "options": result.options.to_dict(),
    }


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def kernel_table(trace: dict, forward_passes: int, kind: Callable[[str], str] = kernel_kind) -> dict:
    """Per forward pass: how many kernels of each kind ran and for how long, and the longest kernels."""
    by_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and "dur" in e:
            by_name.setdefault(e["name"], []).append(float(e["dur"]))
    kinds: dict[str, dict[str, float]] = {}
    for name, durs in by_name.items():
        k = kinds.setdefault(kind(name), {"kernels_per_pass": 0.0, "us_per_pass": 0.0})
        k["kernels_per_pass"] += len(durs) / forward_passes
        k["us_per_pass"] += sum(durs) / forward_passes
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "forward_passes": forward_passes,
        "kernels_per_pass": sum(len(d) for d in by_name.values()) / forward_passes,
        "kernel_us_per_pass": sum(sum(d) for d in by_name.values()) / forward_passes,
        "by_kind": kinds,
        "top": [
            {
                "name": n[:160],
                "kind": kind(n),
                "per_pass": len(d) / forward_passes,
                "mean_us": sum(d) / len(d),
                "us_per_pass": sum(d) / forward_passes,
            }
            for n, d in top
        ],
    }


def flex_masked_attention(q, k, v, mask, input_pos, gqa, scale=None):
    """engine.model.masked_attention through FlexAttention: under torch.compile a decode step's attention
    becomes inductor's flex-decoding Triton kernels, in place of the mask kernel and cuDNN's attention. The mask
    is made inside the score function from the positions (inductor's templates take graph inputs there, not a
    tensor computed in the step)."""
    from torch.nn.attention.flex_attention import flex_attention

    def keep(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= input_pos[q_idx], score, float("-inf"))

    return flex_attention(q, k, v, score_mod=keep, enable_gqa=gqa, scale=scale)


KERNEL_VARIANTS = (  # (name, inductor config, candidates, masked attention in place of SDPA or None)
    ("inductor defaults", {}, 1, None),
    ("coordinate-descent tuning", {"coordinate_descent_tuning": True}, 1, None),
    # Triton GEMM templates benchmarked against cuBLAS per shape, norms and adds fused into their epilogues
    ("max-autotune GEMMs", {"max_autotune": True, "max_autotune_gemm_backends": "TRITON,ATEN"}, 1, None),
    ("flex-decoding attention", {}, 1, flex_masked_attention),
    ("16 candidates", {}, 16, None),
)


def changes_compiled_code(variant: tuple) -> bool:
    """Whether a kernel variant compiles other code than the defaults (not just another batch size)."""
    _, inductor, _, attention = variant
    return bool(inductor) or attention is not None


@contextmanager
def compiled_as(variant: tuple):
    """The inductor config and the masked attention of a kernel variant, in force inside the context."""
    import torch._inductor.config as inductor_config

    from engine import model as model_mod

    _, inductor, _, attention = variant
    with inductor_config.patch(inductor), ExitStack() as stack:
        if attention is not None:
            stack.enter_context(mock.patch.object(model_mod, "masked_attention", attention))
        yield


def kernels(
    folder: Path, progress: Callable[[str], None], max_new: int = 128, device: str = "cuda", fast_path: bool = True
) -> dict:
    """Where a compiled, CUDA-graph decode step's time goes: kernels per forward pass by kind, the longest
    kernels, the step time and the kernel gap, for the variants above (fp16, one engine each, compiled from
    scratch). Then each variant that changes the compiled code, in fp32 against the eager path: whether it could
    be the default without losing token parity."""
    import torch._dynamo

    from engine.engine import Engine
    from engine.telemetry.window import _export_trace
    from engine.types import EngineOptions, SamplingParams

    msgs = [{"role": "user", "content": PROMPT}]
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    rows, tokens = [], {}
    try:
        for variant in KERNEL_VARIANTS:
            name, inductor, n, attention = variant
            torch._dynamo.reset()  # compile again under this variant, not from the last one's cached code
            opts = EngineOptions(
                device=device,
                dtype="fp16" if device == "cuda" else "fp32",
                kv_cache="static",
                sampling="device",
                compile=fast_path,
                cuda_graph=fast_path,
                candidates=n,
            )
            with compiled_as(variant):
                eng = Engine.load(str(folder), opts)
                try:
                    t = time.perf_counter()
                    eng.generate(msgs, greedy)  # compile + capture
                    warm = time.perf_counter() - t
                    timed = [eng.generate(msgs, greedy) for _ in range(3)]
                    eng.reconfigure(opts.with_(profile_window=False))
                    activity = (
                        torch.profiler.ProfilerActivity.CUDA
                        if device == "cuda"
                        else torch.profiler.ProfilerActivity.CPU
                    )
                    with torch.profiler.profile(activities=[activity]) as prof:
                        res = eng.generate(msgs, greedy)
                        if device == "cuda":
                            torch.cuda.synchronize()
                    trace = _export_trace(prof)
                finally:
                    eng.close()
            tokens[name] = res.token_ids[0]
            med = sorted(timed, key=lambda r: r.metrics.decode_tok_s)[1].metrics
            row = {
                "variant": name,
                "inductor": inductor,
                "candidates": n,
                "attention": attention.__name__ if attention else "sdpa",
                "warmup_s": warm,
                "decode_tok_s": med.decode_tok_s,
                "step_ms_p50": med.step_ms_p50,
                "kernel_gap_pct": med.kernel_gap_pct,
                "kernel_gap_source": med.kernel_gap_source,
                "same_tokens_as_first_variant": res.token_ids[0] == next(iter(tokens.values())),
                **(kernel_table(trace, len(res.token_ids[0])) if trace else {"trace": "not exported"}),
            }
            rows.append(row)
            progress(
                f"{name}: {row['decode_tok_s']:.0f} tok/s, step {row['step_ms_p50']:.3f} ms, "
                f"gap {row['kernel_gap_pct']}, {row.get('kernels_per_pass', 0):.0f} kernels/pass"
            )
        fp32 = EngineOptions(device=device, dtype="fp32", kv_cache="dynamic", sampling="host", candidates=4)
        fast = fp32.with_(kv_cache="static", sampling="device", compile=fast_path, cuda_graph=fast_path)
        greedy64 = SamplingParams(temperature=0, max_new_tokens=64)
        parity = []
        eng = Engine.load(str(folder), fp32)
        try:
            ref = eng.generate(msgs, greedy64).token_ids
            for variant in filter(changes_compiled_code, KERNEL_VARIANTS):  # the defaults' are parity_fp32's
                torch._dynamo.reset()
                with compiled_as(variant):
                    eng.reconfigure(fast)
                    got = eng.generate(msgs, greedy64).token_ids
                eng.reconfigure(fp32)
                parity.append(
                    {
                        "variant": variant[0],
                        "options": "fp32, static, device sampling, compile, CUDA graph, 4 candidates",
                        "reference": "fp32 eager, dynamic cache, host sampling",
                        "identical": got == ref,
                    }
                )
                progress(f"fp32 {variant[0]} C+G x4 vs eager: identical={got == ref}")
        finally:
            eng.close()
    finally:
        torch._dynamo.reset()
    return {
        "max_new_tokens": max_new,
        "dtype": "fp16",
        "variants": rows,
        "fp32_parity": parity,
        "note": "kernels per pass over prefill + every decode step (tokens generated = forward passes); step "
        "time and gap from the engine's metrics, median of 3 runs",
    }


def sdpa_first_use(folder: Path, progress: Callable[[str], None], device: str = "cuda") -> dict:
    """Eager half precision attends a new key length at every step. With cuDNN's attention enabled each new
    length may build a new cuDNN plan, so the first answer over unseen lengths runs slower than the same answer
    again. Measured with cuDNN attention on and off, each over lengths no earlier section has used (raw prompts
    of 300 and 600 words), two runs each: first and second decode tok/s."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=150)
    eng = Engine.load(
        str(folder),
        EngineOptions(device=device, dtype="bf16", kv_cache="dynamic", sampling="device", profile_window=False),
    )
    rows = []
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled() if device == "cuda" else None
    try:
        for cudnn, words in ((True, 300), (False, 600)):
            if device == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            prompt = [{"role": "user", "content": " ".join(f"w{i % 500 + 3}" for i in range(words))}]
            runs = [eng.generate(prompt, greedy, raw=True).metrics for _ in range(2)]
            rows.append(
                {
                    "cudnn_sdp": cudnn,
                    "prompt_tokens": runs[0].prompt_tokens,
                    "first_tok_s": runs[0].decode_tok_s,
                    "second_tok_s": runs[1].decode_tok_s,
                    "first_over_second": runs[0].decode_tok_s / runs[1].decode_tok_s,
                }
            )
            progress(
                f"cuDNN attention {'on' if cudnn else 'off'}: first {runs[0].decode_tok_s:.1f} tok/s, "
                f"second {runs[1].decode_tok_s:.1f} tok/s"
            )
    finally:
        if cudnn_before is not None:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
        eng.close()
    return {"dtype": "bf16", "kv_cache": "dynamic", "rows": rows}


def speculation(folder: Path, progress: Callable[[str], None], device: str = "cuda", max_new: int = 128) -> dict:
    """Speculative decoding against plain decoding, both compiled and captured (fp16 on CUDA): the rewrite,
    summary and free-chat workloads of `gapless bench --speculation-workloads`, and what a verify step of k drafts
    costs against a plain step (the figure that carries over to real weights, whose acceptance the CPU run of the
    default model measures: greedy tokens, and so drafts and acceptance, are the same on every device). With random
    weights the workloads' acceptance says nothing about real text."""
    from engine.bench_spec import SpecBenchConfig, format_workloads, run_speculation_workloads

    cuda = device == "cuda"
    cfg = SpecBenchConfig(
        model=str(folder),
        device=device,
        dtypes=("fp16",) if cuda else ("fp32",),
        max_new_tokens=max_new,
        compile=cuda,
        cuda_graph=cuda,
    )
    report = run_speculation_workloads(cfg, progress, command=sys.argv)
    report["table"] = format_workloads(report)
    print(report["table"], flush=True)
    return report


def oom_fallback(folder: Path) -> dict:
    """Fill the GPU so a 32-candidate CUDA-graph generation cannot fit; the engine must fall back with notices."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    eng = Engine.load(str(folder), EngineOptions(device="cuda", dtype="fp16", cuda_graph=True, candidates=32))
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - (600 << 20)), dtype=torch.uint8, device="cuda")  # leave ~600 MB
    try:
        res = eng.generate(
            [{"role": "user", "content": PROMPT}], SamplingParams(temperature=0.8, max_new_tokens=2000, seed=1)
        )
        return {
            "options": res.options.to_dict(),
            "notices": res.notices,
            "unavailable": res.unavailable,
            "tokens": [len(t) for t in res.token_ids],
        }
    finally:
        del hog
        eng.close()


def _fused_check(folder: Path, progress: Callable[[str], None]) -> dict:
    from gpu.fused_check import fused_check

    return fused_check(folder, progress)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=255)
    p.add_argument("--model", default="smollm2-shaped", help="smollm2-shaped | tiny | a model folder or GGUF")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ladder-tokens", type=int, default=200, help="prompt + these stay in one 256-position bucket")
    p.add_argument(
        "--weight-shapes",
        default="llama-3.2-1b",
        help=f"the weights section's shapes, comma-separated: {', '.join(WEIGHT_SHAPES)} (8B: ~3 more minutes)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated, run in the fixed order (e.g. the ones a shorter run had to leave out)",
    )
    args = p.parse_args(argv)
    chosen = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    report = Report(args.out, args.budget_s, chosen)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gapless-gpu-"))
    found: dict[str, Path] = {}

    def model() -> dict:
        if args.model in ("smollm2-shaped", "tiny"):
            shape = SMOLLM2 if args.model == "smollm2-shaped" else TINY
            found["folder"] = make_model_folder(work / args.model, shape)
            return {"kind": args.model, "shape": shape, "weights": "random (seed 0)"}
        found["folder"] = Path(args.model)
        return {"kind": "path", "path": args.model}

    from engine.telemetry.machine import describe_machine

    # Most telling first: fp32 parity of every option (the CUDA graph and compiled paths included) and the
    # ladder; then the fallbacks and half precision, whose compiles the ladder's have mostly warmed up.
    try:
        report.section("machine", describe_machine)
        report.section("model", model)
        folder = found.get("folder")
        if folder is not None:
            report.section("nvml", probe_nvml, need_s=5, cuda=True)
            report.section("fused", lambda: _fused_check(folder, report.progress("fused")), need_s=150, cuda=True)
            report.section(
                "parity_fp32",
                lambda: parity(folder, device, "fp32", args.max_new_tokens, (1, 4), report, with_compile=cuda),
                need_s=60,
            )
            report.section(
                "ladder",
                lambda: ladder(folder, args.ladder_tokens, 16, 3, report.progress("ladder")),
                need_s=250,  # 171 s for 7 rungs on an H200; 10 now (fused, int8 and speculation each compile)
                cuda=True,
            )
            report.section("telemetry", lambda: telemetry(folder, args.out, device), need_s=60)
            report.section(
                "sdpa_first_use",
                lambda: sdpa_first_use(folder, report.progress("sdpa_first_use")),
                need_s=40,
                cuda=True,
            )
            report.section("kernels", lambda: kernels(folder, report.progress("kernels")), need_s=200, cuda=True)
            report.section("oom_fallback", lambda: oom_fallback(folder), need_s=40, cuda=True)
            for dtype in ("fp16", "bf16"):
                report.section(
                    f"parity_{dtype}",
                    lambda d=dtype: parity(
                        folder, device, d, args.max_new_tokens, (1,), report, with_compile=True, profile_window=False
                    ),
                    need_s=60,
                    cuda=True,
                )
            for dtype in ("fp16", "bf16"):
                report.section(f"logits_{dtype}", lambda d=dtype: logits_check(folder, device, d), need_s=60, cuda=True)
            report.section(
                "speculation", lambda: speculation(folder, report.progress("speculation")), need_s=120, cuda=True
            )
            shapes = [x.strip() for x in args.weight_shapes.split(",") if x.strip()]
            report.section(
                "weights", lambda: weight_formats(work, shapes, report.progress("weights")), need_s=200, cuda=True
            )
    except KeyboardInterrupt:
        report.data["interrupted"] = "stopped by the time limit; the sections above say how far each got"
    finally:
        report.write()
    failed = [k for k, v in report.data["sections"].items() if v.get("ok") is False]
    print("failed sections:", failed or "none")
    return 1 if failed or "interrupted" in report.data else 0


if __name__ == "__main__":
    sys.exit(main())
