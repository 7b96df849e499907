"""The remote engine against a misbehaving stand-in server on loopback: garbage, a stream dropped mid-answer, a
server that stops sending, an HTTP error; each a clear message with the text streamed until then delivered. And
the server figures it reads: llama.cpp's `timings`, vLLM's `/metrics`."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from app.server.run import AsgiThread
from engine.errors import GenerationError, ModelLoadError
from engine.remote import RemoteEngine, RemoteSource
from engine.types import GenerationResult, SamplingParams, TextDelta

HELLO = [{"role": "user", "content": "hi"}]
MODELS = [
    "garbage",
    "drop",
    "unfinished",
    "stall",
    "error500",
    "busy429",
    "midstream-error",
    "llamacpp",
    "vllm",
    "nousage",
    "finished-no-done",
    "done-no-finish",
    "delta-not-object",
    "choices-not-list",
    "html500",
    "odd-timings",
    "hold-headers",
    "stall-noted",
    "finished-keep-open",
    "endless-line",
    "foreign-x-gapless",
    "burst",
    "split-emoji",
    "half-at-end",
    "reasoning",
    "stray-index",
    "stray-finish",
    "content-filter",
    "tool-calls",
    "odd-usage",
    "quotes-key",
]


class StandIn:
    """Each model name is one behaviour. `vllm_requests` counts the TTFT histogram's observations."""

    def __init__(self) -> None:
        self.vllm_requests = 0
        self.bodies: dict[str, dict] = {}  # the last request body per model
        self.stalled: list[asyncio.Event] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.left: list[str] = []  # models whose client closed the connection before the answer ended

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/slow/v1/models", self.slow_models),
                Route("/odd/v1/models", self.models),
                Route("/trickle/v1/models", self.trickle_models),
                Route("/echo/v1/models", self.echo_key),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/metrics", self.metrics),
            ]
        )

    async def models(self, _r: Request):
        owners = {"llamacpp": "llamacpp", "vllm": "vllm"}  # as those servers name themselves
        data: list = [{"id": m, "object": "model", **({"owned_by": owners[m]} if m in owners else {})} for m in MODELS]
        if _r.url.path.startswith("/odd/"):
            data[0]["meta"] = 5  # a server's field of its own, not an object
            data.append("not a model entry")
        return JSONResponse({"object": "list", "data": data})

    async def echo_key(self, r: Request):  # a server that quotes the key it refuses
        said = f"invalid api key: {r.headers.get('authorization')}"
        return JSONResponse({"error": {"message": said}}, status_code=401)

    async def slow_models(self, r: Request):  # a server that takes its time to list its models
        await asyncio.sleep(5)
        return await self.models(r)

    async def trickle_models(self, r: Request):  # a byte at a time: each read in time, the whole never
        async def bytes_one_by_one():
            for b in b'{"object": "list", "data": []}' + b" " * 1000:
                yield bytes([b])
                await asyncio.sleep(0.05)

        return StreamingResponse(bytes_one_by_one(), media_type="application/json")

    async def metrics(self, _r: Request):
        n = self.vllm_requests
        return PlainTextResponse(
            "# HELP vllm:num_requests_running Number of requests running.\n"
            f'vllm:num_requests_running{{model_name="vllm"}} 3.0\n'
            f'vllm:num_requests_waiting{{model_name="vllm"}} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="vllm"}} 0.25\n'
            f'vllm:time_to_first_token_seconds_sum{{model_name="vllm"}} {0.040 * n}\n'
            f'vllm:time_to_first_token_seconds_count{{model_name="vllm"}} {float(n)}\n'
        )

    @staticmethod
    def chunk(text: str, finish=None, **extra) -> str:
        return (
            "data: "
            + json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}], **extra})
            + "\n\n"
        )

    @staticmethod
    def usage_and_done() -> list[str]:
        """The usage-only event both servers send after the last token, then the end of the stream."""
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        return ["data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n", "data: [DONE]\n\n"]

    async def chat(self, request: Request):
        body = await request.json()
        model = body["model"]
        self.bodies[model] = body
        if model == "quotes-key":
            said = f"Incorrect API key provided: {request.headers.get('authorization', '').removeprefix('Bearer ')}"
            return JSONResponse({"error": {"message": said}}, status_code=401)
        if model == "error500":
            return JSONResponse({"error": {"message": "CUDA out of memory on the server"}}, status_code=500)
        if model == "busy429":
            error = {"message": "slow down", "type": "requests", "param": None, "code": "rate_limit_exceeded"}
            return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "7"})
        if model == "html500":  # a proxy's error page in front of the server
            page = "<html><head><title>502 Bad Gateway</title></head><body><h1>502</h1><hr>nginx</body></html>"
            return PlainTextResponse(page, status_code=502, media_type="text/html")
        if model == "hold-headers":  # works on the prompt, headers not sent yet, until its client leaves
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.left.append(model)
            return PlainTextResponse("", status_code=499)

        async def events():
            if model == "burst":  # as a buffering proxy passes a stream on: all of it in one write
                yield (
                    self.chunk("Hello") + self.chunk(" there") + self.chunk("", "stop") + "".join(self.usage_and_done())
                )
                return
            if model in ("split-emoji", "half-at-end"):  # text cut by UTF-16 index, as JavaScript's strings are
                halves = ["\ud83d", "\ude00"] if model == "split-emoji" else ["\ude00", " ok \ud83d"]
                for text in ("Hi ", *halves, " there" if model == "split-emoji" else ""):
                    yield self.chunk(text)
                    await asyncio.sleep(0.01)
                yield self.chunk("", "stop")
                yield "data: [DONE]\n\n"
                return
            if model == "reasoning":  # llama.cpp's server on a thinking model: the thinking apart, then the answer
                for part in ("Let me", " think."):
                    event = {"choices": [{"index": 0, "delta": {"reasoning_content": part}, "finish_reason": None}]}
                    yield "data: " + json.dumps(event) + "\n\n"
                yield self.chunk("Hi.")
                yield self.chunk("", "stop")
                yield "data: [DONE]\n\n"
                return
            if model in ("stray-index", "stray-finish"):  # events for an answer 3 (or 5) that was not asked for
                yield self.chunk("A1")
                stray = {"index": 3, "delta": {"content": "ZZ"}, "finish_reason": None}
                if model == "stray-finish":
                    stray = {"index": 5, "delta": {}, "finish_reason": "stop"}
                yield "data: " + json.dumps({"choices": [stray]}) + "\n\n"
                yield self.chunk("A2")
                yield self.chunk("", "stop")
                for event in self.usage_and_done():
                    yield event
                return
            if model in ("content-filter", "tool-calls", "odd-usage"):
                yield self.chunk("Hello")
                finish = {"content-filter": "content_filter", "tool-calls": "tool_calls"}.get(model, "stop")
                yield self.chunk("", finish)
                usage = {"prompt_tokens": "5", "completion_tokens": -7} if model == "odd-usage" else None
                if usage is not None:
                    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                for event in self.usage_and_done():
                    yield event
                return
            yield self.chunk("Hello")
            await asyncio.sleep(0.01)  # the server's next step
            yield self.chunk(" there")
            if model == "garbage":
                yield "data: <html>502 Bad Gateway</html>\n\n"
            elif model == "drop":
                raise RuntimeError("the stand-in drops the connection")
            elif model == "unfinished":
                return
            elif model == "stall-noted":  # sends nothing more; notes when its client leaves
                try:
                    await asyncio.sleep(3600)
                finally:
                    self.left.append(model)
            elif model == "finished-keep-open":  # the answer ends with its usage, and the server never closes
                yield self.chunk("", "stop")
                yield self.usage_and_done()[0]
                await asyncio.sleep(3600)
            elif model == "endless-line":  # one line that never ends
                yield "data: "
                while True:
                    yield "x" * 65536
                    await asyncio.sleep(0)
            elif model == "foreign-x-gapless":  # a server that is not Gapless, sending a field named as ours
                figure = {"value": 1e9, "source": "trust me"}
                yield self.chunk("", "stop", x_gapless={"ttft_ms": figure, "decode_tok_s": figure})
                yield "data: [DONE]\n\n"
            elif model == "stall":
                self.loop = asyncio.get_running_loop()
                release = asyncio.Event()
                self.stalled.append(release)
                await release.wait()
            elif model == "nousage":  # as llama-cpp-python's server streams: no usage chunk, no timings
                yield self.chunk("", "stop")
                yield "data: [DONE]\n\n"
            elif model == "finished-no-done":  # every answer finished, then the server closes without [DONE]
                yield self.chunk("", "stop")
            elif model == "done-no-finish":
                yield "data: [DONE]\n\n"
            elif model == "delta-not-object":
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": "oops"}]}) + "\n\n"
            elif model == "choices-not-list":
                yield "data: " + json.dumps({"choices": 5}) + "\n\n"
            elif model == "midstream-error":
                yield "data: " + json.dumps({"error": {"message": "the model crashed"}}) + "\n\n"
            elif model == "llamacpp":
                yield self.chunk("", "stop", timings={"prompt_ms": 12.5, "predicted_per_second": 88.0})
                for event in self.usage_and_done():
                    yield event
            elif model == "odd-timings":  # a server's report that is not a figure
                yield self.chunk("", "stop", timings={"prompt_ms": -3, "predicted_per_second": float("nan")})
                for event in self.usage_and_done():
                    yield event
            elif model == "vllm":
                self.vllm_requests += 1
                yield self.chunk("", "length")
                for event in self.usage_and_done():
                    yield event

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def stand_in():
    s = StandIn()
    server = AsgiThread(s.app())
    yield s, server
    for release in s.stalled:  # let the stalled answers end
        s.loop.call_soon_threadsafe(release.set)
    server.stop()


