"""Engine behaviour on tiny models: token-exact parity with transformers generate() for every kv_cache x
sampling combination, candidates, seeds, stop strings, cancel, option switches and the fallback path."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import greedy_continuation

from engine.engine import Engine
from engine.errors import GenerationError, OptionsError
from engine.protocol import EngineLike
from engine.types import EngineOptions, Progress, SamplingParams, StepRecord, TextDelta

MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]
CPU = EngineOptions(device="cpu")


def hf_greedy(path, prompt_ids: list[int], n: int) -> list[int]:
    """transformers generate(), greedy, from the same folder: the reference token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_continuation(model, prompt_ids, n, model.config.eos_token_id)


@pytest.fixture(scope="module")
def _llama_engine_once(tiny_llama):
    eng = Engine.load(str(tiny_llama), CPU)
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture
def llama_engine(_llama_engine_once):
    """The module's engine, back on the CPU defaults after every test, whether the test passed or not, so one
    failure does not change the options the next test starts from."""
    try:
        yield _llama_engine_once
    finally:
        _llama_engine_once.reconfigure(CPU)


def test_the_engine_is_what_the_app_needs(llama_engine):
    assert isinstance(llama_engine, EngineLike)


def prompt_ids(engine, messages=MESSAGES, max_new=32) -> list[int]:
    from engine.prompt import build_prompt

    return build_prompt(engine.tokenizer, messages, engine.context_length, max_new).ids


@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
@pytest.mark.parametrize("sampling", ["device", "host"])
def test_greedy_matches_transformers_generate(llama_engine, tiny_llama, kv, sampling):
    llama_engine.reconfigure(CPU.with_(kv_cache=kv, sampling=sampling))
    result = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=24))
    want = hf_greedy(tiny_llama, prompt_ids(llama_engine), 24)
    got = result.token_ids[0]
    # transformers stops at EOS too; compare up to what both produced
    assert got == want[: len(got)]
    assert len(got) == 24 or result.finish_reasons[0] == "eos"
    assert result.options.kv_cache == kv and result.options.sampling == sampling


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_fast_families_match_generate(tiny_factory, family):
    path = tiny_factory(family)
    eng = Engine.load(str(path), CPU)
    try:
        assert eng.info.backend == "fast"
        result = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=16))
        want = hf_greedy(path, prompt_ids(eng, max_new=16), 16)
        assert result.token_ids[0] == want[: len(result.token_ids[0])]
    finally:
        eng.close()


def test_fallback_path_matches_generate_and_reports_unavailable(tiny_factory):
    path = tiny_factory("gpt2")
    eng = Engine.load(str(path), CPU.with_(kv_cache="static", compile=True))
    try:
        assert eng.info.backend == "transformers"
        assert isinstance(eng, EngineLike)
        reasons = eng.unavailable()
        assert "fallback" in reasons["kv_cache"] and "fallback" in reasons["compile"]
        for kv in ("static", "none"):
            eng.reconfigure(CPU.with_(kv_cache=kv, compile=True))
            result = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=12))
            assert result.options.compile is False
            assert result.options.kv_cache == ("dynamic" if kv == "static" else "none")
            want = hf_greedy(path, prompt_ids(eng, max_new=12), 12)
            assert result.token_ids[0] == want[: len(result.token_ids[0])]
            assert "compile" in result.unavailable
    finally:
        eng.close()


def test_candidates_distinct_and_reproducible_with_seed(llama_engine):
    llama_engine.reconfigure(CPU.with_(candidates=4))
    params = SamplingParams(temperature=0.8, max_new_tokens=20, seed=1234)
    a = llama_engine.generate(MESSAGES, params)
    b = llama_engine.generate(MESSAGES, params)
    assert len(a.texts) == 4
    assert len(set(map(tuple, a.token_ids))) > 1, "candidates should differ under sampling"
    assert not any("candidates are one answer" in n for n in a.notices)
    assert a.token_ids == b.token_ids and a.texts == b.texts
    c = llama_engine.generate(MESSAGES, SamplingParams(temperature=0.8, max_new_tokens=20, seed=99))
    assert c.token_ids != a.token_ids


