"""Speculative decoding on tiny models: greedy tokens identical to plain decoding for every fast family and draft
length, EOS and max_new_tokens inside an accepted run, the sampling distribution unchanged (a chi-square test with
a control that it can fail), the draft-model path and its refusal of a mismatched pair, the options and flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from engine.engine import Engine
from engine.errors import OptionsError
from engine.sampling import SamplerKind, SamplerState
from engine.speculative import AdaptiveK, NgramProposer, ngram_propose_tensor, verify, vocabulary_mismatch
from engine.types import EngineOptions, SamplingParams, StepRecord, describe_options

CPU = EngineOptions(device="cpu")
REPEATS = [
    {
        "role": "user",
        "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
        "the quick brown fox jumps over the lazy dog.",
    }
]
PLAIN = [{"role": "user", "content": "Paris is the capital of France."}]
GREEDY = SamplingParams(temperature=0, max_new_tokens=40)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_engine(request, tiny_factory):
    eng = Engine.load(str(tiny_factory(request.param)), CPU)
    yield eng
    eng.close()


def generate(eng: Engine, messages, sampling, **options):
    eng.reconfigure(CPU.with_(**options))
    return eng.generate(messages, sampling)


# ---- options and flags ------------------------------------------------------------------------------------


def test_options_validate_and_round_trip():
    o = EngineOptions(speculation="draft", draft_tokens=7, draft_model="/m/small.gguf").validate()
    assert EngineOptions.from_dict(o.to_dict()) == o
    assert o.to_dict()["speculation"] == "draft" and o.to_dict()["draft_tokens"] == 7
    # described in a few words: the draft model by its file name, the draft settings only where they draft
    assert describe_options(o).endswith("speculation draft · draft tokens 7 · draft model small.gguf")
    assert "draft" not in describe_options(o.with_(speculation="off"))
    assert describe_options(o.with_(speculation="ngram")).endswith("speculation ngram · draft tokens 7")
    for bad, needle in [
        (dict(speculation="lookahead"), "speculation must be one of off, ngram, draft"),
        (dict(draft_tokens=16), "between 1 and 15 (0 = adaptive), got 16"),
        (dict(draft_tokens=-1), "got -1"),
        (dict(draft_tokens=True), "must be an integer"),
        (dict(draft_model=None), "draft_model must be a path"),
    ]:
        with pytest.raises(OptionsError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            EngineOptions(**bad).validate()


def test_cli_flags_reach_the_options(tmp_path, monkeypatch):
    from app.cli import build_parser
    from app.cmd_generate import options_from_args

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--speculation", "ngram", "--draft-tokens", "auto"])
    assert options_from_args(args).speculation == "ngram" and options_from_args(args).draft_tokens == 0
    small = tmp_path / "small.gguf"
    draft = ["generate", "--prompt", "x", "--speculation", "draft", "--draft-tokens", "5", "--draft-model", str(small)]
    with pytest.raises(OptionsError, match=f"--draft-model {small}: no such file or folder"):
        options_from_args(parser.parse_args(draft))  # refused before any model loads
    long = tmp_path / ("c" * 300 + ".gguf")  # a traceback, as for a folder the user may not open
    with pytest.raises(OptionsError, match=r"--draft-model .*: cannot read: File name too long"):
        options_from_args(parser.parse_args([*draft[:-1], str(long)]))
    small.write_bytes(b"GGUF")
    o = options_from_args(parser.parse_args(draft))
    assert (o.speculation, o.draft_tokens, o.draft_model) == ("draft", 5, str(small))
    with pytest.raises(OptionsError, match="--speculation draft needs --draft-model PATH"):
        options_from_args(parser.parse_args(["generate", "--prompt", "x", "--speculation", "draft"]))
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ as the loader reads it (--draft-model=~/... is not the shell's)
    home = parser.parse_args(["generate", "--prompt", "x", "--speculation", "draft", "--draft-model=~/small.gguf"])
    assert options_from_args(home).draft_model == "~/small.gguf"
    for outside in ("20", "0", "many"):  # refused as the arguments are read (0 was taken as 'auto')
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "--prompt", "x", "--draft-tokens", outside])
    bench = parser.parse_args(["bench", "--speculation-workloads", "--draft-tokens", "3"])
    assert bench.speculation_workloads and bench.draft_tokens == 3
    # a draft setting that nothing would read is refused, not ignored
    with pytest.raises(OptionsError, match="--draft-tokens sets how far speculation drafts, and speculation is off"):
        options_from_args(parser.parse_args(["generate", "--prompt", "x", "--draft-tokens", "3"]))
    for spec in ([], ["--speculation", "ngram"]):
        args = parser.parse_args(["generate", "--prompt", "x", *spec, "--draft-model", str(small)])
        with pytest.raises(OptionsError, match="--draft-model is the model --speculation draft drafts with, and "):
            options_from_args(args)
    preset = parser.parse_args(["generate", "--prompt", "x", "--preset", "speculation", "--draft-tokens", "4"])
    assert options_from_args(preset).draft_tokens == 4  # the preset's speculation reads it


def test_speculation_needs_the_static_cache_and_one_candidate(llama_engine_spec):
    eng = llama_engine_spec
    assert "static KV cache" in eng.unavailable(CPU.with_(speculation="ngram", kv_cache="dynamic"))["speculation"]
    assert "several candidates" in eng.unavailable(CPU.with_(speculation="ngram", candidates=2))["speculation"]
    assert "no draft model chosen" in eng.unavailable(CPU.with_(speculation="draft"))["speculation"]
    assert "speculation" not in eng.unavailable(CPU.with_(speculation="ngram"))
    eng.reconfigure(CPU.with_(speculation="ngram", candidates=2))
    res = eng.generate(REPEATS, SamplingParams(temperature=0, max_new_tokens=8))
    assert res.options.speculation == "off" and "several candidates" in res.unavailable["speculation"]


def test_speculation_asked_for_and_not_run_says_why_in_its_figures(llama_engine_spec, tmp_path):
    """An answer whose options asked for drafting that did not run (several candidates, a draft model refused)
    gave its speculation figures a bare "speculation off", as if none had been asked for; the reason was only in
    the options' `unavailable` entry."""
    from engine.speculative import SPECULATION_FIGURES

    eng = llama_engine_spec
    missing = tmp_path / "no-such-draft"
    sampling = SamplingParams(temperature=0, max_new_tokens=8)
    several = (
        "speculation off: speculation verifies the drafts of one answer; several candidates would accept "
        "different numbers of tokens per step"
    )
    refused = f"speculation off: the draft model could not be loaded: model not found: {missing}"
    for options, why in [
        (CPU.with_(speculation="ngram", candidates=2), several),
        (CPU.with_(speculation="draft", draft_model=str(missing), draft_tokens=3), refused),
        (CPU, "speculation off"),  # not asked for
    ]:
        eng.reconfigure(options)
        res = eng.generate(REPEATS, sampling)
        assert res.options.speculation == "off"
        assert {k: res.metrics.unavailable[k] for k in SPECULATION_FIGURES} == dict.fromkeys(SPECULATION_FIGURES, why)
        assert res.metrics.to_dict()["unavailable"]["acceptance_rate"] == why  # as the stored answer keeps it