def run(server, model: str, timeout_s: float = 30.0):
    engine = RemoteEngine.load(RemoteSource(server.url, model, timeout_s))
    deltas: list = []
    try:
        with pytest.raises(GenerationError) as info:
            engine.generate(HELLO, SamplingParams(max_new_tokens=8), on_event=deltas.append)
    finally:
        engine.close()
    return str(info.value), "".join(d.text for d in deltas if isinstance(d, TextDelta))


@pytest.mark.parametrize(
    "model, words",
    [
        ("garbage", "sent an event that is not JSON: '<html>502 Bad Gateway</html>'"),
        ("drop", "dropped the connection"),
        ("unfinished", "closed the stream before the answer ended"),
        ("midstream-error", "reported an error: the model crashed"),
        ("delta-not-object", "sent an event whose delta is not an object"),
        ("choices-not-list", "sent an event whose choices are not a list"),
    ],
)
def test_a_broken_stream_is_a_clear_error_and_the_partial_text_was_delivered(stand_in, model, words):
    _, server = stand_in
    message, text = run(server, model)
    assert words in message and f"the remote server at {server.url}" in message
    assert message.endswith("(the partial answer is kept)")
    assert text == "Hello there"


def test_a_server_that_stops_sending_times_out_at_the_user_s_timeout(stand_in):
    s, server = stand_in
    # 1.5 s: the same limit covers the connect and the first chunk, which a loaded machine may delay
    message, text = run(server, "stall", timeout_s=1.5)
    assert "did not send anything for 1.5 s" in message and text == "Hello there"


