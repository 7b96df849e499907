"""An engine that fails unexpectedly: a 500 with an OpenAI error object for a whole answer, an error event and
[DONE] in a stream; never a traceback to the client, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import BrokenEngine, load_engine, request_body, serving


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = load_engine(tiny_llama)
    yield e
    e.close()


def body(server, **fields) -> dict:
    return request_body(server, **{"max_tokens": 40, "seed": 5, **fields})


def test_a_failure_before_the_answer_is_a_500_error_object(engine):
    with serving(BrokenEngine(engine, after_text=False)) as server:
        r = httpx.post(f"{server.url}/chat/completions", json=body(server), timeout=120)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["message"] == "internal error: RuntimeError: a bug in the engine"
        assert "Traceback" not in r.text
        # a stream has started (200) once the request passed its checks: the failure comes as an error event
        s = httpx.post(f"{server.url}/chat/completions", json=body(server, stream=True), timeout=120)
        assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n")
        assert json.loads(s.text.split("\n\n")[0][6:])["error"]["message"].endswith("a bug in the engine")
        assert server.engines.stats.failed == 2 and "a bug in the engine" in server.engines.stats.last_error
        server.engines.engine = engine  # the same server, a working engine: it goes on serving
        ok = httpx.post(f"{server.url}/chat/completions", json=body(server), timeout=120)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(engine):
    with serving(BrokenEngine(engine, after_text=True)) as server:
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body(server, stream=True), timeout=120) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert events[0]["choices"][0]["delta"]["content"]  # the text before the failure reached the client
        assert events[-1]["error"]["message"] == "internal error: RuntimeError: a bug in the engine"
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="a bug in the engine"):
            list(client.chat.completions.create(**body(server), stream=True))


class NotFiniteEngine:
    """The real engine, whose answers' TTFT comes out NaN and decode tok/s infinite."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, messages, sampling, on_event=None, cancel=None, raw=False):
        result = self._engine.generate(messages, sampling, on_event, cancel, raw)
        result.metrics.ttft_ms, result.metrics.decode_tok_s = float("nan"), float("inf")
        return result


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_a_figure_that_is_not_finite_is_null_with_why_in_strict_json(engine):
    """A NaN figure: a whole answer was a 500 (`internal error: ValueError`: Starlette's JSON refuses NaN), and a
    stream sent `NaN`, which strict JSON readers (a browser's JSON.parse) refuse."""
    with serving(NotFiniteEngine(engine)) as server:
        r = httpx.post(f"{server.url}/chat/completions", json=body(server, max_tokens=4), timeout=120)
        assert r.status_code == 200, r.text
        whole = json.loads(r.text, parse_constant=_refuse)
        s = httpx.post(f"{server.url}/chat/completions", json=body(server, max_tokens=4, stream=True), timeout=120)
        events = [json.loads(e[6:], parse_constant=_refuse) for e in s.text.split("\n\n") if e.startswith("data: {")]
    assert whole["choices"][0]["message"]["content"] and whole["usage"]["completion_tokens"] >= 1
    for figures in (whole["x_gapless"], events[-1]["x_gapless"]):
        assert figures["ttft_ms"] == {"value": None, "reason": "came out as nan, not a finite number"}
        assert figures["decode_tok_s"] == {"value": None, "reason": "came out as inf, not a finite number"}
        assert figures["queue_wait_ms"]["value"] >= 0
