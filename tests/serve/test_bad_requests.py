"""Each bad request gets its 4xx and an OpenAI error object (never a traceback); the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import load_engine, request_body, serving

from app.server.http import ServeConfig

LIMIT = 8192
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = load_engine(tiny_llama)
    with serving(engine, config=ServeConfig(max_body_bytes=LIMIT)) as srv:
        yield srv
    engine.close()


def chat_body(server, **fields) -> dict:
    return request_body(server, "hello", **{"max_tokens": 4, **fields})


def assert_error(r: httpx.Response, status: int, param=None, code=None, words: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert words.lower() in err["message"].lower()
    return err


def post(server, body, path: str = "/chat/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=120, **kw
    )


@pytest.mark.parametrize(
    "fields, param, code, words",
    [
        ({"messages": "hello"}, "messages", "invalid_type", "non-empty list"),
        ({"messages": []}, "messages", "invalid_type", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value", "role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type", "string"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "messages[1].role",
            "invalid_value",
            "last message",
        ),
        ({"temperature": "hot"}, "temperature", "invalid_type", "number"),
        ({"temperature": 3}, "temperature", "invalid_value", "temperature"),
        ({"top_p": -0.1}, "top_p", "invalid_value", "top_p"),
        ({"top_p": 1.5}, "top_p", "invalid_value", "top_p"),
        ({"top_k": -1}, "top_k", "invalid_value", "between"),
        ({"top_k": 2**63}, "top_k", "invalid_value", "between 0 and 1048576"),
        ({"stop": ["ok", "\ud800"]}, "stop", "invalid_value", "a lone surrogate"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value", "repetition_penalty"),
        ({"max_tokens": "ten"}, "max_tokens", "invalid_type", "integer"),
        ({"max_tokens": True}, "max_tokens", "invalid_type", "integer"),
        ({"max_tokens": -5}, "max_tokens", "invalid_value", "between"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value", "between"),
        ({"max_tokens": 10**12}, "max_tokens", "invalid_value", "between"),
        ({"max_tokens": 5000}, "max_tokens", "context_length_exceeded", "context length"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "invalid_value", "between"),
        # max_tokens beside the newer name: read too ("abc" and -5 were taken), and one of two that differ is not
        # ignored
        ({"max_completion_tokens": 2, "max_tokens": "abc"}, "max_tokens", "invalid_type", "integer"),
        ({"max_completion_tokens": 2, "max_tokens": -5}, "max_tokens", "invalid_value", "between"),
        (
            {"max_completion_tokens": 2, "max_tokens": 3},
            "max_tokens",
            "invalid_value",
            "'max_tokens' (3) and 'max_completion_tokens' (2) differ: give one of them",
        ),
        # a number JSON holds that a float does not: a 500 (which the openai client sends three times)
        (
            {"temperature": 10**400},
            "temperature",
            "invalid_value",
            "must be in [0.0, 2.0], got an integer of 401 digits",
        ),
        ({"presence_penalty": -(10**400)}, "presence_penalty", "invalid_value", "got an integer of 401 digits"),
        ({"seed": 10**400}, "seed", "invalid_value", "got an integer of 401 digits"),
        # a seen token's logit divided by 1e-39 was infinite in float32: an empty answer of one token repeated
        ({"repetition_penalty": 1e-39}, "repetition_penalty", "invalid_value", "must be in [0.01, 10.0]"),
        # a misspelt field's name holding half a character: named back with U+FFFD for it (it was a 500)
        ({"temprature\ud83d": 1}, "temprature\ufffd", "unknown_parameter", "did you mean 'temperature'?"),
        ({"n": 33}, "n", "invalid_value", "between 1 and 32"),
        ({"n": 0}, "n", "invalid_value", "between"),
        ({"n": 1.5}, "n", "invalid_type", "integer"),
        ({"seed": "x"}, "seed", "invalid_type", "integer"),
        # beyond the engine's seeds: folded onto them, two seeds gave the same text
        ({"seed": 2**63}, "seed", "invalid_value", "between -1 and 9223372036854775807"),
        ({"seed": -2}, "seed", "invalid_value", "between -1"),
        ({"stop": 5}, "stop", "invalid_type", "string"),
        ({"stop": [""]}, "stop", "invalid_value", "empty"),
        ({"stream": "yes"}, "stream", "invalid_type", "true or false"),
        ({"stream_options": {"include_usage": 1}}, "include_usage", "invalid_type", "true or false"),
        ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter", "not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter", "not supported"),
        # what would change the answer's form is refused, never ignored: JSON mode, forced tools, audio, biases
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter", "json"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "unsupported_parameter", "json"),
        ({"tool_choice": "required"}, "tool_choice", "unsupported_parameter", "not supported"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "unsupported_parameter", "not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter", "only text"),
        ({"logit_bias": {"42": 5}}, "logit_bias", "unsupported_parameter", "not supported"),
        ({"min_p": 0.05}, "min_p", "unsupported_parameter", "not supported"),
        # other servers' extensions that constrain or change the answer
        ({"json_schema": {"type": "object"}}, "json_schema", "unsupported_parameter", "constrained output"),
        ({"grammar": 'root ::= "yes"'}, "grammar", "unsupported_parameter", "constrained output"),
        ({"guided_json": {"type": "object"}}, "guided_json", "unsupported_parameter", "guided decoding"),
        ({"guided_choice": ["a", "b"]}, "guided_choice", "unsupported_parameter", "guided decoding"),
        ({"ignore_eos": True}, "ignore_eos", "unsupported_parameter", "not supported"),
        ({"min_tokens": 5}, "min_tokens", "unsupported_parameter", "not supported"),
        ({"stop_token_ids": [2]}, "stop_token_ids", "unsupported_parameter", "give 'stop' strings"),
        ({"function_call": {"name": "f"}}, "function_call", "unsupported_parameter", "not supported"),
        ({"best_of": 3}, "best_of", "unsupported_parameter", "only 1"),
        ({"repeat_penalty": 1.2}, "repeat_penalty", "unsupported_parameter", "'repetition_penalty'"),
        # other servers' names for the length limit: ignored, the answer ran to the end of the context
        ({"n_predict": 5}, "n_predict", "unsupported_parameter", "the length limit as 'max_tokens'"),
        ({"max_new_tokens": 5}, "max_new_tokens", "unsupported_parameter", "the length limit as 'max_tokens'"),
        ({"num_predict": 5}, "num_predict", "unsupported_parameter", "the length limit as 'max_tokens'"),
        ({"dry_multiplier": 0.8}, "dry_multiplier", "unsupported_parameter", "only 0"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter", "not supported"),
        # the chat template's arguments: taken and not read, a Qwen3 model thought with enable_thinking false
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs",
            "unsupported_parameter",
            "renders with its defaults",
        ),
        ({"chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter", "the model's is used"),
        ({"add_generation_prompt": False}, "add_generation_prompt", "unsupported_parameter", "new assistant turn"),
        ({"continue_final_message": True}, "continue_final_message", "unsupported_parameter", "new assistant turn"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "unsupported_parameter", "left out"),
        ({"skip_special_tokens": False}, "skip_special_tokens", "unsupported_parameter", "left out of the text"),
        ({"add_special_tokens": True}, "add_special_tokens", "unsupported_parameter", "the chat template writes"),
        # a misspelt field the answer depends on
        ({"temprature": 0.1}, "temprature", "unknown_parameter", "did you mean 'temperature'?"),
        ({"max_token": 5}, "max_token", "unknown_parameter", "did you mean 'max_tokens'?"),
        ({"Top_P": 0.5}, "Top_P", "unknown_parameter", "did you mean 'top_p'?"),
        ({"model": 7}, "model", "invalid_type", "string"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages", "invalid_value", "empty prompt"),
    ],
)
def test_bad_fields_are_400_naming_the_field(server, fields, param, code, words):
    assert_error(post(server, chat_body(server, **fields)), 400, param, code, words)


def test_a_prompt_longer_than_the_context_is_400(server):
    long = " ".join(["hello world"] * 300)  # over the tiny model's 256-token context
    err = assert_error(
        post(server, chat_body(server, messages=[{"role": "user", "content": long}], max_tokens=None)),
        400,
        "messages",
        "context_length_exceeded",
        "maximum context length is 256",
    )
    assert "prompt has" in err["message"]
    body = {"model": server.engines.model_id, "prompt": long}
    assert_error(post(server, body, "/completions"), 400, "prompt", "context_length_exceeded")


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[" * 3000 + b"]" * 3000, "JSON"),  # deeper than the parser recurses
    ],
)
def test_malformed_bodies_are_400(server, body, words):
    assert_error(post(server, body), 400, words=words)


def test_unknown_model_is_404(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert "gpt-17" in info.value.message
    assert_error(httpx.get(f"{server.url}/models/gpt-17"), 404, "model", "model_not_found")


def test_the_openai_client_raises_bad_request_with_the_message(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.engines.model_id, messages=[{"role": "user", "content": "hi"}], n=40
        )
    assert info.value.status_code == 400 and info.value.param == "n"


def test_body_over_the_limit_is_413(server):
    big = chat_body(server, messages=[{"role": "user", "content": "x" * (LIMIT + 10)}])
    assert_error(post(server, big), 413, code="request_too_large", words=f"{LIMIT}-byte limit")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(4):
            yield b" " * (LIMIT // 2)

    r = httpx.post(server.url + "/chat/completions", content=chunks(), timeout=60)
    assert_error(r, 413, code="request_too_large")


def test_wrong_method_and_path(server):
    err = assert_error(httpx.get(f"{server.url}/chat/completions"), 405, code="method_not_allowed")
    assert err["type"] == "invalid_request_error"
    assert "POST" in httpx.get(f"{server.url}/chat/completions").headers["allow"]
    assert_error(httpx.post(f"{server.url}/models", json={}), 405)
    assert_error(httpx.get(server.url.removesuffix("/v1") + "/nothing"), 404, code="not_found")


def test_no_cors_headers_unless_asked(server):
    r = httpx.get(f"{server.url}/models", headers={"Origin": "http://evil.example"})
    assert not any(h.lower().startswith("access-control") for h in r.headers)
    pre = httpx.options(
        f"{server.url}/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in pre.headers


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"modalities": ["text"]},
        {"logit_bias": {}},
        {"min_p": 0},
        {"dry_multiplier": 0},
        # fields that change nothing in the answer, some named like one that does
        {"user": "someone", "metadata": {"a": "b"}, "store": False},
        {"mirostat_tau": 5.0, "temperature_last": True},
        {"cache_prompt": True, "chat_template_kwargs": {}},
    ],
)
def test_fields_that_ask_for_what_the_server_does_are_taken(server, fields):
    r = post(server, chat_body(server, temperature=0, **fields))
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][0]["message"]["content"]
        == post(server, chat_body(server, temperature=0)).json()["choices"][0]["message"]["content"]
    )


def test_still_serving_after_all_that(server):
    r = post(server, chat_body(server))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def keyed(tiny_llama):
    engine = load_engine(tiny_llama)
    config = ServeConfig(api_key=KEY, cors_origins=("http://app.example",))
    with serving(engine, config=config) as srv:
        yield srv
    engine.close()


def test_api_key_missing_or_wrong_is_401(keyed):
    for headers, words in (
        ({}, "missing API key"),
        ({"Authorization": "Bearer nope"}, "incorrect API key"),
        ({"Authorization": KEY}, "incorrect API key"),
    ):
        err = assert_error(httpx.get(f"{keyed.url}/models", headers=headers), 401, code="invalid_api_key", words=words)
        assert KEY not in err["message"]
    wrong = openai.OpenAI(base_url=keyed.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=keyed.engines.model_id, messages=[{"role": "user", "content": "hi"}])
    right = openai.OpenAI(base_url=keyed.url, api_key=KEY, max_retries=0)
    r = right.chat.completions.create(
        model=keyed.engines.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.usage.completion_tokens >= 1


def test_cors_only_for_the_given_origin(keyed):
    ok = httpx.options(
        f"{keyed.url}/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.get(
        f"{keyed.url}/models", headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"}
    )
    assert "access-control-allow-origin" not in other.headers


def test_a_preflight_may_name_any_header_for_an_allowed_origin(keyed):
    """The OpenAI and Anthropic JavaScript SDKs send X-Stainless-* headers with every request."""
    asked = "authorization, content-type, x-stainless-os, x-stainless-lang"
    pre = httpx.options(
        f"{keyed.url}/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert pre.status_code == 200, pre.text
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"x-stainless-os", "x-stainless-lang", "authorization"} <= allowed


def test_without_a_key_web_pages_and_other_host_names_are_refused(server):
    """A keyless server is loopback-only, which keeps out other machines but not this machine's browser: a page's
    form POST (no preflight) or a page whose name resolves to 127.0.0.1 (DNS rebinding). Both are 403, and the
    engine never sees them."""
    served = server.engines.stats.served
    body = json.dumps(chat_body(server)).encode()
    form = httpx.post(
        server.url + "/chat/completions",
        content=body,
        headers={"content-type": "text/plain", "origin": "http://evil.example"},
        timeout=60,
    )
    assert_error(form, 403, code="forbidden", words="does not answer web pages")
    rebound = httpx.get(f"{server.url}/models", headers={"host": "attacker.example:8080"})
    assert_error(rebound, 403, code="forbidden", words="'attacker.example:8080'")
    assert server.engines.stats.served == served
    port = server.url.split(":")[2].split("/")[0]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(f"{server.url}/models", headers={"host": host}).status_code == 200, host
    assert post(server, chat_body(server)).status_code == 200  # no Origin: a program, not a page


def test_with_a_key_a_page_needs_the_key(keyed):
    """With a key the server may listen beyond loopback (any Host) and a page may call it, as it cannot know the
    key: only the key is checked."""
    page = {"Origin": "http://evil.example", "host": "gpu-box.lan:8000"}
    assert_error(httpx.get(f"{keyed.url}/models", headers=page), 401, code="invalid_api_key")
    ok = httpx.get(f"{keyed.url}/models", headers={**page, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_an_allowed_origin_is_answered_without_a_key(tiny_llama):
    engine = load_engine(tiny_llama)
    try:
        with serving(engine, config=ServeConfig(cors_origins=("http://app.example",))) as srv:
            r = httpx.post(
                srv.url + "/chat/completions",
                json=chat_body(srv),
                headers={"Origin": "http://app.example"},
                timeout=60,
            )
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
            assert_error(
                httpx.get(f"{srv.url}/models", headers={"Origin": "http://other.example"}), 403, code="forbidden"
            )
    finally:
        engine.close()


@pytest.mark.parametrize("key", ["clé", "tab\tkey", " spaced", "sk-1\n"])
def test_a_key_no_client_could_send_is_refused_at_start(key):
    from app.server.run import ServeError, check_address

    with pytest.raises(ServeError, match="printable ASCII"):
        check_address("127.0.0.1", key)
    check_address("0.0.0.0", "sk-fine_0123")


def test_seed_minus_one_asks_for_a_random_seed_as_llama_cpp_reads_it():
    from app.server.protocol import parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request({**body, "seed": -1}, chat=True, model_id="m").seed is None
    assert parse_request({**body, "seed": 2**63 - 1}, chat=True, model_id="m").seed == 2**63 - 1


def test_a_prompt_of_megabytes_is_refused_without_tokenizing_it(server, monkeypatch):
    """Tokenizing 4 MB takes seconds on the engine's thread, which every other request waits for: a prompt whose
    characters alone prove it too long for the context is refused before."""
    import engine.prompt as prompt
    from app.server.engine_queue import NORMALISATION_MARGIN, longest_token

    served = server.engines.engine
    longest = longest_token(served.tokenizer)
    over = NORMALISATION_MARGIN * longest * served.context_length + 1
    calls = []
    real = prompt.build_prompt
    monkeypatch.setattr(prompt, "build_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    err = assert_error(
        post(server, chat_body(server, messages=[{"role": "user", "content": "a" * over}], max_tokens=None)),
        400,
        "messages",
        "context_length_exceeded",
        f"{over:,} characters, and a token of this model covers at most {longest}",
    )
    assert "maximum context length is 256" in err["message"] and calls == []
    # just under the bound the prompt is tokenized and counted as before
    under = chat_body(server, messages=[{"role": "user", "content": "a" * (over - 1)}], max_tokens=None)
    assert "prompt has" in assert_error(post(server, under), 400, "messages", "context_length_exceeded")["message"]
    assert calls == [1]


def test_as_many_messages_as_the_context_has_tokens_are_refused_without_rendering_them(server, monkeypatch):
    """120,000 one-character messages passed the characters' bound and held the engine 4.8 s before the 400."""
    import engine.prompt as prompt

    ctx = server.engines.engine.context_length
    calls = []
    real = prompt.build_prompt
    monkeypatch.setattr(prompt, "build_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    turns = [{"role": "user", "content": "a"}] * (ctx + 1)

    def compact(body: dict) -> bytes:  # under the test server's body limit
        return json.dumps(body, separators=(",", ":")).encode()

    err = assert_error(
        post(server, compact(chat_body(server, messages=turns, max_tokens=None))),
        400,
        "messages",
        "context_length_exceeded",
        f"the prompt has {ctx + 1:,} messages, and each takes at least one token",
    )
    assert f"maximum context length is {ctx}" in err["message"] and calls == []
    under = compact(chat_body(server, messages=turns[: ctx - 1], max_tokens=None))  # fewer: rendered and counted
    assert "prompt has" in assert_error(post(server, under), 400, "messages", "context_length_exceeded")["message"]
    assert calls == [1]


def test_n_the_engine_could_not_run_whole_is_an_error_not_fewer_choices(server, monkeypatch):
    """Out of device memory, the engine halves the candidates and says so; an OpenAI client counts on n choices
    (`r.choices[3]`), so the server says n could not be served instead of answering fewer."""
    from dataclasses import replace

    engine = server.engines.engine
    real = engine.generate

    def halved(messages, sampling, *args, **kwargs):
        r = real(messages, sampling, *args, **kwargs)
        if len(r.texts) < 4:
            return r
        notice = "out of device memory with 4 candidates: ran 2"
        return replace(r, texts=r.texts[:2], finish_reasons=r.finish_reasons[:2], notices=[*r.notices, notice])

    monkeypatch.setattr(engine, "generate", halved)
    assert_error(
        post(server, chat_body(server, n=4)),
        503,
        code=None,
        words="n=4 could not be served: out of device memory with 4 candidates: ran 2; ask for fewer",
    )
    assert post(server, chat_body(server, n=2)).json()["choices"][1]["index"] == 1


def test_extensions_asking_for_what_the_server_does_anyway_are_accepted(server):
    plain = {"ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "function_call": "none", "best_of": 1}
    plain |= {"typical_p": 1.0, "mirostat": 0, "repeat_penalty": 1.0}
    plain |= {"add_generation_prompt": True, "skip_special_tokens": True, "include_stop_str_in_output": False}
    plain |= {"chat_template_kwargs": {}, "continue_final_message": False, "add_special_tokens": False}
    r = post(server, chat_body(server, **plain))
    assert r.status_code == 200, r.text
    # vLLM's add_special_tokens as this server reads a completion's prompt (it was refused as a misspelling of
    # skip_special_tokens); the other value is refused in its own words
    body = {"model": chat_body(server)["model"], "prompt": "hello", "max_tokens": 2}
    assert post(server, {**body, "add_special_tokens": True}, "/completions").status_code == 200
    assert_error(
        post(server, {**body, "add_special_tokens": False}, "/completions"),
        400,
        "add_special_tokens",
        "unsupported_parameter",
        "only true: the tokenizer's are added",
    )
    # no template is applied to a completion's prompt: no assistant turn is added (true was taken, false refused)
    assert post(server, {**body, "add_generation_prompt": False}, "/completions").status_code == 200
    assert_error(
        post(server, {**body, "add_generation_prompt": True}, "/completions"),
        400,
        "add_generation_prompt",
        "unsupported_parameter",
        "only false: a completion's prompt is read as given, without a chat template",
    )


def test_a_client_that_goes_away_while_sending_its_body_is_no_server_error(server, caplog):
    import logging
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(server.url)
    with caplog.at_level(logging.ERROR):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model":'
            )
        assert post(server, chat_body(server)).status_code == 200  # the server goes on, and has read the close
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_the_completions_endpoint_refuses_logprobs_0_and_honours_max_completion_tokens(server):
    """On /v1/completions `logprobs` is a count, and 0 asks for the chosen tokens' own (taken as "off", as the
    chat endpoint's false is); `max_completion_tokens` was let through there and never read, so the answer ran to
    the end of the context."""
    body = {"model": chat_body(server)["model"], "prompt": "hello", "temperature": 0}
    assert_error(post(server, {**body, "logprobs": 0}, "/completions"), 400, "logprobs", "unsupported_parameter")
    r = post(server, {**body, "max_completion_tokens": 3}, "/completions")
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length", r.json()
    # the chat endpoint's logprobs false (and 0) stays "off"
    assert post(server, chat_body(server, logprobs=False, max_tokens=2)).status_code == 200