def test_tokens_per_step_is_one_without_speculation_when_candidates_end_apart(llama_engine):
    """A row that ended no longer counts its steps: the answer said 0.63 tok/step (kept tokens over all rows and
    every step) while its step records said 1.0, and nothing speculated."""
    llama_engine.reconfigure(CPU.with_(candidates=4))
    records: list[StepRecord] = []
    stop_early = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3, stop=("e",))
    r = llama_engine.generate(MESSAGES, stop_early, on_event=lambda e: isinstance(e, StepRecord) and records.append(e))
    assert len(set(r.metrics.new_tokens)) > 1  # the rows ended at different steps
    assert r.metrics.tokens_per_step == 1.0
    assert records and {rec.tokens_per_step for rec in records} <= {1.0, None}


@pytest.mark.parametrize("kv", ["static", "dynamic", "none"])
def test_candidates_under_greedy_equal_single(llama_engine, kv):
    llama_engine.reconfigure(CPU.with_(kv_cache=kv, candidates=1))
    single = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=16)).token_ids[0]
    llama_engine.reconfigure(CPU.with_(kv_cache=kv, candidates=3))
    multi = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=16))
    assert multi.token_ids == [single] * 3
    # said, as three copies of one answer were given without a word (the app then asked which to keep)
    assert (
        "the 3 candidates are one answer 3 times: greedy decoding (temperature 0) picks the same tokens in every "
        "row; raise the temperature for different ones"
    ) in multi.notices


def test_candidates_sampled_from_the_likeliest_token_alone_say_they_are_one_answer(llama_engine):
    """top-k 1 at a temperature that samples keeps one token a step: three copies came without a word."""
    llama_engine.reconfigure(CPU.with_(candidates=3))
    r = llama_engine.generate(MESSAGES, SamplingParams(temperature=0.8, top_k=1, max_new_tokens=16, seed=5))
    assert r.token_ids == [r.token_ids[0]] * 3
    assert (
        "the 3 candidates are one answer 3 times: top-k 1 keeps only the likeliest token, so sampling picks the "
        "same tokens in every row; raise top-k (0: off) for different ones"
    ) in r.notices


def test_same_seed_same_text_for_each_sampling_mode(llama_engine):
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.2, max_new_tokens=20, seed=7)
    for mode in ("device", "host"):
        llama_engine.reconfigure(CPU.with_(sampling=mode))
        a = llama_engine.generate(MESSAGES, params).token_ids
        b = llama_engine.generate(MESSAGES, params).token_ids
        assert a == b


def test_events_stream_the_text_and_steps(llama_engine):
    llama_engine.reconfigure(CPU)
    events = []
    result = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=30), on_event=events.append)
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta) and e.candidate == 0)
    assert streamed == result.texts[0]
    steps = [e for e in events if isinstance(e, StepRecord)]
    assert steps and steps[-1].tokens_total == len(result.token_ids[0])
    m = result.metrics
    assert m.prompt_tokens == len(prompt_ids(llama_engine))
    assert m.new_tokens == [len(result.token_ids[0])]
    assert m.ttft_ms > 0 and m.decode_tok_s > 0
    assert m.gpu_util_pct is None and "gpu_util_pct" in m.unavailable


def test_stop_string_cuts_the_text(llama_engine):
    llama_engine.reconfigure(CPU)
    free = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=40))
    text = free.texts[0]
    if len(text) < 6:
        pytest.skip("the tiny model's answer is too short to hold a stop string")
    stop = text[3:6]
    cut = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=40, stop=(stop,)))
    assert cut.finish_reasons == ["stop"]
    assert cut.texts[0] == text[: text.find(stop)]