@pytest.fixture(scope="module")
def llama_engine_spec(tiny_llama):
    eng = Engine.load(str(tiny_llama), CPU)
    yield eng
    eng.close()


# ---- the n-gram look-up -----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer()
    p.reset([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 6, 1, 2, 3])
    assert p.propose(3) == [9, 9, 2]  # [2, 3] was seen later (then 7, 8), but the longer [1, 2, 3] wins
    p.reset([5, 2, 3, 7, 8, 4, 2, 3, 6, 1, 3])
    assert p.propose(2) == [6, 1]  # only [3] matches: its latest earlier occurrence was followed by 6, 1
    p.reset([1, 2, 3])
    assert p.propose(4) == []
    p.reset([4, 4, 4, 4])
    assert p.propose(5) == [4, 4, 4, 4, 4]  # a run goes on copying itself
    p.reset([1, 2, 1, 2, 1])
    assert p.propose(5) == [2, 1, 2, 1, 2]
    p.extend([2, 9])
    assert p.propose(2) == []  # 9 never seen before


def test_device_lookup_proposes_what_the_host_lookup_does():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(2, 40, (1,), generator=g))
        h = torch.randint(0, 6, (n,), generator=g)
        p = NgramProposer()
        p.reset(h.tolist())
        host = p.propose(4)
        dev = ngram_propose_tensor(h, n, 4)
        # The device look-up stops at the answer's end; the host one goes on copying a periodic match.
        got = [t for t in dev.tolist() if t >= 0]
        assert host[: len(got)] == got and (len(got) == 0) == (len(host) == 0)


def test_adaptive_k_grows_shrinks_and_pauses_when_verifying_does_not_pay():
    a = AdaptiveK()
    assert not a.wants_drafts()  # the first step is plain: its time is what a verify step must beat
    a.plain_step(0.010)
    assert a.k == 4 and a.wants_drafts()
    a.verify_step(4, 4, 4, 5, 0.015)  # all accepted: longer; 5 tokens for 1.5 plain steps pays
    assert a.k == 8 and a.wants_drafts()
    a.verify_step(8, 8, 3, 4, 0.020)  # fewer than half: shorter; 4 tokens for 2 plain steps still pays
    assert a.k == 4 and a.wants_drafts()
    a.verify_step(4, 4, 2, 3, 0.015)  # half: kept
    assert a.k == 4
    for _ in range(3):  # nothing accepted: 1 token for 1.5 plain steps loses, but the running ratio is above 1
        a.verify_step(4, 4, 0, 1, 0.015)
        assert a.gate().pause == 0
    a.verify_step(4, 4, 0, 1, 0.015)  # now below: a pause of one plain step
    assert a.k == 1 and not a.wants_drafts() and a.wants_drafts()
    assert a.wants_drafts(key=3)  # matches of another length have their own record
    a.verify_step(2, 2, 0, 1, 0.015)
    assert not a.wants_drafts() and not a.wants_drafts() and a.wants_drafts()  # the pause doubled
    a.verify_step(2, 2, 2, 3, 0.012)  # paid again: the back-off ends
    a.verify_step(4, 4, 4, 5, 0.012)
    assert a.wants_drafts() and a.gate().backoff == 1
    fixed = AdaptiveK(fixed=6)
    assert fixed.wants_drafts()
    fixed.verify_step(6, 6, 0, 1, 0.1)
    fixed.verify_step(6, 6, 0, 1, 0.1)
    assert fixed.k == 6 and fixed.wants_drafts()


# ---- the verify rule --------------------------------------------------------------------------------------


def _logits(choices: list[int], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(choices), vocab)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return out


def test_greedy_verify_accepts_the_matching_prefix_and_adds_the_next_choice():
    state = SamplerState(1, 8, torch.device("cpu"))
    kind = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=False)
    eos = torch.tensor([7])
    v = verify(_logits([3, 4, 5, 6]), torch.tensor([3, 4, 1]), kind, state, eos)
    assert v.tokens[: int(v.n_emit)].tolist() == [3, 4, 5] and int(v.n_accepted) == 2 and not bool(v.eos_hit)
    v = verify(_logits([3, 4, 5, 6]), torch.tensor([3, 4, 5]), kind, state, eos)
    assert v.tokens[: int(v.n_emit)].tolist() == [3, 4, 5, 6]  # all accepted: the bonus token
    v = verify(_logits([2, 4, 5]), torch.tensor([3, 4]), kind, state, eos)
    assert v.tokens[: int(v.n_emit)].tolist() == [2]  # the first draft rejected: the correction only
    v = verify(_logits([3, 7, 5, 6]), torch.tensor([3, 7, 5]), kind, state, eos)
    assert v.tokens[: int(v.n_emit)].tolist() == [3, 7] and bool(v.eos_hit)  # nothing after an accepted EOS