def test_stop_does_not_wait_for_a_stalled_server(stand_in):
    import threading

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "stall", 120.0))
    cancel = threading.Event()
    deltas: list[TextDelta] = []

    def on_event(event) -> None:
        if isinstance(event, TextDelta):
            deltas.append(event)
            cancel.set()  # the user presses stop at the first text; the server then sends nothing more

    try:
        r = engine.generate(HELLO, SamplingParams(max_new_tokens=8), on_event=on_event, cancel=cancel)
    finally:
        engine.close()
    assert r.finish_reasons == ["cancelled"] and r.texts == ["Hello"] and [d.text for d in deltas] == ["Hello"]


def test_an_http_error_gives_the_server_s_message(stand_in):
    _, server = stand_in
    message, text = run(server, "error500")
    assert message == "the remote server refused the request (HTTP 500): CUDA out of memory on the server"
    assert text == ""


@pytest.mark.parametrize(
    "model, status, code, retry_after",
    [("error500", 502, "upstream_error", None), ("busy429", 429, "rate_limit_exceeded", "7")],
)
def test_gapless_serve_in_front_passes_on_what_a_refusal_means(stand_in, model, status, code, retry_after):
    """A remote server's refusal was a 500 from a Gapless server in front of it, whatever it was: a client then
    retried its own mistakes and never saw the remote server's Retry-After."""
    import httpx
    from serving import serving

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, model))
    try:
        with serving(engine) as front:
            r = httpx.post(
                f"{front.url}/chat/completions", json={"model": model, "messages": HELLO, "max_tokens": 8}, timeout=30
            )
    finally:
        engine.close()
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert r.headers.get("retry-after") == retry_after


def test_a_refusal_that_asks_to_wait_says_how_long(stand_in):
    _, server = stand_in
    message, _ = run(server, "busy429")
    assert message == "the remote server refused the request (HTTP 429): slow down; it asks to be asked again in 7 s"


def test_a_proxy_s_error_page_is_said_by_its_title(stand_in):
    _, server = stand_in
    message, _ = run(server, "html500")
    assert message == "the remote server refused the request (HTTP 502): 502 Bad Gateway"