def test_cancel_returns_what_it_had(llama_engine):
    llama_engine.reconfigure(CPU.with_(kv_cache="none"))
    cancel = threading.Event()
    seen = []

    def on_event(e):
        if isinstance(e, StepRecord):
            seen.append(e)
            cancel.set()

    result = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=200), on_event, cancel)
    assert result.finish_reasons == ["cancelled"]
    assert 1 <= len(result.token_ids[0]) < 200


def test_reconfigure_changes_dtype_without_reloading(llama_engine):
    llama_engine.reconfigure(CPU.with_(dtype="bf16"))
    assert llama_engine.info.dtype == "bf16"
    r = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=8))
    assert r.options.dtype == "bf16" and len(r.token_ids[0]) >= 1
    llama_engine.reconfigure(CPU)
    assert llama_engine.info.dtype == "fp32"


def test_cuda_graph_reported_unavailable_on_cpu(llama_engine):
    reasons = llama_engine.unavailable(CPU.with_(cuda_graph=True, kv_cache="dynamic", compile=True))
    assert "CUDA" in reasons["cuda_graph"]
    assert "static KV cache" in reasons["compile"]


def test_bad_sampling_params_are_refused():
    for bad in (
        dict(temperature=-1),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
        dict(max_new_tokens=0),
        dict(max_new_tokens=10**9),
        dict(repetition_penalty=0),
    ):
        with pytest.raises(OptionsError):
            SamplingParams(**bad).validate()
    for n in (0, 1000):
        with pytest.raises(OptionsError, match="candidates"):
            EngineOptions(candidates=n).validate()


def test_a_one_token_answer_says_why_its_decode_figures_are_na(llama_engine):
    r = llama_engine.generate(MESSAGES, SamplingParams(temperature=0.0, max_new_tokens=1))
    m = r.metrics
    assert m.new_tokens_total == 1 and m.ttft_ms is not None
    for key in ("decode_tok_s", "decode_seconds", "step_ms_p50", "step_ms_p99", "tokens_per_step"):
        f = m.figure(key)
        assert f.value is None and f.reason.startswith("no decode step ran"), key
    assert "no decode step was timed" in m.figure("dram_bw_util_pct").reason  # not "not on a GPU": a CPU estimate


def test_empty_prompt_is_refused(llama_engine):
    with pytest.raises(GenerationError):
        llama_engine.generate([{"role": "user", "content": "   "}], SamplingParams(max_new_tokens=4))


def test_long_prompt_is_cut_with_a_notice(llama_engine):
    long = [{"role": "user", "content": "the quick brown fox " * 40}, {"role": "assistant", "content": "ok"}] * 4
    long.append({"role": "user", "content": "hello"})
    result = llama_engine.generate(long, SamplingParams(temperature=0, max_new_tokens=16))
    assert result.notices, "the prompt does not fit a 256-token context, so a notice is expected"
    assert result.metrics.prompt_tokens + 16 <= llama_engine.context_length


def test_load_reports_progress(tiny_llama):
    seen: list[Progress] = []
    eng = Engine.load(str(tiny_llama), CPU, progress=seen.append)
    eng.close()
    assert any(p.stage == "load" for p in seen)


def test_without_compile_or_graph_there_is_no_compile_time(llama_engine):
    llama_engine.reconfigure(CPU)
    m = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=4)).metrics
    assert m.compile_seconds is None and "compile and CUDA graph off" in m.unavailable["compile_seconds"]


@pytest.mark.slow
def test_a_real_compile_reports_its_time_apart_from_ttft(tiny_llama):
    eng = Engine.load(str(tiny_llama), CPU.with_(kv_cache="static", compile=True))
    try:
        first = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=8)).metrics
        again = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=8)).metrics
    finally:
        eng.close()
    assert first.compile_seconds is not None and again.compile_seconds is not None
    assert first.compile_seconds > first.ttft_ms / 1e3  # the compile is not hidden in TTFT
    assert again.compile_seconds < first.compile_seconds  # compiled once, reused