def test_verify_sees_earlier_drafts_under_the_repetition_penalty():
    state = SamplerState(1, 8, torch.device("cpu"))
    state.penalty.fill_(10.0)
    state.seen.zero_()
    kind = SamplerKind(greedy=True, top_k=False, top_p=False, repetition=True)
    logits = torch.zeros(3, 8)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0  # 3 wins unless it was generated before: then 5 / 10 < 4
    v = verify(logits, torch.tensor([3, 3]), kind, state, torch.tensor([7]))
    # Position 0 has not seen 3 (takes it); position 1 has (the draft 3 is rejected, 4 instead).
    assert v.tokens[: int(v.n_emit)].tolist() == [3, 4]


# ---- greedy parity in the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 15, 0])
def test_greedy_tokens_identical_with_speculation(family_engine, k):
    for messages in (REPEATS, PLAIN):
        want = generate(family_engine, messages, GREEDY)
        got = generate(family_engine, messages, GREEDY, speculation="ngram", draft_tokens=k)
        assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons
        assert got.texts == want.texts
        m = got.metrics
        assert m.new_tokens_total == want.metrics.new_tokens_total
        assert m.decode_steps == m.verify_steps + (m.decode_steps - m.verify_steps)
        assert m.tokens_per_step == pytest.approx((m.new_tokens_total - 1) / m.decode_steps)
        if m.drafted_tokens:
            assert m.acceptance_rate == m.accepted_tokens / m.drafted_tokens
            assert 0 <= m.accepted_tokens <= m.drafted_tokens
        assert "n-gram prompt lookup" in m.speculation_source
    # The repeating prompt's answer (tiny random models loop) is where drafts are accepted.
    assert got.options.speculation == "ngram"


def test_accepted_drafts_mean_fewer_steps(family_engine):
    want = generate(family_engine, REPEATS, GREEDY)
    got = generate(family_engine, REPEATS, GREEDY, speculation="ngram", draft_tokens=8)
    assert got.token_ids == want.token_ids
    assert got.metrics.accepted_tokens > 0 and got.metrics.decode_steps < want.metrics.decode_steps
    assert got.metrics.tokens_per_step > 1.0 and want.metrics.tokens_per_step == 1.0


class Oracle:
    """Drafts the answer plain decoding gave (then tokens past it), so every draft is accepted: the EOS and the
    token budget fall inside an accepted run."""

    def __init__(self, answer: list[int], junk: int):
        self.answer, self.junk, self.n = answer, junk, 0

    def reset(self, tokens):
        self.n = 1

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, k):
        return (self.answer[self.n : self.n + k] + [self.junk] * k)[:k]


def _with_oracle(monkeypatch, answer, junk=5):
    import engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "NgramProposer", lambda: Oracle(answer, junk))


def test_eos_inside_an_accepted_run_drops_what_follows(llama_engine_spec, monkeypatch):
    eng = llama_engine_spec
    plain = generate(eng, PLAIN, GREEDY).token_ids[0]
    eos = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])  # a token first made at step >= 3
    monkeypatch.setattr(eng, "eos_ids", [eos])
    monkeypatch.setattr(eng, "_runners", {})  # runners made with this EOS go when the test ends
    want = generate(eng, PLAIN, GREEDY)
    assert want.finish_reasons == ["eos"] and want.token_ids[0][-1] == eos
    _with_oracle(monkeypatch, want.token_ids[0])
    got = generate(eng, PLAIN, GREEDY, speculation="ngram", draft_tokens=15)
    assert got.token_ids == want.token_ids and got.finish_reasons == ["eos"] and got.texts == want.texts
    assert got.metrics.verify_steps == 1 and got.metrics.accepted_tokens == len(want.token_ids[0]) - 1


def test_drafts_past_an_eos_or_a_stop_inside_an_accepted_run_are_not_counted(llama_engine_spec, monkeypatch):
    """The drafts after the token that ended the answer (which the target accepted too) counted as drafted and
    accepted: 15 of 15 for an answer of 5 tokens after its first."""
    eng = llama_engine_spec
    free = generate(eng, PLAIN, GREEDY).token_ids[0]
    _with_oracle(monkeypatch, free)  # drafts what the model goes on with: every draft is accepted, past the end too
    text = eng.tokenizer.decode(free[:3])
    stopped = generate(eng, PLAIN, dataclasses.replace(GREEDY, stop=(text,)), speculation="ngram", draft_tokens=15)
    assert stopped.token_ids == [free[:3]] and stopped.finish_reasons == ["stop"]
    m = stopped.metrics
    assert (m.verify_steps, m.drafted_tokens, m.accepted_tokens, m.acceptance_rate) == (1, 2, 2, 1.0)

    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # a token first made at step >= 3
    monkeypatch.setattr(eng, "eos_ids", [eos])
    monkeypatch.setattr(eng, "_runners", {})  # runners made with this EOS go when the test ends
    got = generate(eng, PLAIN, GREEDY, speculation="ngram", draft_tokens=15)
    n = free.index(eos) + 1
    assert got.token_ids == [free[:n]] and got.finish_reasons == ["eos"]
    m = got.metrics
    assert (m.verify_steps, m.drafted_tokens, m.accepted_tokens, m.acceptance_rate) == (1, n - 1, n - 1, 1.0)
    assert m.tokens_per_step == n - 1


@pytest.mark.parametrize("n", [2, 7, 17])
def test_max_new_tokens_exact_inside_an_accepted_run(llama_engine_spec, monkeypatch, n):
    eng = llama_engine_spec
    sampling = SamplingParams(temperature=0, max_new_tokens=n)
    want = generate(eng, PLAIN, sampling)
    _with_oracle(monkeypatch, want.token_ids[0])
    got = generate(eng, PLAIN, sampling, speculation="ngram", draft_tokens=15)
    assert got.token_ids == want.token_ids and len(got.token_ids[0]) == n and got.finish_reasons == ["length"]


def test_rejected_drafts_leave_the_answer_unchanged(llama_engine_spec, monkeypatch):
    eng = llama_engine_spec
    want = generate(eng, PLAIN, GREEDY)
    wrong = [(t + 1) % eng.config.vocab_size for t in want.token_ids[0]]
    _with_oracle(monkeypatch, wrong)
    got = generate(eng, PLAIN, GREEDY, speculation="ngram", draft_tokens=4)
    assert got.token_ids == want.token_ids
    assert got.metrics.accepted_tokens == 0 and got.metrics.acceptance_rate == 0.0


