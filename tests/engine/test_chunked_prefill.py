"""Chunked prefill: a long prompt is read a chunk at a time (activations bounded by the chunk), with progress,
stoppable between chunks; the greedy tokens are those of a one-shot prefill."""

from __future__ import annotations

import threading

import pytest
import torch.nn.functional as F

import engine.engine as engine_module
from engine import figures
from engine.engine import Engine
from engine.prefix import PREFILL_CHUNK
from engine.types import EngineOptions, Progress, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
LONG = " ".join(f"word{n % 37} the quick brown fox" for n in range(160))  # about 1,000 tokens


def load(path, **opts) -> Engine:
    return Engine.load(str(path), EngineOptions(device="cpu", profile_window=False, **opts))


@pytest.fixture
def long_model(tiny_factory):
    def make(family="llama"):
        return tiny_factory(family, max_position_embeddings=2048, **({"n_positions": 2048} if family == "gpt2" else {}))

    return make


@pytest.mark.parametrize(
    "family,kv", [("llama", "static"), ("qwen3", "dynamic"), ("mistral", "static"), ("gpt2", "dynamic")]
)
def test_chunked_tokens_equal_one_shot(long_model, monkeypatch, family, kv):
    path = long_model(family)
    msgs = [{"role": "user", "content": LONG}]
    eng = load(path, kv_cache=kv)
    try:
        events: list[Progress] = []
        chunked = eng.generate(msgs, GREEDY, on_event=lambda e: events.append(e) if isinstance(e, Progress) else None)
        T = chunked.metrics.prompt_tokens
        assert T > 3 * PREFILL_CHUNK
        follow = [*msgs, {"role": "assistant", "content": chunked.texts[0]}, {"role": "user", "content": LONG[:900]}]
        chunked_follow = eng.generate(follow, GREEDY)
        assert chunked_follow.metrics.prompt_computed_tokens > PREFILL_CHUNK  # chunked from the reused prefix on
    finally:
        eng.close()
    reading = [e for e in events if e.stage == "prefill"]
    assert [e.message for e in reading] == [
        f"reading the conversation: {min(n, T):,} of {T:,} tokens"
        for n in range(PREFILL_CHUNK, T + PREFILL_CHUNK, PREFILL_CHUNK)
    ]
    assert reading[-1].fraction == 1.0
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 1 << 20)  # one shot
    ref = load(path, kv_cache=kv, prefix_reuse=False)
    try:
        events.clear()
        one_shot = ref.generate(msgs, GREEDY, on_event=lambda e: events.append(e) if isinstance(e, Progress) else None)
        assert not [e for e in events if e.stage == "prefill"]
        assert chunked.token_ids == one_shot.token_ids
        assert chunked_follow.token_ids == ref.generate(follow, GREEDY).token_ids
    finally:
        ref.close()


def test_attention_never_sees_more_queries_than_a_chunk(long_model, monkeypatch):
    """What bounds the prefill's peak memory: no attention call (nor the matmuls around it) takes more than
    a chunk of queries."""
    eng = load(long_model())
    queries: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(q, *a, **k):
        queries.append(q.shape[2])
        return real(q, *a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    try:
        r = eng.generate([{"role": "user", "content": LONG}], GREEDY)
        assert r.metrics.prompt_tokens > 3 * PREFILL_CHUNK
        assert max(queries) == PREFILL_CHUNK
    finally:
        eng.close()


@pytest.mark.parametrize("kv", ["static", "dynamic"])
def test_a_stop_between_chunks_ends_before_any_token_and_keeps_what_was_read(long_model, kv):
    eng, ref = load(long_model(), kv_cache=kv), load(long_model(), kv_cache=kv, prefix_reuse=False)
    try:
        cancel = threading.Event()
        reads: list[str] = []

        def on_event(e):
            if isinstance(e, Progress) and e.stage == "prefill":
                reads.append(e.message)
                cancel.set()  # the user presses Stop as the first chunk is read

        msgs = [{"role": "user", "content": LONG}]
        r = eng.generate(msgs, GREEDY, on_event=on_event, cancel=cancel)
        T = r.metrics.prompt_tokens
        assert reads == [f"reading the conversation: {PREFILL_CHUNK:,} of {T:,} tokens"]  # no chunk after the stop
        assert r.finish_reasons == ["cancelled"] and r.texts == [""] and r.token_ids == [[]]
        assert f"stopped while reading the conversation ({PREFILL_CHUNK:,} of {T:,} tokens read)" in r.notices
        assert r.metrics.prompt_computed_tokens == PREFILL_CHUNK and r.metrics.ttft_ms is None
        again = eng.generate(msgs, GREEDY)  # sent again: the chunk already read is not read twice
        assert again.metrics.prompt_reused_tokens == PREFILL_CHUNK
        assert again.token_ids == ref.generate(msgs, GREEDY).token_ids
    finally:
        eng.close()
        ref.close()


def test_a_stop_while_reading_gives_every_figure_it_has_not_a_reason(long_model):
    """Only TTFT, prefill and decode tok/s of an answer stopped while its prompt was read said why they were n/a; the
    step times, the gap, the GPU figures, the compile figure and the rest were null with no reason (in the JSON,
    the stored answer and the HUD)."""
    eng = load(long_model())
    try:
        cancel = threading.Event()

        def on_event(e):
            if isinstance(e, Progress) and e.stage == "prefill":
                cancel.set()

        r = eng.generate([{"role": "user", "content": LONG}], GREEDY, on_event=on_event, cancel=cancel)
        assert r.finish_reasons == ["cancelled"]
        m = r.metrics
        for f in figures.GENERATION_FIGURES:
            fig = m.figure(f.key)
            assert fig.available or fig.reason, f"{f.key} is n/a with no reason"
        assert m.unavailable["step_ms_p50"] == "stopped before the first token"
        assert m.unavailable["compile_seconds"] == "compile and CUDA graph off: nothing is compiled or captured"
        assert m.unavailable["http_ttft_ms"] == "a local model: measured only on a remote server's answers"
    finally:
        eng.close()