def test_compile_failure_falls_back_to_eager_with_a_notice(llama_engine, monkeypatch):
    def broken_compile(fn, **kw):
        def step(*a, **k):
            raise RuntimeError("inductor exploded")

        return step

    llama_engine.reconfigure(CPU)
    want = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=10)).token_ids
    monkeypatch.setattr(torch, "compile", broken_compile)
    llama_engine._runners.clear()
    llama_engine.reconfigure(CPU.with_(compile=True))
    seen: list = []
    result = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=10), on_event=seen.append)
    assert result.options.compile is False
    assert "inductor exploded" in result.unavailable["compile"]
    # The warm-up before the first token (the failed compile, then eagerly) is its own figure, not part of TTFT.
    assert result.metrics.compile_seconds is not None and result.metrics.compile_seconds > 0
    last = [e for e in seen if isinstance(e, Progress)][-1]
    assert last.fraction == 1.0 and last.message == f"decode step warmed up in {result.metrics.compile_seconds:.1f} s"
    assert any("compile failed" in n for n in result.notices)
    assert result.token_ids == want
    # the step's compiled variants (dtype x candidates x bucket x sampler) are not capped at dynamo's default 8
    from engine.engine import RECOMPILE_LIMIT

    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT > 8
    llama_engine._runners.clear()
    llama_engine.reconfigure(CPU)


def test_out_of_memory_falls_back_to_fewer_candidates(llama_engine, memory_for_two_candidates):
    llama_engine.reconfigure(CPU.with_(candidates=8))
    result = llama_engine.generate(MESSAGES, SamplingParams(temperature=0.7, max_new_tokens=8, seed=1))
    assert result.options.candidates == 2 and len(result.texts) == 2
    assert any("out of device memory with 8 candidates" in n for n in result.notices)
    assert any("with 4 candidates" in n for n in result.notices)
    llama_engine.reconfigure(CPU)


class StepAsCaptured:
    """A captured CUDA graph's stand-in on the CPU: each replay runs what the capture records, the decode step as
    a function of the runner's buffers over one context bucket (`StaticRunner.bucket_step`), eagerly."""

    def __init__(self, runner, bucket, kind, k=None):
        self.runner, self.bucket, self.kind, self.k, self.replays = runner, bucket, kind, k, 0

    def replay(self):
        self.replays += 1
        self.runner.bucket_step(self.bucket, self.kind, self.k)


def graphs_on_cpu(monkeypatch) -> list[StepAsCaptured]:
    """CUDA graphs on the CPU: the engine offers them with the static cache, as on a GPU, and each capture
    records a StepAsCaptured, into the list returned."""
    from engine.decode import StaticRunner

    captured: list[StepAsCaptured] = []

    def capture(self, bucket, kind, k=None):
        captured.append(StepAsCaptured(self, bucket, kind, k))
        self.graphs[self._graph_key(bucket, kind, k)] = captured[-1]

    real_unavailable = Engine.unavailable

    def unavailable(self, options=None):
        out = real_unavailable(self, options)
        if (options or self.options).kv_cache == "static":
            out.pop("cuda_graph", None)
        return out

    monkeypatch.setattr(StaticRunner, "_capture", capture)
    monkeypatch.setattr(Engine, "unavailable", unavailable)
    return captured


def test_the_graph_step_matches_transformers_across_buckets_and_stops_when_switched_off(tiny_factory, monkeypatch):
    path = tiny_factory("llama", max_position_embeddings=1024)
    captured = graphs_on_cpu(monkeypatch)
    eng = Engine.load(str(path), CPU.with_(cuda_graph=True))
    try:
        n = 300  # prompt + 300 positions cross the first 256-position bucket
        greedy = SamplingParams(temperature=0, max_new_tokens=n)
        res = eng.generate(MESSAGES, greedy)
        assert res.options.cuda_graph and res.finish_reasons == ["length"]
        assert sorted(g.bucket for g in captured) == [256, 512]  # captured before the prefill, one per bucket
        assert all(g.replays > 0 for g in captured)
        assert sum(g.replays for g in captured) == n - 1  # every decode step after the prefill's token
        assert res.token_ids[0] == hf_greedy(path, prompt_ids(eng, max_new=n), n)

        eng.reconfigure(CPU)  # graphs off: the runner keeps them but runs its eager step
        replays = sum(g.replays for g in captured)
        again = eng.generate(MESSAGES, greedy)
        assert not again.options.cuda_graph and sum(g.replays for g in captured) == replays
        assert again.token_ids == res.token_ids
    finally:
        eng.close()