def test_step_records_count_several_tokens_per_step(llama_engine_spec):
    eng = llama_engine_spec
    eng.reconfigure(CPU.with_(speculation="ngram", draft_tokens=8))
    records: list[StepRecord] = []
    res = eng.generate(REPEATS, GREEDY, on_event=lambda e: records.append(e) if isinstance(e, StepRecord) else None)
    assert records[-1].tokens_total == res.metrics.new_tokens_total
    assert records[-1].step == res.metrics.decode_steps
    made = sum(r.tokens_per_step * (r.step - prev) for r, prev in zip(records, [0] + [r.step for r in records]))
    assert made == pytest.approx(res.metrics.new_tokens_total - 1)


def test_step_records_leave_out_what_a_stop_string_cut_inside_an_accepted_draft(llama_engine_spec):
    """The records counted tokens made (5 in the step whose drafts ran past the stop), the answer tokens kept."""
    eng = llama_engine_spec
    eng.reconfigure(CPU.with_(speculation="ngram", draft_tokens=8))
    free = eng.generate(REPEATS, GREEDY).texts[0]
    stops = [free[i : i + 3] for i in range(len(free) - 3, 0, -1) if free.find(free[i : i + 3]) == i]
    checked = 0
    for stop in stops[:6]:  # stops late in the text, some of them inside a step that accepted drafts
        events: list = []
        res = eng.generate(REPEATS, dataclasses.replace(GREEDY, stop=(stop,)), on_event=events.append)
        records = [e for e in events if isinstance(e, StepRecord)]
        m = res.metrics
        if not m.decode_steps:
            continue
        kept = sum(r.tokens_per_step * (r.step - prev) for r, prev in zip(records, [0] + [r.step for r in records]))
        assert kept == pytest.approx(m.new_tokens_total - 1), stop
        assert m.tokens_per_step == pytest.approx((m.new_tokens_total - 1) / m.decode_steps), stop
        checked += 1
    assert checked


def test_the_graph_verify_step_matches_plain_decoding(tiny_factory, monkeypatch):
    """Static shapes as compiled and captured: drafts padded to one of the adaptive lengths, the mask over a
    whole context bucket (the captured step stands in for the graph on the CPU, as in test_engine)."""
    from test_engine import graphs_on_cpu

    path = tiny_factory("llama", max_position_embeddings=1024)
    captured = graphs_on_cpu(monkeypatch)
    eng = Engine.load(str(path), CPU)
    try:
        sampling = SamplingParams(temperature=0, max_new_tokens=300)  # crosses the 256-position bucket
        want = eng.generate(REPEATS, sampling)
        eng.reconfigure(CPU.with_(cuda_graph=True, speculation="ngram"))
        got = eng.generate(REPEATS, sampling)
        assert got.options.cuda_graph and got.token_ids == want.token_ids
        verify_graphs = [g for g in captured if g.k is not None]
        assert {g.k for g in verify_graphs} == {1, 2, 4, 8, 15} and {g.bucket for g in verify_graphs} == {256, 512}
        assert sum(g.replays for g in verify_graphs) == got.metrics.verify_steps > 0
    finally:
        eng.close()


# ---- sampling: the distribution is the target's -----------------------------------------------------------


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution."""
    both = a + b
    common = {c for c in set(both) if both.count(c) >= 10}  # rarer categories pooled, as the test's premise needs
    a = [c if c in common else "rare" for c in a]
    b = [c if c in common else "rare" for c in b]
    cats = sorted(set(a) | set(b), key=str)  # token ids and the pooled "rare"
    table = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _goodness_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test of `counts` [V] against `probs` [V]; tokens expected fewer
    than 5 times are pooled into one category."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# Temperatures at which the tiny model's greedy token has a probability near 1/4: drafts accepted and rejected.
SAMPLINGS = [
    SamplingParams(temperature=0.3, max_new_tokens=3),
    SamplingParams(temperature=0.4, top_k=20, top_p=0.9, repetition_penalty=1.3, max_new_tokens=3),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top-k-top-p-penalty"])
def test_verify_sampling_gives_the_target_distribution(llama_engine_spec, monkeypatch, sampling):
    """The tiny model's logits over a context and two drafts (its greedy choices: accepted often, rejected often),
    verified many times: the first token is distributed as plain sampling's next token, and so is the second
    after an accepted first draft (chi-square against the exact processed distributions). A control that accepts
    every draft must fail the same test, so the test can tell."""
    import engine.speculative as spec_mod
    from engine.prompt import build_prompt
    from engine.sampling import process

    eng = llama_engine_spec
    torch.manual_seed(0)
    ids = build_prompt(eng.tokenizer, PLAIN, eng.context_length, 8).ids
    kind, V = SamplerKind.of(sampling), eng.config.vocab_size
    state = SamplerState(1, V, torch.device("cpu"))
    state.set_params(sampling)
    state.reset_seen(torch.tensor(ids))
    with torch.inference_mode():
        ctx = torch.tensor([ids])
        first = eng.model(ctx, torch.arange(len(ids)), None, None)[0, -1]
        d1 = int(first.argmax())
        second = eng.model(torch.tensor([ids + [d1]]), torch.arange(len(ids) + 1), None, None)[0, -1]
        d2 = int(second.argmax())
        logits = eng.model(torch.tensor([ids + [d1, d2]]), torch.arange(len(ids) + 2), None, None, last_only=False)[
            0, -3:
        ]
        p0 = torch.softmax(process(logits[:1].clone(), kind, state), -1)[0]
        seen1 = state.seen.clone()
        seen1[0, d1] = True
        p1 = torch.softmax(process(logits[1:2].clone(), kind, state, seen=seen1), -1)[0]
        drafts, eos = torch.tensor([d1, d2]), torch.tensor([-1])

        def run(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            c0, c1 = torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.long)
            for _ in range(n):
                v = verify(logits, drafts, kind, state, eos)
                t = v.tokens.tolist()
                c0[t[0]] += 1
                if int(v.n_emit) >= 2:
                    c1[t[1]] += 1
            return c0, c1

        n = 2000
        c0, c1 = run(n)
        assert 0.05 < p0[d1] < 0.95  # drafts both accepted and rejected: the test covers both branches
        assert _goodness_p(c0, p0) > 1e-3 and _goodness_p(c1, p1) > 1e-3
        assert c1.sum() == pytest.approx(n * float(p0[d1]), rel=0.2)

        monkeypatch.setattr(spec_mod.torch, "rand", lambda *size, **kw: torch.zeros(*size))  # accept every draft
        c0, _ = run(n // 2)
        assert _goodness_p(c0, p0) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top-k-top-p-penalty"])
def test_sampled_answers_distributed_as_without_speculation(llama_engine_spec, monkeypatch, sampling):
    """Whole generations, many seeds, with and without speculation (drafts: the greedy answer): the second and
    third tokens' distributions agree (chi-square, two samples)."""
    from dataclasses import replace

    eng = llama_engine_spec
    greedy = generate(eng, PLAIN, SamplingParams(temperature=0, max_new_tokens=3)).token_ids[0]

    def samples(n: int, **options) -> list[list[int]]:
        eng.reconfigure(CPU.with_(profile_window=False, **options))
        return [eng.generate(PLAIN, replace(sampling, seed=s)).token_ids[0] for s in range(n)]

    plain = samples(300)
    _with_oracle(monkeypatch, greedy)
    spec = samples(300, speculation="ngram", draft_tokens=2)

    def at(t: list[int], i: int):  # an answer that ended (EOS) before token i is its own category
        return t[i] if i < len(t) else "ended"

    for i in (1, 2):
        p = chi_square_p([at(t, i) for t in plain], [at(t, i) for t in spec])
        assert p > 1e-3, f"token {i + 1}: speculative sampling differs from plain sampling (chi-square p = {p:.2e})"