@pytest.mark.parametrize("model", ["finished-no-done", "done-no-finish"])
def test_an_answer_that_ended_is_kept_without_done_or_without_a_finish_reason(stand_in, model):
    """Servers end streams their own ways: a finished answer without [DONE] is complete, and a [DONE] without a
    finish reason ended the answer (nobody stopped it here)."""
    _, server = stand_in
    r = answer(server, model)
    assert r.texts == ["Hello there"] and r.finish_reasons == ["eos"]


def test_a_server_that_ignores_n_and_closes_without_done_keeps_its_one_answer(stand_in):
    """Asked for two candidates, a server that sends one finished answer and closes without [DONE] (as for one)
    failed the answer: "closed the stream before the answer ended"."""
    from engine.types import EngineOptions

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "finished-no-done"), EngineOptions(candidates=2))
    try:
        r = engine.generate(HELLO, SamplingParams(max_new_tokens=8))
    finally:
        engine.close()
    assert r.texts == ["Hello there"] and r.finish_reasons == ["eos"]
    assert "the server returned 1 answer(s) for 2 candidates" in r.notices


def answer(server, model: str) -> GenerationResult:
    """One answer of the stand-in's `model` through a fresh remote engine."""
    engine = RemoteEngine.load(RemoteSource(server.url, model))
    try:
        return engine.generate(HELLO, SamplingParams(max_new_tokens=8))
    finally:
        engine.close()


def test_llama_cpp_timings_are_read_with_their_source(stand_in):
    _, server = stand_in
    r = answer(server, "llamacpp")
    m = r.metrics
    assert r.texts == ["Hello there"] and r.finish_reasons == ["eos"]
    assert (m.prompt_tokens, m.new_tokens_total) == (4, 3)
    assert m.figure("new_tokens_total").source == "the server's token usage (OpenAI stream usage)"
    assert m.figure("decode_steps").value is None and "remote server" in m.figure("decode_steps").reason
    assert m.figure("server_ttft_ms").value == 12.5
    assert m.figure("server_ttft_ms").source == "llama.cpp timings.prompt_ms (prompt processing)"
    assert m.figure("server_decode_tok_s").value == 88.0
    gap = m.figure("inter_token_ms_p50")  # two text chunks: one gap
    assert gap.value is not None and gap.value >= 0 and gap.source == "client-side timing over HTTP"
    assert m.figure("http_ttft_ms").value > 0
    assert m.figure("http_decode_tok_s").value > 0  # 3 tokens over the span of the two text chunks
    assert m.figure("kernel_gap_pct").reason.startswith("the model runs on a remote server")


def test_a_server_s_report_that_is_not_a_figure_is_na_with_the_reason(stand_in):
    _, server = stand_in
    m = answer(server, "odd-timings").metrics
    f = m.figure("server_ttft_ms")
    assert f.value is None and f.reason == "the server reported a value that is -3.0, not a count or a time"
    assert m.figure("server_decode_tok_s").value is None
    from engine.figures import metrics_problem

    assert metrics_problem(m.to_dict()) is None  # the answer's figures can be stored and shown again


def test_vllm_metrics_are_read_with_their_source(stand_in):
    s, server = stand_in
    r = answer(server, "vllm")
    m = r.metrics
    assert r.finish_reasons == ["length"]
    assert m.figure("server_running_requests").value == 3.0
    assert m.figure("server_waiting_requests").value == 1.0
    assert m.figure("server_kv_cache_pct").value == 25.0
    assert "vLLM Prometheus /metrics" in m.figure("server_kv_cache_pct").source
    ttft = m.figure("server_ttft_ms")
    assert ttft.value == pytest.approx(40.0) and "mean of 1 request(s)" in ttft.source


def test_counts_a_server_does_not_report_are_na_not_zero(stand_in):
    from ui.stats import format_stats

    _, server = stand_in
    r = answer(server, "nousage")
    m = r.metrics
    assert r.texts == ["Hello there"] and r.finish_reasons == ["eos"]
    for key in ("prompt_tokens", "new_tokens_total", "http_decode_tok_s"):
        f = m.figure(key)
        assert f.value is None and f.reason == "the server reported no token usage", key
    assert m.figure("http_ttft_ms").value > 0  # what the client measures itself is still there
    line, _tip = format_stats(m.to_dict(), None, None)
    assert line.startswith("n/a tokens")


