"""The `kernels` option end to end on tiny models, the fused kernels through Triton's interpreter: the same tokens
as the torch kernels (greedy and sampled, one row and candidates), what is reported when the fused kernels cannot
serve, and the fall back to the torch kernels, with a notice, when a kernel fails."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine import figures  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import OptionsError  # noqa: E402
from engine.kernels import INTERPRET_ENV, interpreting, launch  # noqa: E402
from engine.types import PRESET_LABELS, PRESETS, EngineOptions, SamplingParams, preset_options  # noqa: E402

pytestmark = pytest.mark.skipif(
    not interpreting(),
    reason="these run the kernels through Triton's interpreter "
    "(GAPLESS_TRITON_INTERPRET=1, set by conftest on a machine without CUDA)",
)

MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]
TORCH = EngineOptions(device="cpu", dtype="fp32")
FUSED = TORCH.with_(kernels="fused")
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def qwen2_engine(tiny_factory):
    eng = Engine.load(str(tiny_factory("qwen2")), TORCH)
    yield eng
    eng.close()


def run(engine: Engine, options: EngineOptions, sampling: SamplingParams = GREEDY):
    engine.reconfigure(options)
    return engine.generate(MESSAGES, sampling)


def test_fused_greedy_and_sampled_tokens_equal_the_torch_kernels(qwen2_engine):
    for sampling in (GREEDY, SamplingParams(temperature=0.9, top_k=40, max_new_tokens=8, seed=3)):
        want = run(qwen2_engine, TORCH, sampling)
        got = run(qwen2_engine, FUSED, sampling)
        assert got.options.kernels == "fused" and got.unavailable == {}
        assert got.token_ids == want.token_ids
        assert got.to_dict()["options"]["kernels"] == "fused"
    status = qwen2_engine.fused_status()
    assert status == {"pdl": False, "pdl_reason": "Programmatic Dependent Launch is a CUDA feature (Hopper and newer)"}


def test_the_fused_status_outlives_its_runner_s_eviction(qwen2_engine):
    """The runner cache keeps MAX_RUNNERS runners: after two answers on other caches the fused runner was evicted,
    and fused_status() said None, as before any fused answer ran."""
    from engine.engine import MAX_RUNNERS

    run(qwen2_engine, FUSED)
    status = qwen2_engine.fused_status()
    assert status == {"pdl": False, "pdl_reason": "Programmatic Dependent Launch is a CUDA feature (Hopper and newer)"}
    for options in (TORCH, TORCH.with_(kv_cache="dynamic"), TORCH.with_(kv_cache="none"))[:MAX_RUNNERS]:
        run(qwen2_engine, options)
    assert all(key[2] != "fused" for key in qwen2_engine._runners)  # evicted
    assert qwen2_engine.fused_status() == status


def test_a_pdl_failure_is_not_tried_again_by_a_runner_made_after_an_eviction(tiny_factory, monkeypatch):
    """A fused step that failed with Programmatic Dependent Launch ran without it, but a fused runner made once the
    runner cache had evicted that one asked the device again: PDL was tried, failed and captured again on every
    new runner (each a compile and a logged failure), while fused_status() kept the failure."""
    from engine.engine import MAX_RUNNERS
    from engine.kernels import runner as fused_runner

    monkeypatch.setattr(fused_runner, "pdl_status", lambda _device: (True, "on (faked for the test)"))
    tried: list[bool] = []
    real = launch.qkv_rope

    def no_pdl_here(*args, **kwargs):
        pdl = args[15]  # qkv_rope(..., eps, use_pdl)
        if pdl:
            tried.append(True)
            raise RuntimeError("launch_pdl is not supported here")
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "qkv_rope", no_pdl_here)
    eng = Engine.load(str(tiny_factory("qwen2")), TORCH)
    try:
        want = run(eng, TORCH).token_ids
        got = run(eng, FUSED)
        failed = {"pdl": False, "pdl_reason": "failed here: RuntimeError: launch_pdl is not supported here"}
        assert got.options.kernels == "fused" and got.token_ids == want
        assert eng.fused_status() == failed and tried == [True]
        for options in (TORCH.with_(kv_cache="dynamic"), TORCH.with_(kv_cache="none"))[:MAX_RUNNERS]:
            run(eng, options)
        assert all(key[2] != "fused" for key in eng._runners)  # evicted
        for options in (FUSED, FUSED.with_(candidates=2)):  # a runner made again, and one for another batch
            got = run(eng, options)
            assert got.options.kernels == "fused" and got.token_ids[0] == want[0]
            assert eng.fused_status() == failed
        assert tried == [True]
    finally:
        eng.close()


def test_fused_candidates_equal_the_single_row(qwen2_engine):
    single = run(qwen2_engine, FUSED).token_ids[0]
    both = run(qwen2_engine, FUSED.with_(candidates=2))
    assert both.token_ids == [single, single]


def test_fused_implies_the_static_cache_and_replaces_compile(qwen2_engine):
    eff, reasons = qwen2_engine.effective(FUSED.with_(kv_cache="dynamic", compile=True))
    assert (eff.kernels, eff.kv_cache, eff.compile) == ("fused", "static", False)
    assert "static KV cache" in reasons["kv_cache"]
    assert reasons["compile"] == "the fused kernels replace the compiled decode step"


def test_the_fused_kernels_warm_up_is_the_answer_s_compile_figure(tiny_factory):
    """The fused step's warm-up (its kernels' first launches, and its capture with graphs on) was left out of the
    compile figure, which read n/a as "compile and CUDA graph off: nothing is compiled or captured"."""
    from engine.types import Progress

    eng = Engine.load(str(tiny_factory("qwen2")), TORCH)
    try:
        eng.reconfigure(FUSED)
        said: list[Progress] = []
        m = eng.generate(
            MESSAGES, GREEDY, on_event=lambda e: said.append(e) if isinstance(e, Progress) else None
        ).metrics
        # its last word says it is done ("compiling the fused kernels" stayed in the panel after the answer)
        assert said[-1].fraction == 1.0 and said[-1].message.startswith("fused kernels compiled in ")
        assert m.compile_seconds is not None and m.compile_seconds > 0
        assert "compile_seconds" not in m.unavailable
        assert m.figure("compile_seconds").source == figures.spec("compile_seconds").source
        eager = run(eng, TORCH).metrics  # the torch kernels, eager: nothing compiled, and said so
        assert eager.compile_seconds is None and "nothing is compiled" in eager.unavailable["compile_seconds"]
    finally:
        eng.close()


def test_without_the_interpreter_fused_is_unavailable_on_the_cpu_and_the_answer_still_comes(qwen2_engine, monkeypatch):
    want = run(qwen2_engine, TORCH).token_ids
    monkeypatch.delenv(INTERPRET_ENV)
    got = run(qwen2_engine, FUSED.with_(kv_cache="dynamic"))
    assert got.options.kernels == "torch" and got.options.kv_cache == "dynamic"
    assert "Triton GPU kernels" in got.unavailable["kernels"] and INTERPRET_ENV in got.unavailable["kernels"]
    assert got.token_ids == want


def test_a_kernel_that_fails_falls_back_to_the_torch_kernels_with_a_notice(tiny_factory, monkeypatch):
    eng = Engine.load(str(tiny_factory("llama")), TORCH)
    try:
        want = run(eng, TORCH).token_ids

        def broken(*_a, **_k):
            raise RuntimeError("PassManager::run failed")

        monkeypatch.setattr(launch, "qkv_rope", broken)
        got = run(eng, FUSED)
        assert got.options.kernels == "torch" and got.token_ids == want
        assert any("fused kernels failed" in n for n in got.notices)
        assert "RuntimeError: PassManager::run failed" in got.unavailable["kernels"]
        again = run(eng, FUSED)  # not tried again on this engine; reported as unavailable
        assert again.options.kernels == "torch" and "failed here" in again.unavailable["kernels"]
        assert again.token_ids == want
    finally:
        eng.close()


def test_speculation_is_refused_for_the_fused_kernels_only_where_they_run(qwen2_engine, monkeypatch):
    """With the fused kernels refused (here: no interpreter on a CPU) the torch kernels ran, and n-gram speculation
    was still switched off "for the fused kernels"."""
    spec = EngineOptions(device="cpu", dtype="fp32", speculation="ngram")
    assert "no verify step for drafts" in qwen2_engine.unavailable(spec.with_(kernels="fused"))["speculation"]
    monkeypatch.delenv(INTERPRET_ENV)
    got = run(qwen2_engine, spec.with_(kernels="fused"))
    assert got.options.kernels == "torch" and got.options.speculation == "ngram"
    assert "speculation" not in got.unavailable and "kernels" in got.unavailable


def test_int4_refused_leaves_the_fused_kernels_serving_the_model_s_own_weights(tiny_factory):
    """int4 refused on this model (its inputs not in groups of 32) runs the native weights, and the fused kernels
    were refused "for int4 weights" all the same."""
    eng = Engine.load(str(tiny_factory("llama", hidden_size=72, intermediate_size=144)), TORCH)
    try:
        got = run(eng, FUSED.with_(weights="int4"))
        assert "int4 needs inputs in groups of 32" in got.unavailable["weights"]
        assert got.options.weights == "native" and got.options.kernels == "fused" and "kernels" not in got.unavailable
        assert got.token_ids == run(eng, TORCH).token_ids
    finally:
        eng.close()


def test_kernels_option_validation_preset_and_cli():
    with pytest.raises(OptionsError, match="kernels must be one of torch, fused"):
        EngineOptions(kernels="cuda").validate()
    assert EngineOptions.from_dict(FUSED.to_dict()) == FUSED
    names = list(PRESETS)
    assert names.index("fused") == names.index("cuda-graph") + 1 and PRESET_LABELS["fused"] == "+ fused kernels"
    p = preset_options("fused", EngineOptions(device="cuda"))
    assert (p.kernels, p.kv_cache, p.cuda_graph, p.compile, p.dtype) == ("fused", "static", True, False, "fp16")

    from app.cli import build_parser
    from app.cmd_generate import options_from_args

    args = build_parser().parse_args(["generate", "--prompt", "x", "--kernels", "fused", "--kv", "static"])
    assert options_from_args(args).kernels == "fused"
    args = build_parser().parse_args(["generate", "--prompt", "x", "--preset", "fused", "--kernels", "torch"])
    assert options_from_args(args).kernels == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kernels", "cuda"])


def test_bench_plans_the_fused_rung_and_fused_candidates(qwen2_engine, monkeypatch):
    from engine.ladder import BenchConfig, plan_rung, validate

    base = EngineOptions(device="cpu")
    opts, skip, _ = plan_rung(qwen2_engine, "fused", base, "cpu", BenchConfig(device="cpu"))
    assert opts is None and "cuda_graph: CUDA graphs need a CUDA device" in skip
    config = BenchConfig(device="cpu", kernels="fused")
    opts, skip, notes = plan_rung(qwen2_engine, "candidates", base, "cpu", config)
    assert skip is None and (opts.kernels, opts.compile, opts.cuda_graph) == ("fused", False, False)
    assert notes == ["without cuda_graph: CUDA graphs need a CUDA device; this machine runs on the CPU"]
    monkeypatch.delenv(INTERPRET_ENV)
    opts, skip, notes = plan_rung(qwen2_engine, "candidates", base, "cpu", config)
    assert skip is None and opts.kernels == "torch" and notes[0].startswith("without fused kernels: the fused kernels")
    with pytest.raises(OptionsError, match="kernels must be"):
        validate(BenchConfig(kernels="cuda"))


def test_a_reused_prefix_survives_the_fused_warm_up(tiny_factory):
    """A follow-up that reuses the cached prompt and samples (a new sampler kind: the fused step is warmed up again,
    writing at position 0) gives the torch kernels' tokens for the same two turns."""

    def two_turns(options: EngineOptions):
        eng = Engine.load(str(tiny_factory("qwen2")), options)
        try:
            first = eng.generate(MESSAGES, GREEDY)
            follow = MESSAGES + [
                {"role": "assistant", "content": first.texts[0]},
                {"role": "user", "content": "the lazy dog"},
            ]
            second = eng.generate(follow, SamplingParams(temperature=0.8, max_new_tokens=6, seed=5))
            cache = eng._runners[("static", 1, options.kernels)].cache
            return first, second, [k[:, :, : second.metrics.prompt_tokens].clone() for k in cache.k]
        finally:
            eng.close()

    (t1, t2, t_keys), (f1, f2, f_keys) = two_turns(TORCH), two_turns(FUSED)
    assert f2.options.kernels == "fused" and f2.metrics.prompt_reused_tokens > 0
    assert f2.metrics.prompt_reused_tokens == t2.metrics.prompt_reused_tokens
    for a, b in zip(f_keys, t_keys):  # the prompt's keys, the reused ones included, as the torch path holds them
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (f1.token_ids, f2.token_ids) == (t1.token_ids, t2.token_ids)


def test_a_gemma3_model_runs_the_torch_kernels_and_says_why(tiny_factory):
    eng = Engine.load(str(tiny_factory("gemma3_text")), TORCH)
    try:
        want = run(eng, TORCH).token_ids
        got = run(eng, FUSED)
        assert got.options.kernels == "torch" and "sliding-window" in got.unavailable["kernels"]
        assert got.token_ids == want
    finally:
        eng.close()