# ---- the draft model --------------------------------------------------------------------------------------


def test_draft_model_with_the_same_vocabulary_keeps_greedy_tokens(tiny_factory, tmp_path):
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    eng = Engine.load(str(target), CPU)
    try:
        for k in (1, 4, 0):
            want = generate(eng, REPEATS, GREEDY)
            got = generate(eng, REPEATS, GREEDY, speculation="draft", draft_model=str(draft), draft_tokens=k)
            assert got.options.speculation == "draft" and "speculation" not in got.unavailable
            assert got.token_ids == want.token_ids and got.texts == want.texts
            assert got.metrics.drafted_tokens > 0 and "draft model draft" in got.metrics.speculation_source
        # The target drafting for itself: every draft accepted.
        same = generate(eng, PLAIN, GREEDY, speculation="draft", draft_model=str(target), draft_tokens=4)
        assert same.metrics.acceptance_rate == 1.0
        assert same.token_ids == generate(eng, PLAIN, GREEDY).token_ids
    finally:
        eng.close()


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_factory, tmp_path):
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    eng = Engine.load(str(target), CPU)
    try:
        eng.reconfigure(CPU.with_(speculation="draft", draft_model=str(other)))
        why = eng.unavailable()["speculation"]
        assert "vocabulary has" in why and "the target's 320" in why
        res = eng.generate(PLAIN, SamplingParams(temperature=0, max_new_tokens=6))
        assert res.options.speculation == "off" and res.unavailable["speculation"] == why
        missing = str(tmp_path / "nowhere")
        eng.reconfigure(CPU.with_(speculation="draft", draft_model=missing))
        assert "could not be loaded" in eng.unavailable()["speculation"]
    finally:
        eng.close()


def drafts_the_plain_answer(target, draft) -> None:
    """`draft` drafts for `target` from the load on, and the answer is plain decoding's, token for token."""
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3))
    try:
        assert "speculation" not in eng.unavailable()
        got = eng.generate(REPEATS, GREEDY)
        assert got.options.speculation == "draft" and got.metrics.drafted_tokens > 0
        eng.reconfigure(CPU)
        assert got.token_ids == eng.generate(REPEATS, GREEDY).token_ids
    finally:
        eng.close()


def test_a_draft_model_given_at_load_drafts_or_is_refused(tiny_factory, tmp_path):
    """As `gapless generate --speculation draft --draft-model PATH` loads: the draft options from the start."""
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    drafts_the_plain_answer(target, draft)
    missing = str(tmp_path / "nowhere")
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=missing))
    try:
        assert "could not be loaded" in eng.unavailable()["speculation"]
        assert eng.generate(PLAIN, GREEDY).options.speculation == "off"
    finally:
        eng.close()


@pytest.mark.parametrize("field, value", [("vocab_size", "320"), ("num_hidden_layers", 0)])
def test_a_draft_model_with_damaged_settings_is_refused_and_the_model_still_loads(tiny_factory, tmp_path, field, value):
    """A size written as text stopped the target itself from loading ("internal error", and in the app no model
    could be opened while the choice was saved); a draft of no layers was taken, and every answer then failed."""
    import json

    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    config = json.loads((draft / "config.json").read_text())
    config[field] = value
    (draft / "config.json").write_text(json.dumps(config))
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3))
    try:
        why = eng.unavailable()["speculation"]
        assert why.startswith("the draft model could not be loaded") and field in why
        got = eng.generate(REPEATS, GREEDY)
        assert got.options.speculation == "off" and got.unavailable["speculation"] == why
    finally:
        eng.close()