def test_opening_waits_for_the_model_list_not_the_whole_answer_timeout(stand_in, monkeypatch):
    """The app cannot stop an opening: a server slow to list its models is given up after LIST_TIMEOUT_S, not
    after the answer timeout (up to an hour)."""
    import engine.remote

    _, server = stand_in
    monkeypatch.setattr(engine.remote, "LIST_TIMEOUT_S", 0.5)
    slow = server.url.replace("/v1", "/slow/v1")
    with pytest.raises(ModelLoadError, match="did not list its models within 0.5 s"):
        RemoteEngine.load(RemoteSource(slow, "llamacpp", 3600.0))


def test_a_model_list_sent_a_byte_at_a_time_is_given_up_at_the_list_s_time(stand_in, monkeypatch):
    """httpx's timeout is per read: a server sending a byte every 0.5 s held an opening the app cannot stop for 61 s
    with a 2 s list timeout (a byte every 20 s: for ever)."""
    import time

    import engine.remote

    _, server = stand_in
    monkeypatch.setattr(engine.remote, "LIST_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="did not list its models within 0.5 s"):
        RemoteEngine.load(RemoteSource(server.url.replace("/v1", "/trickle/v1"), "llamacpp", 3600.0))
    assert time.monotonic() - started < 5  # the whole body would take 50 s


def test_a_model_the_server_says_nothing_about_is_null_with_reasons_in_the_json(stand_in):
    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "nousage"))
    try:
        model = engine.info.to_dict()
    finally:
        engine.close()
    assert engine.context_length == 0  # this stand-in lists its models without a context length
    for key in ("parameters", "weight_bytes", "context_length"):
        assert model[key] is None and model["unavailable"][key].startswith("n/a: the server does not"), key
    assert json.loads(json.dumps(model)) == model


@pytest.mark.parametrize(
    "model, sent",
    [
        ("llamacpp", {"top_k": 40, "repeat_penalty": 1.1}),
        ("vllm", {"top_k": 40, "repetition_penalty": 1.1}),
        ("nousage", {}),  # a server not known to take them: OpenAI's own API refuses fields it does not know
    ],
)
def test_top_k_and_repetition_penalty_go_to_servers_known_to_take_them(stand_in, model, sent):
    s, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, model))
    try:
        r = engine.generate(HELLO, SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1, max_new_tokens=8))
    finally:
        engine.close()
    extensions = ("top_k", "repetition_penalty", "repeat_penalty")
    assert {k: v for k, v in s.bodies[model].items() if k in extensions} == sent
    said = [n for n in r.notices if "not applied" in n]
    if sent:
        assert said == []
    else:
        assert said == [
            "top-k 40 and repetition penalty 1.1 not applied: the OpenAI API has no such setting, and this server "
            "is not one known to take it (Gapless, vLLM, llama.cpp), so it sampled without it"
        ]


def test_a_gapless_server_fronting_a_server_that_lacks_top_k_refuses_it(stand_in):
    import httpx
    from serving import serving

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "nousage"))
    try:
        with serving(engine) as front:
            body = {"model": front.engines.model_id, "messages": HELLO, "max_tokens": 8, "top_k": 5}
            r = httpx.post(f"{front.url}/chat/completions", json=body, timeout=30)
            ok = httpx.post(f"{front.url}/chat/completions", json={**body, "top_k": 0}, timeout=30)
    finally:
        engine.close()
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert "not one known to take it" in r.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello there"


def test_the_app_on_a_gapless_server_fronting_such_a_server_is_told_not_to_send_top_k(stand_in):
    """The front server lists the sampling settings it honours; the app's defaults (top-k 40, penalty 1.1) then
    go unsent with a notice instead of every answer failing with that 400."""
    from serving import serving

    _, server = stand_in
    behind = RemoteEngine.load(RemoteSource(server.url, "nousage"))
    try:
        with serving(behind) as front:
            app = RemoteEngine.load(RemoteSource(front.url, front.engines.model_id))
            try:
                assert not app.passes_on("top_k") and not app.passes_on("repetition_penalty")
                r = app.generate(
                    HELLO, SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1, max_new_tokens=8)
                )
            finally:
                app.close()
    finally:
        behind.close()
    assert r.texts == ["Hello there"] and any("not applied" in n for n in r.notices)


@pytest.mark.parametrize("model", ["hold-headers", "stall-noted"])
def test_stop_closes_the_request_to_the_remote_server_at_once(stand_in, model):
    """Stop returned at once, but the request stayed open until the server's next line or the whole timeout: a
    server kept working on the prompt for nobody, and a busy one's queue (a Gapless server's too) stayed full."""
    import threading
    import time

    s, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, model, 120.0))
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    try:
        r = engine.generate(HELLO, SamplingParams(max_new_tokens=8), cancel=cancel)
        deadline = time.monotonic() + 10
        while model not in s.left and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.close()
    assert r.finish_reasons == ["cancelled"]
    assert model in s.left  # the server saw its client leave (within seconds, not the 120 s timeout)


