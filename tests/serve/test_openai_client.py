"""`gapless serve` through the official openai client, on a tiny random model: the served text, token for token,
is what the engine makes for the same request; usage counts the engine's tokens; SSE ends in [DONE]."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import load_engine, serving

from engine.types import EngineOptions, SamplingParams

HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = load_engine(tiny_llama)
    with serving(engine) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """A second engine on the same model, called directly."""
    engine = load_engine(tiny_llama)
    yield engine
    engine.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def model_id(server) -> str:
    return server.engines.model_id


def direct(engine, messages, n: int = 1, raw: bool = False, **sampling):
    engine.reconfigure(EngineOptions(device="cpu", candidates=n))
    return engine.generate(messages, SamplingParams(**sampling), raw=raw)


def test_models_lists_the_loaded_model(client, server, tiny_llama):
    ids = [m.id for m in client.models.list().data]
    assert ids == [tiny_llama.name] == [model_id(server)]
    model = client.models.retrieve(model_id(server))
    assert model.owned_by == "gapless"
    assert model.max_model_len == server.engines.engine.context_length > 0  # vLLM's field: clients read it
    assert model.x_gapless == {"sampling_extensions": ["top_k", "repetition_penalty"]}  # what it honours


def test_chat_equals_the_engine_token_for_token(client, server, reference):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, max_tokens=12, seed=7)
    ref = direct(reference, HELLO, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=7)
    assert r.choices[0].message.content == ref.texts[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref.finish_reasons[0]]
    assert r.usage.completion_tokens == len(ref.token_ids[0])
    assert r.usage.prompt_tokens == ref.metrics.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_figures_ride_in_an_extension_field_with_their_sources(client, server):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, max_tokens=24, seed=1)
    figures = r.model_extra["x_gapless"]
    assert set(figures) == {"ttft_ms", "decode_tok_s", "kernel_gap_pct", "queue_wait_ms"}
    for name, f in figures.items():
        if f["value"] is None:
            assert f["reason"], name
        else:
            assert f["value"] >= 0 and f["source"], name
    assert figures["ttft_ms"]["value"] > 0 and "engine timing" in figures["ttft_ms"]["source"]


def test_streaming_gives_the_same_text_and_usage(client, server):
    kw = dict(model=model_id(server), messages=HELLO, max_tokens=16, seed=3)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_the_raw_stream_ends_with_done(server):
    body = {"model": model_id(server), "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1])
    assert "x_gapless" in json.loads(lines[-2][6:])


def test_n_2_are_the_engine_candidates(client, server, reference):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, max_tokens=10, seed=11, n=2)
    ref = direct(reference, HELLO, n=2, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == ref.texts
    assert r.usage.completion_tokens == sum(len(t) for t in ref.token_ids)
    streamed = {0: "", 1: ""}
    for c in client.chat.completions.create(
        model=model_id(server), messages=HELLO, max_tokens=10, seed=11, n=2, stream=True
    ):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == ref.texts


def test_top_k_and_repetition_penalty_are_the_engine_s(client, server, reference):
    """Extensions vLLM's and llama.cpp's servers take too: passed to the engine's sampler, not ignored."""
    kw = dict(model=model_id(server), messages=HELLO, max_tokens=16, seed=9)
    for extra in ({"top_k": 3}, {"repetition_penalty": 1.8}, {"top_k": 5, "repetition_penalty": 0.7}):
        r = client.chat.completions.create(**kw, temperature=1.3, extra_body=extra)
        ref = direct(reference, HELLO, temperature=1.3, max_new_tokens=16, seed=9, **extra)
        assert r.choices[0].message.content == ref.texts[0], extra
    plain = client.chat.completions.create(**kw, temperature=1.3).choices[0].message.content
    assert plain != direct(reference, HELLO, temperature=1.3, max_new_tokens=16, seed=9, top_k=3).texts[0]


def test_top_p_0_is_greedy(client, server, reference):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, max_tokens=12, top_p=0, seed=4)
    assert r.choices[0].message.content == direct(reference, HELLO, temperature=0.0, max_new_tokens=12).texts[0]


def test_the_same_seed_gives_the_same_text(client, server):
    kw = dict(model=model_id(server), messages=HELLO, max_tokens=16, temperature=1.2)
    a, b, c = (client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (5, 5, 6))
    assert a == b
    assert a != c


def test_stop_cuts_where_the_engine_cuts(client, server, reference):
    greedy = direct(reference, HELLO, temperature=0.0, max_new_tokens=24).texts[0]
    stop = greedy[6:8]
    assert len(stop) == 2 and stop.strip()
    r = client.chat.completions.create(
        model=model_id(server), messages=HELLO, max_tokens=24, temperature=0, stop=[stop, "never seen"]
    )
    assert r.choices[0].message.content == greedy[: greedy.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    ref = direct(reference, HELLO, temperature=0.0, max_new_tokens=24, stop=(stop,))
    assert r.usage.completion_tokens == len(ref.token_ids[0])
    one = client.chat.completions.create(
        model=model_id(server), messages=HELLO, max_tokens=24, temperature=0, stop=stop
    )
    assert one.choices[0].message.content == r.choices[0].message.content


def test_completions_are_plain_raw_prompts(client, server, reference):
    r = client.completions.create(model=model_id(server), prompt="the quick brown", max_tokens=8, temperature=0)
    ref = direct(
        reference, [{"role": "user", "content": "the quick brown"}], raw=True, temperature=0.0, max_new_tokens=8
    )
    assert r.object == "text_completion" and r.choices[0].text == ref.texts[0]
    assert r.usage.prompt_tokens == ref.metrics.prompt_tokens
    assert r.usage.completion_tokens == len(ref.token_ids[0])
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id(server), prompt="the quick brown", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == ref.texts[0]


def test_a_completion_may_start_from_whitespace(client, server, reference):
    """A prompt of a newline was refused as "empty prompt"; OpenAI, vLLM and llama.cpp complete it."""
    r = client.completions.create(model=model_id(server), prompt="\n", max_tokens=4, temperature=0)
    ref = direct(reference, [{"role": "user", "content": "\n"}], raw=True, temperature=0.0, max_new_tokens=4)
    assert r.choices[0].text == ref.texts[0] and r.usage.prompt_tokens == ref.metrics.prompt_tokens >= 1


def test_max_completion_tokens_limits_the_answer(client, server):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, max_completion_tokens=3, seed=2)
    assert r.usage.completion_tokens <= 3
    assert r.choices[0].finish_reason == "length" or r.usage.completion_tokens < 3


def test_without_max_tokens_the_answer_may_fill_the_context(client, server, tiny_llama):
    r = client.chat.completions.create(model=model_id(server), messages=HELLO, seed=4, temperature=0)
    context = server.engines.engine.context_length
    assert r.usage.total_tokens <= context
    assert r.choices[0].finish_reason == "stop" or r.usage.total_tokens == context