def test_adaptive_drafting_runs_the_draft_model_only_for_steps_that_verify(tiny_factory, tmp_path, monkeypatch):
    """The draft model drafted k tokens before the schedule was asked, so every plain step (the first, and each
    while drafting paused) ran k forwards of it for nothing: with a draft as costly as the target, "auto" decoded
    at 744 tok/s against plain decoding's 1,937."""
    from tiny_models import make_tiny_model

    import engine.speculative as spec

    asked: list[int] = []
    real = spec.DraftProposer.propose
    monkeypatch.setattr(spec.DraftProposer, "propose", lambda self, k: asked.append(k) or real(self, k))
    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=0))
    try:
        got = eng.generate(REPEATS, GREEDY)
        eng.reconfigure(CPU)
        want = eng.generate(REPEATS, GREEDY)
    finally:
        eng.close()
    assert got.token_ids == want.token_ids
    m = got.metrics
    assert m.decode_steps > m.verify_steps  # the first step (at least) is plain: what a verify step must beat
    assert len(asked) == m.verify_steps


def test_steps_whose_drafts_the_adaptive_schedule_paused_are_counted(tiny_factory, tmp_path, monkeypatch):
    """A draft model the target disagrees with: verify steps do not pay and drafting pauses, each pause longer.
    Those steps were counted with the plain ones, so an answer that verified few drafts did not say that the
    schedule, not the proposer, held them back."""
    from tiny_models import make_tiny_model

    import engine.speculative as spec

    held: list[bool] = []
    real = spec.AdaptiveK.wants_drafts

    def watch(self, key=0):
        wants = real(self, key)
        held.append(not wants and self.t_plain is not None)  # a pause, not the first plain step that times
        return wants

    monkeypatch.setattr(spec.AdaptiveK, "wants_drafts", watch)
    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=0))
    try:
        # seeded: the schedule models the step times, so the same steps pause on any machine
        got = eng.generate(REPEATS, SamplingParams(temperature=0.8, seed=3, max_new_tokens=48))
    finally:
        eng.close()
    m = got.metrics
    assert m.verify_steps > 0 and m.paused_steps == sum(held) > 0
    assert m.verify_steps + m.paused_steps < m.decode_steps  # the first step is plain, to time a verify step
    assert "paused_steps" not in m.unavailable and m.speculation_source
    assert m.to_dict()["paused_steps"] == m.paused_steps


def test_a_draft_model_whose_embedding_is_padded_otherwise_drafts(tiny_factory, tmp_path):
    """The usual pairing (Qwen2.5-0.5B, 151,936 rows, for Qwen2.5-7B, 152,064: one tokenizer) was refused for its
    row count; the answer with drafts is the answer without."""
    from tiny_models import make_tiny_model

    target = make_tiny_model(tmp_path / "target", "llama", rows=384)
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1, rows=352)
    drafts_the_plain_answer(target, draft)


def test_a_draft_model_drafts_only_ids_the_target_has_and_stops_at_one_it_has_not(tmp_path):
    import torch
    from tiny_models import make_tiny_model

    from engine.speculative import DraftProposer

    path = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1, rows=352)
    eng = Engine.load(str(path), CPU)
    try:
        model = eng.model
        with torch.no_grad():  # the padding rows win every argmax: a draft of them would only be rejected
            model.output.weight[320:] = 10.0
        proposer = DraftProposer(model, 64, torch.float32, torch.device("cpu"), vocab=320)
        proposer.reset([1, 2, 3])
        drafts = proposer.propose(3)
        assert len(drafts) == 3 and max(drafts) < 320
        proposer.extend([*drafts[:1], 351])  # the target made an id past the draft's 320 usable... still a row
        assert len(proposer.propose(2)) == 2
        proposer.extend([400])  # an id the draft model has no row for: it cannot read on, so it stops drafting
        assert proposer.propose(2) == []
    finally:
        eng.close()


def test_the_draft_model_reads_only_what_is_new_in_a_chat_and_in_chunks(tiny_factory, tmp_path, monkeypatch):
    """The draft model read the whole conversation again, in one forward, at every answer: 8,187 tokens of a long
    chat in 0.9 s and 320 MB more memory on a tiny draft, while the target read only the new turn."""
    from tiny_models import make_tiny_model

    import engine.speculative as spec

    monkeypatch.setattr(spec, "DRAFT_READ_CHUNK", 16)
    read: list[int] = []
    real = spec.DraftProposer._forward
    monkeypatch.setattr(
        spec.DraftProposer, "_forward", lambda self, ids, start: read.append(len(ids)) or real(self, ids, start)
    )
    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    sampling = SamplingParams(temperature=0, max_new_tokens=12)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3))
    try:
        first = eng.generate(REPEATS, sampling)
        chat = [*REPEATS, {"role": "assistant", "content": first.texts[0]}, {"role": "user", "content": "Again."}]
        read.clear()
        second = eng.generate(chat, sampling)
        prompt = second.metrics.prompt_tokens
        assert max(read) <= 16  # in chunks
        assert sum(read) < prompt / 2  # the new turn and the drafts, not the conversation again
        eng.reconfigure(CPU)
        assert second.token_ids == eng.generate(chat, sampling).token_ids
        assert first.token_ids == eng.generate(REPEATS, sampling).token_ids
    finally:
        eng.close()


def test_a_draft_model_whose_context_the_chat_outgrew_says_so(tiny_factory, tmp_path):
    """A draft model of a shorter context never drafted past it, and the answer said only "nothing was drafted"."""
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1, max_position_embeddings=32)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3))
    try:
        got = eng.generate(REPEATS, GREEDY)  # a prompt of more than 32 tokens
    finally:
        eng.close()
    assert got.metrics.drafted_tokens == 0
    why = got.metrics.figure("acceptance_rate").reason
    assert (
        why
        == "nothing was drafted in this answer (the conversation is longer than the draft model's context of 32 tokens)"
    )


def test_an_answer_too_short_to_draft_says_why_nothing_was_drafted(tiny_factory, tmp_path):
    """An adaptive draft length times one plain step before it drafts: an answer that ended after that step, or
    before any step had room for a draft, said "no proposal, or it ended first" though the draft model was never
    asked for one."""
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=0))
    try:
        got = {n: eng.generate(REPEATS, SamplingParams(temperature=0, max_new_tokens=n)) for n in (2, 3)}
    finally:
        eng.close()
    assert [got[n].metrics.drafted_tokens for n in (2, 3)] == [0, 0]
    assert got[2].metrics.figure("acceptance_rate").reason == (
        "nothing was drafted in this answer (the answer ended before a step had room for a draft)"
    )
    assert got[3].metrics.figure("acceptance_rate").reason == (
        "nothing was drafted in this answer (the adaptive draft length runs a plain step first, to time what a "
        "verify step must beat, and the answer ended after it)"
    )


