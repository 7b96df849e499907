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