def test_closing_the_engine_ends_an_answer_still_being_read(stand_in):
    """A model switched mid-answer: close() left the request open; the answer then ends with why."""
    import threading
    import time

    s, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "hold-headers", 120.0))
    said: list[str] = []
    reading = threading.Thread(target=lambda: said.append(answer_error(engine)), daemon=True)
    reading.start()
    time.sleep(0.5)
    before = s.left.count("hold-headers")
    engine.close()
    deadline = time.monotonic() + 10
    while s.left.count("hold-headers") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    reading.join(10)
    assert s.left.count("hold-headers") == before + 1
    assert not reading.is_alive() and said == [f"the remote model at {server.url} was closed while it answered"]


def answer_error(engine) -> str:
    try:
        engine.generate(HELLO, SamplingParams(max_new_tokens=8))
    except GenerationError as exc:
        return str(exc)
    return "answered"


def test_an_answer_that_ended_with_its_usage_is_kept_when_the_server_never_closes(stand_in):
    """A finished answer with its usage, then neither [DONE] nor a close: it became an error after the timeout."""
    import time

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, "finished-keep-open", 30.0))
    try:
        started = time.monotonic()
        r = engine.generate(HELLO, SamplingParams(max_new_tokens=8))
        took = time.monotonic() - started
    finally:
        engine.close()
    assert r.texts == ["Hello there"] and r.finish_reasons == ["eos"]
    assert r.metrics.figure("new_tokens_total").value == 3
    assert took < 20  # ended by the answer, not by the 30 s timeout


def test_a_line_without_end_is_refused_before_it_fills_the_memory(stand_in, monkeypatch):
    import engine.remote

    _, server = stand_in
    monkeypatch.setattr(engine.remote, "MAX_LINE_CHARS", 1_000_000)
    message, _text = run(server, "endless-line")
    assert "sent a line of more than 1,000,000 characters" in message


def test_figures_named_as_a_gapless_server_s_are_read_only_from_one(stand_in):
    _, server = stand_in
    m = answer(server, "foreign-x-gapless").metrics
    assert m.figure("server_ttft_ms").value is None and m.figure("server_decode_tok_s").value is None


def test_a_model_list_with_entries_of_other_shapes_still_opens(stand_in):
    """A server's own field that is not an object ("meta": 5) ended the opening with an AttributeError."""
    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url.replace("/v1", "/odd/v1"), MODELS[0]))
    engine.close()


def test_a_gapless_server_in_front_says_null_for_counts_its_remote_did_not_report(stand_in):
    """A Gapless server in front of a server without usage answered usage 0/0/0: an app in front of it then
    showed "0 new tokens" from "the server's token usage" for an answer with text."""
    import httpx
    from serving import serving

    _, server = stand_in
    behind = RemoteEngine.load(RemoteSource(server.url, "nousage"))
    try:
        with serving(behind) as front:
            body = {"model": front.engines.model_id, "messages": HELLO, "max_tokens": 8}
            plain = httpx.post(f"{front.url}/chat/completions", json=body, timeout=30).json()
            app = RemoteEngine.load(RemoteSource(front.url, front.engines.model_id))
            try:
                r = app.generate(HELLO, SamplingParams(max_new_tokens=8))
            finally:
                app.close()
    finally:
        behind.close()
    assert plain["usage"] is None and plain["choices"][0]["message"]["content"] == "Hello there"
    assert r.texts == ["Hello there"]
    for key in ("prompt_tokens", "new_tokens_total"):
        assert r.metrics.figure(key).value is None, key


def test_text_that_arrived_in_one_burst_has_no_rate(stand_in):
    """A proxy that buffers the stream passes it on at once: the rate over the microseconds between its events
    said 400,000 tok/s, "client-side timing over HTTP"."""
    _, server = stand_in
    r = answer(server, "burst")
    m = r.metrics
    assert r.texts == ["Hello there"] and m.new_tokens_total == 3
    for key in ("http_decode_tok_s", "inter_token_ms_p50", "inter_token_ms_p99"):
        assert m.figure(key).value is None and "arrived in one burst" in m.figure(key).reason, key
    assert m.figure("http_ttft_ms").value > 0