def test_a_refused_draft_model_is_tried_again_once_its_file_changes(tiny_factory, tmp_path):
    """A draft model missing when first chosen (a drive not mounted yet, a copy not finished) was refused until
    the main model was loaded again, even after the file was there."""
    import shutil

    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    made = make_tiny_model(tmp_path / "made", "llama", seed=1, num_hidden_layers=1)
    later = tmp_path / "later"
    draft = CPU.with_(speculation="draft", draft_model=str(later), draft_tokens=3)
    eng = Engine.load(str(target), draft)
    try:
        assert "could not be loaded" in eng.unavailable()["speculation"]
        assert "could not be loaded" in eng.unavailable()["speculation"]  # asked again: the refusal is kept
        shutil.copytree(made, later)
        assert "speculation" not in eng.unavailable()
        got = eng.generate(REPEATS, GREEDY)
        assert got.options.speculation == "draft" and got.metrics.drafted_tokens > 0
    finally:
        eng.close()


@pytest.mark.parametrize("form", ["folder", "gguf"])
def test_a_draft_model_read_stopped_part_way_is_neither_kept_nor_refused(tiny_factory, tmp_path, form):
    """A folder's read stopped from its progress hook became "cannot read the weights" (the loader took the stop for
    a damaged file), and the draft model was refused until its file changed."""
    from gguf_fixtures import hf_llama_to_gguf
    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    folder = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=2)
    path = folder if form == "folder" else hf_llama_to_gguf(folder, tmp_path / "draft.gguf")
    drafting = CPU.with_(speculation="draft", draft_model=str(path), draft_tokens=3)
    eng = Engine.load(str(target), CPU)
    try:
        seen: list[str] = []
        weights_read = ("read ", "de-quantised ")  # a folder's, a GGUF's progress through its tensors
        eng.reconfigure(
            drafting, lambda p: seen.append(p.message), lambda: any(m.startswith(weights_read) for m in seen)
        )
        assert [m for m in seen if m.startswith(weights_read)] == [
            "read 16/20 tensors" if form == "folder" else "de-quantised 16/20 tensors"
        ]
        assert eng.options == drafting and "speculation" not in eng.unavailable()
        assert eng._draft_models == {} and eng._draft_refused == {}
        got = eng.generate(REPEATS, GREEDY)  # read whole when the answer needs it
        assert got.options.speculation == "draft" and got.metrics.drafted_tokens > 0
        eng.reconfigure(CPU)
        assert got.token_ids == eng.generate(REPEATS, GREEDY).token_ids
    finally:
        eng.close()


def test_an_answer_stopped_while_its_draft_model_is_read_says_so(tiny_factory, tmp_path):
    """Stop pressed while an answer read its draft model (one whose read was stopped before): the answer said
    "speculation off for this answer: the draft model is not loaded", as if it had never been asked for."""
    import threading

    from tiny_models import make_tiny_model

    from engine.types import Progress

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=2)
    drafting = CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3)
    eng = Engine.load(str(target), CPU)
    try:
        eng.reconfigure(drafting, cancelled=lambda: True)  # in force, not read: the next answer reads it
        assert eng._draft_models == {}
        cancel = threading.Event()

        def stop_in_the_read(event) -> None:
            if isinstance(event, Progress) and event.message.startswith("read "):  # the draft's weights
                cancel.set()

        got = eng.generate(REPEATS, GREEDY, stop_in_the_read, cancel)
        assert got.options.speculation == "off" and got.finish_reasons == ["cancelled"]
        assert got.unavailable["speculation"] == "the draft model's read was stopped"
        assert got.notices[0] == "speculation off for this answer: the draft model's read was stopped"
        assert eng._draft_models == {} and eng._draft_refused == {}
        assert "speculation" not in eng.unavailable()  # read whole by the next answer
        again = eng.generate(REPEATS, GREEDY)
        assert again.options.speculation == "draft" and again.metrics.drafted_tokens > 0
    finally:
        eng.close()


def test_a_draft_model_turned_off_or_replaced_is_let_go(tiny_factory, tmp_path):
    """Drafting turned off kept the draft model (and its proposer's cache of the chat) in memory until the model
    was loaded again (it is kept for a bench that turns drafting off and on, and let go when the app asks); a draft
    model replaced by another, or by one refused, was kept beside it."""
    import gc
    import weakref

    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    one = make_tiny_model(tmp_path / "one", "llama", seed=1, num_hidden_layers=1)
    two = make_tiny_model(tmp_path / "two", "llama", seed=2, num_hidden_layers=1)
    other_vocabulary = make_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    eng = Engine.load(str(target), CPU)

    def drafting_with(path) -> weakref.ref:
        eng.reconfigure(CPU.with_(speculation="draft", draft_model=str(path), draft_tokens=3))
        got = eng.generate(REPEATS, GREEDY)  # the proposer holds the draft model too
        assert got.metrics.drafted_tokens > 0
        (model,) = eng._draft_models.values()
        return weakref.ref(model)

    def let_go(ref: weakref.ref) -> bool:
        gc.collect()
        return ref() is None

    try:
        first = drafting_with(one)
        for speculation in ("off", "ngram"):
            # kept while off (a bench turns drafting off and on between runs), let go when the app asks
            eng.reconfigure(CPU.with_(speculation=speculation, draft_model=str(one)))
            assert not let_go(first)
            again = CPU.with_(speculation="draft", draft_model=str(one), draft_tokens=3)
            eng.reconfigure(again)
            assert eng.generate(REPEATS, GREEDY).metrics.drafted_tokens > 0
            assert next(iter(eng._draft_models.values())) is first()  # not read again
            eng.release_unused_drafts()  # drafting with it: kept
            assert not let_go(first)
            eng.reconfigure(CPU.with_(speculation=speculation, draft_model=str(one)))
            eng.release_unused_drafts()
            assert let_go(first) and eng._draft_models == {} and eng._draft_proposer is None
            first = drafting_with(one)
        kept = drafting_with(one)  # the same draft model again: read once, kept
        assert kept() is first()
        second = drafting_with(two)
        assert let_go(first) and not let_go(second)
        eng.reconfigure(CPU.with_(speculation="draft", draft_model=str(other_vocabulary)))
        assert "vocabulary has" in eng.unavailable()["speculation"]
        assert let_go(second) and eng._draft_models == {}
    finally:
        eng.close()


