"""Prefix reuse: answers with the KV cache carried across generations are token for token those computed from an
empty cache, on tiny models of every family and each cache mode, across follow-ups, edits, regenerates and a
continued candidate; positions past the common prefix are never read; the figures say what was reused."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from engine.decode import DynamicRunner, StaticRunner
from engine.engine import Engine
from engine.prefix import PrefixCache, common_prefix, preserved
from engine.prompt import build_prompt
from engine.types import EngineOptions, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)
CASES = [(f, kv) for f in ("llama", "qwen2", "qwen3", "mistral") for kv in ("static", "dynamic")] + [
    ("gpt2", "dynamic")
]


def load(path, **opts) -> Engine:
    return Engine.load(str(path), EngineOptions(device="cpu", profile_window=False, **opts))


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def conversation(eng: Engine, sampling=GREEDY, sent=None) -> list:
    """Follow-ups, an edit of an earlier message, a regenerate and a reply; the results, in order (and the
    messages of each in `sent`)."""
    out, sent = [], sent if sent is not None else []

    def ask(msgs):
        sent.append(msgs)
        out.append(eng.generate(msgs, sampling))
        return out[-1]

    msgs = [{"role": "system", "content": "You are brief."}, user("hello world, the quick brown fox")]
    for turn in range(2):  # follow-ups
        r = ask(msgs)
        msgs = [*msgs, assistant(r.texts[0]), user(f"and what about turn {turn}?")]
    ask(msgs)
    edited = [*msgs[:3], user("an edited second question"), *msgs[4:]]  # an earlier message changed
    ask(edited)
    r = ask(edited)  # regenerate: the same prompt again
    ask([*edited, assistant(r.texts[0]), user("thanks")])
    return out


@pytest.mark.parametrize("family,kv", CASES)
def test_reuse_gives_the_answers_of_an_empty_cache(tiny_factory, family, kv):
    path = tiny_factory(family)
    with_reuse, without = load(path, kv_cache=kv), load(path, kv_cache=kv, prefix_reuse=False)
    try:
        sent: list = []
        a, b = conversation(with_reuse, sent=sent), conversation(without)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert all(r.metrics.prompt_reused_tokens == 0 for r in b)
        assert all(r.metrics.prompt_reuse_source == "prefix reuse is off" for r in b)
        reused = [r.metrics.prompt_reused_tokens for r in a]
        assert reused[0] == 0 and all(n > 0 for n in reused[1:])
        for r in a:
            assert r.metrics.prompt_reused_tokens + r.metrics.prompt_computed_tokens == r.metrics.prompt_tokens
        # a regenerate computes nothing (the fallback's transformers cache: only the last prompt token)
        assert reused[4] == a[4].metrics.prompt_tokens - (family == "gpt2")
        # the edit reuses exactly up to the first token that changed (the turn before is all in the cache)
        before, edit = (
            build_prompt(with_reuse.tokenizer, m, with_reuse.context_length, GREEDY.max_new_tokens).ids
            for m in sent[2:4]
        )
        assert reused[3] == common_prefix(before, edit) < len(edit) - 1
    finally:
        with_reuse.close()
        without.close()


@pytest.mark.parametrize(
    "weights, dtype, text",
    [
        ("int8", "bf16", "42 is dog second over lazy fox jumps # fox world kernel graphs the France the the graphs "),
        ("int8", "fp32", "Paris capital dog kernel gap jumps per France"),
        ("int4", "bf16", "the dog kernel quick France second gap dog code jumps over hello main(): the quick def"),
    ],
)
def test_a_greedy_regenerate_gives_the_first_answer_whatever_the_kernels_rounding(tmp_path, weights, dtype, text):
    """A Regenerate computed the prompt's last position again, alone: where a kernel's rounding depends on how many
    positions one call computes (int8 and int4 linears: a GEMM past 32 rows, a GEMV below; bf16 attention), that
    position came out otherwise than in the prompt's first reading, and a greedy Regenerate gave another answer
    (8 of 40 prompts, int8 in bf16). The whole prompt and its last logits now come from the cache."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=1, std=0.12, max_position_embeddings=320)
    eng = load(path, weights=weights, dtype=dtype)
    try:
        msgs = [user(text)]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
        first, again = eng.generate(msgs, sampling), eng.generate(msgs, sampling)
        assert again.token_ids == first.token_ids
        m = again.metrics
        assert (m.prompt_reused_tokens, m.prompt_computed_tokens) == (m.prompt_tokens, 0)
        assert m.prefill_tok_s is None and "whole prompt came from the cache" in m.unavailable["prefill_tok_s"]
    finally:
        eng.close()


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=2)),
        ("phi3", dict(sliding_window=8)),
    ],
)
def test_a_sliding_window_past_its_size_is_not_cut_back_but_read_again(tiny_factory, family, overrides):
    """On the fallback (transformers' cache), a regenerate or an edit past a sliding window failed with
    transformers' "crop was called, but the current layer does not track past states"."""
    path = tiny_factory(family, **overrides)
    with_reuse, without = load(path), load(path, prefix_reuse=False)
    try:
        assert not with_reuse.fast
        a, b = conversation(with_reuse), conversation(without)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        regenerated = a[4].metrics
        assert regenerated.prompt_reused_tokens == 0
        assert regenerated.prompt_reuse_source.endswith("a sliding-window cache past its window cannot be cut back)")
    finally:
        with_reuse.close()
        without.close()