def _answer(server, model: str) -> tuple[GenerationResult, str]:
    engine = RemoteEngine.load(RemoteSource(server.url, model, 30.0))
    deltas: list = []
    try:
        result = engine.generate(HELLO, SamplingParams(max_new_tokens=8), on_event=deltas.append)
    finally:
        engine.close()
    return result, "".join(d.text for d in deltas if isinstance(d, TextDelta))


def test_an_emoji_sent_as_two_halves_in_two_events_is_one_character(stand_in):
    result, streamed = _answer(stand_in[1], "split-emoji")
    assert result.texts == ["Hi \U0001f600 there"] and streamed == result.texts[0]
    assert result.texts[0].encode("utf-8") and result.notices == []


def test_halves_without_their_other_half_are_replacement_characters_with_a_notice(stand_in):
    result, streamed = _answer(stand_in[1], "half-at-end")
    assert result.texts == ["Hi \ufffd ok \ufffd"] and streamed == result.texts[0]
    assert "the server sent 2 half characters without their other half; shown as \ufffd" in result.notices


def test_a_server_event_holding_a_half_character_is_still_sent_as_utf_8():
    from app.server.http import _sse

    # Starlette encodes each event as it sends it: a half character there would cut the stream without [DONE].
    assert _sse({"text": "a \ud83d"}).encode("utf-8") == 'data: {"text": "a \ufffd"}\n\n'.encode("utf-8")


def test_reasoning_sent_apart_from_the_answer_is_said_not_dropped_silently(stand_in):
    """A thinking model behind llama.cpp's or vLLM's server: with a small length limit the answer came empty and
    nothing said why."""
    result, streamed = _answer(stand_in[1], "reasoning")
    assert result.texts == ["Hi."] and streamed == "Hi."
    assert (
        "the server sent 13 characters of the model's reasoning apart from the answer (reasoning_content); "
        "they are not shown" in result.notices
    )


@pytest.mark.parametrize("model", ["stray-index", "stray-finish"])
def test_events_for_an_answer_not_asked_for_are_left_out_with_a_notice(stand_in, model):
    """An event whose index was past the answers asked for was merged into the first answer ("A1ZZA2"), and its
    finish reason ended the first answer early (its rest lost, shown as a whole answer)."""
    _, server = stand_in
    result = answer(server, model)
    assert result.texts == ["A1A2"] and result.finish_reasons == ["eos"]
    assert (
        "the server sent 1 part(s) of answers it was not asked for (an index past the 1 asked for); they are left out"
        in result.notices
    )


@pytest.mark.parametrize(
    "model, reason, notice",
    [
        ("content-filter", "filtered", None),
        ("tool-calls", "server", "the server ended the answer with the finish reason 'tool_calls'"),
    ],
)
def test_a_finish_reason_of_the_server_s_own_is_not_called_the_end_of_the_answer(stand_in, model, reason, notice):
    """ "content_filter" was shown as "end of answer" (or "stop string" where stop strings were set)."""
    from engine.types import FINISH_WORDS

    _, server = stand_in
    result = answer(server, model)
    assert result.texts == ["Hello"] and result.finish_reasons == [reason]
    assert reason in FINISH_WORDS
    assert (notice in result.notices) if notice else not any("finish reason" in n for n in result.notices)