def test_a_step_record_is_all_traced_or_all_untraced(llama_engine, monkeypatch):
    """A record covering the window's edge was marked traced whole, its mean step time the traced steps' (the
    HUD's step latency read 59.5 ms beside a p50 of 0.45 ms); records now split at the window's edges."""
    from engine import observers

    monkeypatch.setattr(observers, "FLUSH_INTERVAL_S", 1.0)  # few flushes: each covers many steps
    llama_engine.reconfigure(CPU)
    events: list = []
    res = llama_engine.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=40), on_event=events.append)
    records = [e for e in events if isinstance(e, StepRecord)]
    m = res.metrics
    assert m.profiled_steps == 8
    covered = [(r, r.step - prev) for r, prev in zip(records, [0] + [r.step for r in records])]
    assert sum(n for r, n in covered if r.profiled) == m.profiled_steps
    assert sum(n for _, n in covered) == m.decode_steps
    assert [r.t for r in records] == sorted(r.t for r in records)


def test_a_window_that_could_not_trace_leaves_no_steps_out(llama_engine):
    """Another profiler running: the window traces nothing, so no step is left out of tok/s or the step
    percentiles, none is marked traced, and the gap says why it is n/a."""
    llama_engine.reconfigure(CPU)
    records: list[StepRecord] = []
    params = SamplingParams(temperature=0, max_new_tokens=30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        res = llama_engine.generate(
            MESSAGES, params, on_event=lambda e: records.append(e) if isinstance(e, StepRecord) else None
        )
    m = res.metrics
    assert m.decode_steps == len(res.token_ids[0]) - 1 >= 20
    assert m.profiled_steps == 0 and not any(r.profiled for r in records)
    assert m.kernel_gap_pct is None
    assert m.unavailable["kernel_gap_pct"] == "window not traced: another torch profiler is running in this process"
    assert m.launches_per_step is None and m.unavailable["launches_per_step"] == m.unavailable["kernel_gap_pct"]
    assert m.decode_tok_s == pytest.approx(m.decode_steps / m.decode_seconds)
    traced = llama_engine.generate(MESSAGES, params).metrics  # and without the other profiler, the window runs
    assert traced.profiled_steps == 8 and traced.kernel_gap_pct is not None
    # a 2-layer decoder step is dozens of aten ops (embedding, per layer norms, projections, rope, attention, ...)
    assert traced.launches_per_step >= 20 and traced.launches_per_step == int(traced.launches_per_step * 8) / 8
    from engine import cpu_kernels  # the engine's own CPU kernels count as ops beside torch's where they run

    counted = "aten ops" if cpu_kernels.kernel() is None else "aten and own-kernel ops"
    assert traced.launches_per_step_source == f"{counted} per step — torch.profiler CPU ops, 8-step window (sampled)"
    assert traced.decode_tok_s == pytest.approx((traced.decode_steps - 8) / traced.decode_seconds)


def test_a_fast_family_model_on_the_fallback_says_why(tmp_path):
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "dynamic-rope", "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    eng = Engine.load(str(path), CPU.with_(compile=True))
    try:
        info = eng.info
        assert info.backend == "transformers"
        assert info.backend_reason == "rope type 'dynamic' is not on the fast path"
        assert eng.unavailable()["compile"] == (
            "llama runs on the transformers fallback (rope type 'dynamic' is not on the fast path), which is not compiled"
        )
    finally:
        eng.close()


def test_a_gemma3_model_answers_as_transformers_in_every_cache_mode_and_with_drafts(tiny_factory):
    """Gemma-3 on the engine's decoder: greedy tokens equal transformers' generate() past the sliding window
    (8 positions in the tiny model), for each cache mode, candidates and n-gram speculation's verify step."""
    path = tiny_factory("gemma3_text")
    eng = Engine.load(str(path), CPU.with_(dtype="fp32", profile_window=False))
    try:
        assert eng.info.backend == "fast"
        want = hf_greedy(path, prompt_ids(eng, max_new=20), 20)
        for opts in (
            {},
            {"kv_cache": "dynamic"},
            {"kv_cache": "none"},
            {"candidates": 2},
            {"speculation": "ngram", "draft_tokens": 3},
        ):
            eng.reconfigure(CPU.with_(dtype="fp32", profile_window=False, **opts))
            result = eng.generate(MESSAGES, SamplingParams(temperature=0, max_new_tokens=20))
            assert result.unavailable == {}, opts
            for row in result.token_ids:
                assert row == want[: len(row)] and len(row) > 8, opts
    finally:
        eng.close()


HELLO = [{"role": "user", "content": "hello world"}]


@pytest.mark.parametrize(
    "options",
    [
        CPU,
        CPU.with_(kv_cache="dynamic"),
        CPU.with_(kv_cache="none"),
        CPU.with_(candidates=2),
        CPU.with_(prefix_reuse=False),
    ],
)
def test_nan_scores_are_an_error_not_an_answer_of_token_0(tiny_llama, options):
    """Damaged weights (or a dtype that overflows) make NaN logits, which greedy sampling turns into token 0 over
    and over. The answer is refused with the reason instead; the weights mended, the engine answers as before."""
    eng = Engine.load(str(tiny_llama), options)
    try:
        want = eng.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=6)).token_ids
        weight = eng.model.layers[0].feed_forward.w2.weight
        kept = weight[0, 0].item()
        weight[0, 0] = float("nan")
        with pytest.raises(GenerationError, match="scored the first token with NaN or infinite values"):
            eng.generate([{"role": "user", "content": "the quick brown fox"}], SamplingParams(temperature=0.0))
        weight[0, 0] = kept
        assert eng.generate(HELLO, SamplingParams(temperature=0.0, max_new_tokens=6)).token_ids == want
    finally:
        eng.close()