@pytest.mark.parametrize("family,kv", [("llama", "static"), ("qwen3", "dynamic"), ("gpt2", "dynamic")])
def test_the_continued_candidates_row_is_reused(tiny_factory, family, kv):
    """gpt2's tiny answers decode to replacement characters, whose tokens never match again: there the row's
    reuse is not checked, only that the answers are the same."""
    path = tiny_factory(family)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    results = {}
    for reuse in (True, False):
        eng = load(path, kv_cache=kv, candidates=3, prefix_reuse=reuse)
        try:
            msgs = [user("tell me something about the quick brown fox")]
            first = eng.generate(msgs, sampled)
            assert len(set(map(tuple, first.token_ids))) > 1  # the candidates differ
            follow = [*msgs, assistant(first.texts[2]), user("go on")]  # the conversation continues from the third
            results[reuse] = (first, eng.generate(follow, GREEDY), eng.generate(follow, GREEDY))
        finally:
            eng.close()
    (a1, a2, a3), (b1, b2, b3) = results[True], results[False]
    assert [a1.token_ids, a2.token_ids, a3.token_ids] == [b1.token_ids, b2.token_ids, b3.token_ids]
    prompt1 = a1.metrics.prompt_tokens
    assert a3.metrics.prompt_reused_tokens == a3.metrics.prompt_tokens - (family == "gpt2")  # a regenerate
    if family == "gpt2":
        return
    assert a2.metrics.prompt_reused_tokens > prompt1  # the chosen answer's tokens came from its cache row
    assert "(row 2)" in a2.metrics.prompt_reuse_source


@pytest.mark.parametrize("kv", ["static", "dynamic"])
def test_positions_past_the_common_prefix_are_never_read(tiny_factory, kv):
    """After the first answer, every cached position past what the edited prompt shares is set to garbage: the
    answer to the edit is still the one an empty cache gives."""
    path = tiny_factory("llama")
    eng, ref = load(path, kv_cache=kv), load(path, kv_cache=kv, prefix_reuse=False)
    try:
        msgs = [user("hello world, the quick brown fox"), assistant("an answer"), user("the first question")]
        eng.generate(msgs, GREEDY)
        edited = [*msgs[:2], user("the other question")]
        new_ids = build_prompt(eng.tokenizer, edited, eng.context_length, GREEDY.max_new_tokens).ids
        runner = next(iter(eng._runners.values()))
        keep = common_prefix(new_ids, eng._prefix._rows[runner][0])
        assert 0 < keep < len(new_ids) - 1
        g = torch.Generator().manual_seed(1)
        if isinstance(runner, StaticRunner):
            tensors = runner.cache.k + runner.cache.v
        else:
            assert isinstance(runner, DynamicRunner)
            tensors = runner.cache.k + runner.cache.v
        with torch.inference_mode():  # the engine's tensors are inference tensors
            for t in tensors:
                t[:, :, keep:] = torch.randn(t[:, :, keep:].shape, generator=g) * 1e3
        got = eng.generate(edited, GREEDY)
        assert got.metrics.prompt_reused_tokens == keep
        assert got.token_ids == ref.generate(edited, GREEDY).token_ids
    finally:
        eng.close()
        ref.close()


def test_a_longer_cache_takes_over_the_prefix(tiny_factory):
    """A prompt past the cache's length bucket moves to a longer cache; its prefix comes along."""
    path = tiny_factory("llama", max_position_embeddings=1024)
    eng, ref = load(path), load(path, prefix_reuse=False)
    try:
        msgs = [user("hello world " * 20)]
        r1 = eng.generate(msgs, GREEDY)
        assert next(iter(eng._runners.values())).length == 256
        follow = [*msgs, assistant(r1.texts[0]), user("the quick brown fox " * 40)]
        r2 = eng.generate(follow, GREEDY)
        assert next(iter(eng._runners.values())).length > 256
        assert r2.metrics.prompt_reused_tokens >= r1.metrics.prompt_tokens
        assert [r1.token_ids, r2.token_ids] == [
            ref.generate(msgs, GREEDY).token_ids,
            ref.generate(follow, GREEDY).token_ids,
        ]
    finally:
        eng.close()
        ref.close()


