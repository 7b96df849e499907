"""The whole GPU check in one run: token-exact parity of every option combination against eager, the ladder of
presets with the transformers baselines, NVML/GPM probing, kernel-gap figures and the out-of-memory fallback.

    python tests/gpu/gpu_check.py --out "$OUT" [--budget-s 420] [--model PATH|smollm2-shaped|tiny]

Writes OUT/gpu_check.json after every section, so a run stopped by its time limit still reports what it did.
The device machine has no network and a small transfer limit, so by default the model is SmolLM2-135M's exact
architecture (30 layers, 576 wide, GQA 9/3, 49152 vocab) with random weights: speed, kernel gaps and parity do
not depend on the weights' values. On a CPU machine every CUDA section is recorded as skipped with the reason.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
PROMPT = "Explain in two sentences why small language models are often slow on large GPUs."


def make_word_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` synthetic words: any token id decodes, so random weights stream text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
    )
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


TINY = dict(SMOLLM2, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


class Report:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.perf_counter(), budget_s
        self.data: dict[str, Any] = {"sections": {}, "started_unix": time.time()}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, fn: Callable[[], Any], need_s: float = 0.0, cuda: bool = False) -> None:
        if cuda and not torch.cuda.is_available():
            self.data["sections"][name] = {"skipped": "no CUDA device on this machine"}
        elif self.left() < need_s:
            self.data["sections"][name] = {"skipped": f"time budget: {self.left():.0f}s left, needs ~{need_s:.0f}s"}
        else:
            t = time.perf_counter()
            try:
                result = fn()
                self.data["sections"][name] = {"ok": True, "seconds": time.perf_counter() - t, "result": result}
            except Exception as exc:  # a check script records every failure and goes on to the next section
                self.data["sections"][name] = {"ok": False, "seconds": time.perf_counter() - t,
                                               "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: "
              f"{ {k: v for k, v in self.data['sections'][name].items() if k in ('ok', 'skipped', 'error', 'seconds')} }",
              flush=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.t0
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))


def option_grid(device: str, candidates: tuple[int, ...]):
    from engine.types import EngineOptions

    for kv, sampling, compiled, graph, n in itertools.product(
        ("static", "dynamic", "none"), ("device", "host"), (False, True), (False, True), candidates
    ):
        if kv != "static" and (compiled or graph):
            continue  # compile and graphs need the static cache (reported unavailable otherwise)
        if graph and device != "cuda":
            continue
        yield EngineOptions(device=device, kv_cache=kv, sampling=sampling, compile=compiled, cuda_graph=graph, candidates=n)


def parity(folder: Path, device: str, dtype: str, max_new: int, candidates: tuple[int, ...], report: Report,
           with_compile: bool) -> dict:
    """Every option combination against the eager reference (dynamic cache, host sampling) in the same dtype."""
    from engine.bench import matching_prefix
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    msgs = [{"role": "user", "content": PROMPT}]
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new)
    eng = Engine.load(str(folder), EngineOptions(device=device, dtype=dtype, kv_cache="dynamic", sampling="host"))
    try:
        ref = eng.generate(msgs, greedy).token_ids[0]
        rows = []
        for opts in option_grid(device, candidates):
            if opts.compile and not with_compile:
                continue
            if report.left() < 30:
                rows.append({"options": opts.to_dict(), "skipped": "time budget"})
                continue
            eng.reconfigure(opts.with_(dtype=dtype))
            t = time.perf_counter()
            res = eng.generate(msgs, greedy)
            got = res.token_ids
            prefix = [matching_prefix(r, ref) for r in got]
            rows.append({
                "options": res.options.to_dict(), "unavailable": res.unavailable, "notices": res.notices,
                "identical": all(r == ref for r in got), "matching_prefix": prefix, "tokens": [len(r) for r in got],
                "decode_tok_s": res.metrics.decode_tok_s, "kernel_gap_pct": res.metrics.kernel_gap_pct,
                "seconds_with_warmup": time.perf_counter() - t,
            })
        logits = first_step_logits(eng, dtype) if device == "cuda" else None
        return {"dtype": dtype, "reference_tokens": len(ref), "all_identical": all(r.get("identical", False) for r in rows if "skipped" not in r),
                "first_step_logits": logits, "rows": rows}
    finally:
        eng.close()


def first_step_logits(eng, dtype: str) -> dict:
    """Max |logit difference| of the first decode step: compiled static step vs eager model, same dtype."""
    from engine.decode import StaticRunner
    from engine.sampling import SamplerKind

    g = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)
    prompt = torch.randint(3, eng.config.vocab_size, (40,), device=eng.device, generator=None)
    out = {}
    with torch.inference_mode():
        eager = StaticRunner(eng.model, 1, 256, eng.eos_ids, eng.device, eng.model.tok_embeddings.weight.dtype)
        eager.prefill(prompt, g)
        logits_e = eng.model(eager.tok, eager.pos, eager.cache, torch.arange(256, device=eng.device)[None, :] <= eager.pos[:, None])[:, -1]
        compiled_model = torch.compile(eng.model, dynamic=False)
        other = StaticRunner(eng.model, 1, 256, eng.eos_ids, eng.device, eng.model.tok_embeddings.weight.dtype)
        other.prefill(prompt, g)
        logits_c = compiled_model(other.tok, other.pos, other.cache, torch.arange(256, device=eng.device)[None, :] <= other.pos[:, None])[:, -1]
        diff = (logits_e - logits_c).abs().max().item()
        scale = logits_e.abs().max().item()
        tol = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}[dtype]
        out = {"max_abs_diff": diff, "max_abs_logit": scale, "tolerance": tol, "within": diff <= tol}
    return out


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
    return {"unavailable": mon.unavailable, "summary": summary, "samples": len(samples),
            "last_sample": samples[-1].__dict__ if samples else None, "peak_dram_bw_bytes_s": mon.peak_dram_bw_bytes_s}


def ladder(folder: Path, max_new: int, candidates: int, repeats: int) -> dict:
    from engine.bench import BenchConfig, run_suite

    cfg = BenchConfig(model=str(folder), device="cuda", max_new_tokens=max_new, repeats=repeats,
                      candidates=candidates, baseline=True, compile=True, prompt=PROMPT)
    return run_suite(cfg, progress=lambda m: print("  ", m, flush=True), command=sys.argv)


def oom_fallback(folder: Path) -> dict:
    """Fill the GPU so a 32-candidate CUDA-graph generation cannot fit; the engine must fall back with notices."""
    from engine.engine import Engine
    from engine.types import EngineOptions, SamplingParams

    eng = Engine.load(str(folder), EngineOptions(device="cuda", dtype="fp16", cuda_graph=True, candidates=32))
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - (600 << 20)), dtype=torch.uint8, device="cuda")  # leave ~600 MB
    try:
        res = eng.generate([{"role": "user", "content": PROMPT}], SamplingParams(temperature=0.8, max_new_tokens=2000, seed=1))
        return {"options": res.options.to_dict(), "notices": res.notices, "unavailable": res.unavailable,
                "tokens": [len(t) for t in res.token_ids]}
    finally:
        del hog
        eng.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--model", default="smollm2-shaped", help="smollm2-shaped | tiny | a model folder or GGUF")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ladder-tokens", type=int, default=256)
    args = p.parse_args(argv)
    report = Report(args.out, args.budget_s)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gapless-gpu-"))

    from engine.telemetry.machine import describe_machine

    report.section("machine", describe_machine)
    if args.model in ("smollm2-shaped", "tiny"):
        shape = SMOLLM2 if args.model == "smollm2-shaped" else TINY
        folder = make_model_folder(work / args.model, shape)
        report.data["model"] = {"kind": args.model, "shape": shape, "weights": "random (seed 0)"}
    else:
        folder = Path(args.model)
        report.data["model"] = {"kind": "path", "path": str(folder)}
    report.section("nvml", probe_nvml, need_s=5, cuda=True)
    report.section("parity_fp32", lambda: parity(folder, device, "fp32", args.max_new_tokens, (1, 4), report, with_compile=cuda), need_s=60)
    report.section("ladder", lambda: ladder(folder, args.ladder_tokens, 16, 3), need_s=120, cuda=True)
    report.section("parity_fp16", lambda: parity(folder, device, "fp16", args.max_new_tokens, (1, 4), report, with_compile=True), need_s=90, cuda=True)
    report.section("parity_bf16", lambda: parity(folder, device, "bf16", args.max_new_tokens, (1,), report, with_compile=True), need_s=90, cuda=True)
    report.section("oom_fallback", lambda: oom_fallback(folder), need_s=40, cuda=True)
    report.write()
    failed = [k for k, v in report.data["sections"].items() if v.get("ok") is False]
    print("failed sections:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