def test_the_context_is_counted_while_the_weights_are_placed_again(tiny_llama):
    """The app counts the conversation against the context while a switch of weights or dtype rebuilds the model
    (the count runs without the engine lock): the context length comes from the config, not the placed model."""
    eng = Engine.load(str(tiny_llama), CPU)
    try:
        placed, eng.model = eng.model, None  # as _build_model leaves it until the new model is placed
        use = eng.measure_prompt(HELLO, 16)
        assert use.context_length == 256 and use.tokens > 0 and not use.refused
        eng.model = placed
    finally:
        eng.close()


def test_an_answer_in_the_plain_format_ends_at_the_next_turn_label(tmp_path):
    """A model without a chat template is asked in the plain format ("User: ...\n\nAssistant:"); the user's turn it
    wrote after its answer was kept in the answer, and read back as the assistant's words the next turn."""
    from tiny_models import make_bigram_model

    label = "\n\nUser:"  # one token of this model, so that a model of token pairs can write it
    path = make_bigram_model(tmp_path / "m", {":": ".", ".": label, label: "."}, added=(label,))
    engine = Engine.load(str(path), EngineOptions(device="cpu", dtype="fp32", profile_window=False))
    question = [{"role": "user", "content": "How are you?"}]
    r = engine.generate(question, SamplingParams(temperature=0, max_new_tokens=8))
    assert (r.texts, r.finish_reasons) == (["."], ["stop"])
    raw = engine.generate(question, SamplingParams(temperature=0, max_new_tokens=8), raw=True)  # sent as it is
    assert raw.finish_reasons == ["length"] and label in raw.texts[0]