def test_no_cache_reuses_nothing_and_says_why(tiny_llama):
    eng = load(tiny_llama, kv_cache="none")
    try:
        msgs = [user("hello world")]
        eng.generate(msgs, GREEDY)
        r = eng.generate(msgs, GREEDY)
        assert r.metrics.prompt_reused_tokens == 0 and r.metrics.prompt_computed_tokens == r.metrics.prompt_tokens
        assert r.metrics.prompt_reuse_source == "no KV cache to reuse (kv_cache none)"
        assert r.to_dict()["metrics"]["prompt_reused_tokens"] == 0
    finally:
        eng.close()


def test_a_cancelled_answer_leaves_a_reusable_cache(tiny_llama):
    import threading

    from engine.types import TextDelta

    eng, ref = load(tiny_llama, sampling="host"), load(tiny_llama, prefix_reuse=False)
    try:
        msgs = [user("hello world, the quick brown fox")]
        cancel = threading.Event()
        long = SamplingParams(temperature=0.0, max_new_tokens=200, seed=0)
        first = eng.generate(
            msgs, long, on_event=lambda e: cancel.set() if isinstance(e, TextDelta) else None, cancel=cancel
        )
        assert first.finish_reasons == ["cancelled"]
        follow = [*msgs, assistant(first.texts[0]), user("go on")]
        r = eng.generate(follow, GREEDY)
        assert r.metrics.prompt_reused_tokens > first.metrics.prompt_tokens - 1
        assert r.token_ids == ref.generate(follow, GREEDY).token_ids
    finally:
        eng.close()
        ref.close()


@contextmanager
def cached_runner(tiny_llama, text: str):
    """The static runner of an engine that has answered `text`, and a copy of its cache as that left it."""
    eng = load(tiny_llama)
    try:
        eng.generate([user(text)], GREEDY)
        runner = next(iter(eng._runners.values()))
        with torch.inference_mode():
            yield runner, [t.clone() for t in runner.cache.k + runner.cache.v]
            runner.set_compiled(None)
    finally:
        eng.close()


def test_a_verify_step_s_warm_up_leaves_the_cached_prefix_as_it_was(tiny_llama):
    """The verify step of k drafts writes k + 1 positions from 0, and a capture runs a step four times: each warm-up
    step starts at position 0 and `preserved` keeps what they write (a compile warm-up for 15 drafts overwrote
    positions 8..15 of the prefix a later turn reused, and changed its answer)."""
    with cached_runner(tiny_llama, "hello world, the quick brown fox jumps over the lazy dog again and again") as (
        runner,
        before,
    ):
        runner.set_compiled(runner.masked_step, runner.masked_verify)
        with preserved(runner, (15,)):
            runner.warm_up(runner.buckets_for(20, 4, 15), runner.kind, False, lambda m, f: None, (15,))
            for _ in range(4):  # as a capture runs it
                runner._warm_step(runner.buckets_for(20, 4, 15)[0], runner.kind, 15)
            written = [int((a != b).any(dim=(0, 1, 3)).nonzero().max()) for a, b in zip(before, runner.cache.k)]
        assert max(written) == 15  # positions 0..15, no further
        assert all(torch.equal(a, b) for a, b in zip(before, runner.cache.k + runner.cache.v))


def test_a_warm_up_leaves_the_cached_prefix_as_it_was(tiny_llama):
    """A compile warm-up runs the step at the first positions; `preserved` puts them back (the step function
    stands in for the compiled one: the writes are the same)."""
    with cached_runner(tiny_llama, "hello world, the quick brown fox") as (runner, before):
        runner.set_compiled(runner.masked_step)
        with preserved(runner):
            runner.warm_up(runner.buckets_for(10, 4), runner.kind, False, lambda m, f: None)
        assert all(torch.equal(a, b) for a, b in zip(before, runner.cache.k + runner.cache.v))
        runner.set_compiled(runner.masked_step)  # a new step: the warm-up runs it again, unpreserved
        runner.warm_up(runner.buckets_for(10, 4), runner.kind, False, lambda m, f: None)
        assert not all(torch.equal(a, b) for a, b in zip(before, runner.cache.k + runner.cache.v))


def test_common_prefix_and_the_plan_limits():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    cache = PrefixCache()

    class Fake(DynamicRunner):
        def __init__(self):
            self.batch = 1

    r = Fake()
    assert cache.plan(r, [1, 2, 3], True).source.endswith("none (no earlier generation in this cache)")
    cache._rows[r] = [[1, 2, 3, 4, 5]]
    assert cache.plan(r, [1, 2, 3], True).start == 2  # the last prompt token is always computed
    assert cache.plan(r, [9, 2, 3], True).start == 0
    assert cache.plan(r, [1, 2, 3], False).start == 0


@pytest.mark.slow
def test_reuse_on_the_default_model(default_model_path):
    with_reuse = load(default_model_path, dtype="fp32")
    without = load(default_model_path, dtype="fp32", prefix_reuse=False)
    try:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=32, seed=0)
        a, b = conversation(with_reuse, sampling), conversation(without, sampling)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert all(r.metrics.prompt_reused_tokens > 0 for r in a[1:])
    finally:
        with_reuse.close()
        without.close()