@pytest.mark.parametrize("model, said", [("content-filter", "content_filter"), ("tool-calls", "stop")])
@pytest.mark.parametrize("stream", [False, True])
def test_gapless_serve_in_front_passes_on_the_server_s_own_finish_reasons(stand_in, model, said, stream):
    """The app's server in front of a remote model whose server ended an answer its own way failed: a 500
    "internal error: KeyError" (its finish reasons had no OpenAI name), and a stream cut without its end."""
    import openai
    from serving import serving

    _, server = stand_in
    engine = RemoteEngine.load(RemoteSource(server.url, model))
    try:
        with serving(engine) as front:
            client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)
            asked = dict(model=model, messages=HELLO, max_tokens=8)
            if stream:
                chunks = list(client.chat.completions.create(**asked, stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                r = client.chat.completions.create(**asked)
                text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
    finally:
        engine.close()
    assert text == "Hello" and finish == [said]


def test_usage_counts_that_are_no_counts_are_na_with_what_was_sent(stand_in):
    """completion_tokens -7 stayed in the answer's per-answer counts, and the stored chat read back damaged."""
    from engine.figures import metrics_problem

    _, server = stand_in
    m = answer(server, "odd-usage").metrics
    assert m.new_tokens_total is None and m.prompt_tokens is None and m.new_tokens == []
    assert m.unavailable["new_tokens_total"] == "the server reported -7, not a count of tokens"
    assert m.unavailable["prompt_tokens"] == 'the server reported "5", not a count of tokens'
    assert metrics_problem(m.to_dict()) is None


def test_an_api_key_a_server_quotes_back_is_not_shown(stand_in):
    """A server that quotes the key it refuses ("invalid api key: Bearer sk-...") had it shown, logged and kept."""
    _, server = stand_in
    key = "sk-SECRET-KEY-123456"
    with pytest.raises(ModelLoadError) as info:
        RemoteEngine.load(RemoteSource(f"{server.url.removesuffix('/v1')}/echo/v1", "m", 30.0), api_key=key)
    assert key not in str(info.value) and "invalid api key: Bearer [the API key]" in str(info.value)
    engine = RemoteEngine.load(RemoteSource(server.url, "quotes-key", 30.0), api_key=key)
    try:
        with pytest.raises(GenerationError) as info:
            engine.generate(HELLO, SamplingParams(max_new_tokens=8))
    finally:
        engine.close()
    assert key not in str(info.value) and "Incorrect API key provided: [the API key]" in str(info.value)


@pytest.mark.parametrize("kind", ["trickle", "huge"])
def test_a_metrics_endpoint_that_never_ends_or_is_huge_is_given_up(kind):
    """vLLM's /metrics sent a byte every 50 ms held the opening for as long as it went on (httpx's timeout is per
    read), and one that went on fast filled the memory (3 GiB in 12 s); either is now given up, the model opens
    without the server's figures."""

    async def models(_r: Request):
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]})

    async def metrics(_r: Request):
        async def body():
            yield b"vllm:num_requests_running 1.0\n"
            if kind == "trickle":
                for _ in range(400):  # 20 s
                    yield b"#"
                    await asyncio.sleep(0.05)
            else:
                for _ in range(256):  # 8 MiB
                    yield b"# " + b"x" * 32765 + b"\n"

        return StreamingResponse(body(), media_type="text/plain")

    server = AsgiThread(Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics)]))
    try:
        engine = RemoteEngine.load(RemoteSource(server.url, "m"))
        try:
            assert engine._vllm is None
        finally:
            engine.close()
    finally:
        server.stop()


def test_a_metrics_endpoint_that_trickles_its_headers_is_given_up():
    """Headers sent a byte at a time were read under httpx's per-read timeout alone: the 2 s of /metrics did not
    cover them, and opening the model waited as long as the server went on."""
    import socketserver
    import time

    trickled: list[int] = []  # header bytes the /metrics request took before its client left
    done = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            path = self.rfile.readline().split()[1]
            while self.rfile.readline().strip():
                pass
            if path == b"/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]}).encode()
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                self.wfile.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                return
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            sent = 0
            try:
                for _ in range(40):  # 20 s of a header's bytes, each in a read's time
                    self.wfile.write(b"X")
                    self.wfile.flush()
                    sent += 1
                    time.sleep(0.5)
                body = b"vllm:num_requests_running 1.0\n"
                self.wfile.write(b": y\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                self.wfile.flush()
            except OSError:  # the client gave up
                pass
            finally:
                trickled.append(sent)
                done.set()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    with Server(("127.0.0.1", 0), Handler) as tcp:
        threading.Thread(target=tcp.serve_forever, daemon=True).start()
        try:
            engine = RemoteEngine.load(RemoteSource(f"http://127.0.0.1:{tcp.server_address[1]}/v1", "m"))
            try:
                assert engine._vllm is None
            finally:
                engine.close()
            assert done.wait(60)
        finally:
            tcp.shutdown()
    assert trickled[0] < 40  # the client left within its time, not after the server's 20 s


def test_an_event_with_a_null_index_is_the_first_answer_s():
    """ "index": null (as some servers send for their one answer) was taken for an answer not asked for, and all
    of its text was left out."""
    from engine.remote import _Stream

    stream = _Stream(1)
    for text in ("Hello", " there"):
        stream.feed(
            "data: " + json.dumps({"choices": [{"index": None, "delta": {"content": text}}]}), False, print, 0.0
        )
    assert stream.texts == {0: "Hello there"} and stream.stray == 0


def test_a_key_cut_off_in_a_server_s_long_message_is_taken_out_too():
    from engine.remote import _without

    key = "sk-SECRET-KEY-1234567890"
    assert _without(f"bad key {key}, try again", key) == "bad key [the API key], try again"
    assert _without(f"{'x' * 190} bad key {key[:9]}", key) == f"{'x' * 190} bad key [the API key]"
    assert _without("nothing of it here: sk", key) == "nothing of it here: sk"