def test_a_closed_engine_lets_its_draft_model_go(tiny_factory, tmp_path):
    """A closed engine kept its draft model and the proposer's cache of the chat for as long as anything held the
    engine (a context count still running on it does)."""
    import gc
    import weakref

    from tiny_models import make_tiny_model

    target = tiny_factory("llama")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    eng = Engine.load(str(target), CPU)
    eng.reconfigure(CPU.with_(speculation="draft", draft_model=str(draft), draft_tokens=3))
    assert eng.generate(REPEATS, GREEDY).metrics.drafted_tokens > 0
    (model,) = eng._draft_models.values()
    ref = weakref.ref(model)
    del model
    eng.close()
    gc.collect()
    assert ref() is None and eng._draft_proposer is None


def test_vocabulary_mismatch_names_remapped_tokens():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    a = Tok({"a": 0, "b": 1, "c": 2})
    assert vocabulary_mismatch(a, Tok({"a": 0, "b": 1, "c": 2}), 3, 3) is None
    assert "2 tokens map to other ids" in vocabulary_mismatch(a, Tok({"a": 0, "b": 2, "c": 1}), 3, 3)
    assert vocabulary_mismatch(a, a, 3, 4) is None  # the draft's rows padded further: the same ids
    assert vocabulary_mismatch(a, a, 8, 4) is None  # the target's padded: its tokens take 3 rows
    assert "has 2 token rows; the target's tokens take 3" in vocabulary_mismatch(a, a, 3, 2)
    assert "has 4 entries and the target's 3" in vocabulary_mismatch(a, Tok({"a": 0, "b": 1, "c": 2, "d": 3}), 3, 4)


def test_parser_type_for_draft_tokens():
    from app.cli import _draft_tokens

    assert _draft_tokens("auto") == 0 and _draft_tokens("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match="'auto'"):
        _draft_tokens("x")


def test_a_seed_gives_the_same_sampled_text_however_busy_the_machine(tiny_factory, monkeypatch):
    """The adaptive schedule chose between drafting and a plain step from measured step times, and a verify step
    draws its random numbers differently: a seeded sampled answer changed with the machine's load. With a seed the
    step times are modelled; the text is the same whatever the clock says."""
    import engine.speculative as spec
    from engine.decode import StaticRunner

    target = tiny_factory("llama")
    sampling = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=60)
    eng = Engine.load(str(target), CPU.with_(speculation="draft", draft_model=str(target)))  # adaptive k
    plain_step, speculate = StaticRunner.step, StaticRunner.speculate

    def answer(verify_cost: float):
        now = [0.0]

        def step(self, *a):
            now[0] += 1.0
            return plain_step(self, *a)

        def verify(self, *a):
            now[0] += verify_cost
            return speculate(self, *a)

        monkeypatch.setattr(spec.time, "perf_counter", lambda: now[0])
        monkeypatch.setattr(StaticRunner, "step", step)
        monkeypatch.setattr(StaticRunner, "speculate", verify)
        try:
            return eng.generate(REPEATS, sampling)
        finally:
            monkeypatch.undo()

    try:
        idle, loaded = answer(0.5), answer(50.0)  # verify steps cheap, then dear
        assert idle.token_ids == loaded.token_ids and idle.metrics.drafted_tokens > 0
        assert "step times modelled for the seed" in idle.metrics.speculation_source
    finally:
        eng.close()


def test_timing_the_verify_step_leaves_the_next_answer_as_it_was(tiny_factory):
    """bench_spec.step_costs fills the static cache with a made-up prompt; prefix reuse still took the rows as the
    last conversation's, and the same question again was answered from them (nonsense on the default model)."""
    from engine.bench_spec import step_costs

    eng = Engine.load(str(tiny_factory("llama", max_position_embeddings=1024)), CPU)
    try:
        sampling = SamplingParams(temperature=0, max_new_tokens=20)
        first = generate(eng, PLAIN, sampling)
        step_costs(eng, CPU, repeats=1, ks=(1, 2))
        again = eng.generate(PLAIN, sampling)
        assert again.metrics.prompt_reused_tokens == 0
        assert again.token_ids == first.token_ids
        after = eng.generate(PLAIN, sampling)  # and reuse works again after it
        assert after.metrics.prompt_reused_tokens > 0 and after.token_ids == first.token_ids
    finally:
        eng.close()


def test_a_draft_folder_is_read_in_the_model_s_dtype(tiny_llama, tmp_path, monkeypatch):
    """The draft model's folder was read into fp32 on the CPU whatever the engine ran in: a bf16 draft for a
    bf16 model was held at twice its size (a CUDA model's, in host memory) before it was converted."""
    import shutil

    from safetensors.torch import load_file, save_file

    import engine.engine as engine_module

    draft = shutil.copytree(tiny_llama, tmp_path / "draft-bf16")
    weights = load_file(str(draft / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(draft / "model.safetensors"))
    built = []
    build = engine_module.build_transformer

    def recorded(config, state, dtype, device, **kw):
        built.append(({t.dtype for t in state.values()}, dtype))
        return build(config, state, dtype, device, **kw)

    monkeypatch.setattr(engine_module, "build_transformer", recorded)
    options = EngineOptions(device="cpu", dtype="bf16", speculation="draft", draft_model=str(draft))
    eng = Engine.load(str(tiny_llama), dataclasses.replace(options, profile_window=False))
    try:
        eng.generate([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_new_tokens=4))
        assert built[1:] == [({torch.bfloat16}, torch.bfloat16)]  # the model's, then its draft's, as read
    finally:
        eng.close()
